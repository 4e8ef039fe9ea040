"""Chapter 09, FlashAttention-2 in Triton: graded exercises.

Each candidate is a ``@triton.jit`` function that the course's kernels in
``course_utils/kernels/flash_attention_triton.py`` call in place of their own (a JITFunction
passed as a ``tl.constexpr`` argument), so the graded code runs inside the real kernels:

- ``09.forward_inner``: ``forward_inner(acc, l_i, m_i, q, K, V, qk_scale, offs_m, offs_n, offs_d,
  lo, hi, Nk, HEAD_DIM, BLOCK_N, DIAGONAL, EVEN_N) -> (acc, l_i, m_i)``, the online-softmax loop
  of the forward kernel over the key tiles ``range(lo, hi, BLOCK_N)``, in base 2.
- ``09.causal_split``: ``causal_split(start_m, Nk, BLOCK_M, BLOCK_N, CAUSAL) -> (lo, hi,
  diag_lo, diag_hi)``, the key ranges of the unmasked and the diagonal stage of a query tile
  (used by the forward and dQ kernels). Graded through a probe kernel that calls it for many
  (start_m, Nk) at once, and inside the forward kernel.
- ``09.dkdv_inner``: ``dkdv_inner(dk, dv, k, v, Q, dO, LSE, Dv, qk_scale, offs_n, offs_m,
  offs_d, lo, hi, Nq, HEAD_DIM, BLOCK_M, DIAGONAL, EVEN_M) -> (dk, dv)``, the loop of the dK/dV
  kernel over the query tiles ``range(lo, hi, BLOCK_M)``.

On the CPU the kernels run in Triton's interpreter (float32 and float16, d = 16 or 32, small N);
on a GPU the same cases run compiled, in float16 and bfloat16 (a student's plain ``tl.dot`` on
float32 tiles would compute in TF32 there), at d = 64 and 128, with fixed tile configurations
(``FWD_CONFIG``, ``DKDV_CONFIG``, ``DQ_CONFIG``): no autotuning while grading.

Tolerances. O and LSE: ``checks.tolerance(dtype, max|S|)``. Gradients: ``|error| <= atol +
rtol |expected|`` with ``rtol = GRAD_TOL[dtype]`` and ``atol = GRAD_TOL[dtype] * max(1,
max|expected|)`` (+ ``1e-5 x max|S|`` in float32, as in chapter 08). Measured with a float32
emulation of the kernels' roundings (P and dS rounded to the input dtype before their matrix
products, outputs rounded) against float64, N up to 4097, d up to 128, logits x30: the worst
error was 4.9e-3 x max|expected| in bfloat16 and 8.6e-4 in float16; the interpreter's float32
errors stay below 1e-6. The tolerances leave a margin of 5x and stay far below the errors of a
wrong formula (a missing - D, a missing scale, a mask on the wrong side: 10-100 % of the values).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import reference
from ..checks import (
    AttentionCase,
    CheckFailure,
    assert_unchanged,
    compare,
    poisoned,
    random_qkv,
    snapshot,
    tolerance,
)
from ..grader import Exercise
from ..kernels import flash_attention_triton as fat
from ..runtime import device, pick
from . import require_implemented

LOG2E = fat.LOG2E
GRAD_TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
SCORE_ATOL = 1e-5  # float32 only: the error of S (eps x |S|) enters P through exp

# Fixed tile configurations while grading (BLOCK_M = Br query rows, BLOCK_N = Bc key rows).
FWD_CONFIG = pick(gpu=triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2),
                  cpu=triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1))
DKDV_CONFIG = pick(gpu=triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=4, num_stages=2),
                   cpu=triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1))
DQ_CONFIG = pick(gpu=triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2),
                 cpu=triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1))

# The dtypes of the cases. Most run in float32 in the interpreter (tight tolerances catch small
# slips); on a GPU they run in float16, because a plain tl.dot on float32 tiles computes in TF32
# there. One case per exercise runs in float16, and one in bfloat16 on a GPU.
F32 = pick(gpu=torch.float16, cpu=torch.float32)
LOW = torch.float16
BF16 = pick(gpu=torch.bfloat16, cpu=torch.float16)  # the interpreter cannot run bfloat16

C = AttentionCase


def _as_jit(candidate, name):
    """Refuse what cannot be plugged into a kernel, with the reason."""
    require_implemented(candidate)
    if getattr(candidate, "fn", None) is None or not callable(candidate.fn):
        raise CheckFailure(
            "setup",
            f"{name} is a {type(candidate).__name__}, not a Triton function",
            "decorate it with @triton.jit: the kernel calls it as a device function",
        )
    own = getattr(fat, name)
    if candidate is own:
        raise CheckFailure("setup", f"this is the course's own {name}",
                           "write your own version in the notebook and check that one")


def _max_score(q, k, scale):
    return float((q.double() @ k.double().transpose(-2, -1)).abs().amax()) * scale


def _scale_of(case):
    return case.scale if case.scale is not None else 1.0 / math.sqrt(case.d)


def _label(case, dtype):
    return f"{case.name} [{str(dtype).replace('torch.', '')}]"


# ----------------------------------------------------------------------------- forward inner

forward_inner = Exercise("09.forward_inner", "The online-softmax loop of the Triton forward",
                         points=3)

_HF = {
    "two": "two key tiles, and the second raises the row max: before adding the new tile, "
    "rescale l_i and acc by alpha = exp2(m_i - m_new) (m in log2 units), then P = exp2(S * "
    "qk_scale - m_new[:, None]), l_i = l_i * alpha + rowsum(P), acc = acc * alpha[:, None] + "
    "P @ V, m_i = m_new.",
    "ragged": "the last key tile is partial: the given code loads zeros past Nk and sets S = "
    "-inf there; exp2(-inf - m_new) = 0 takes those keys out of l and acc.",
    "causal": "causal: the given code masks S on the diagonal tiles (S = -inf for keys after "
    "the query); your update must handle -inf scores (exp2(-inf) = 0).",
    "large": "scores of about +-150: subtract the running max m_new before exp2, and take the "
    "max of S * qk_scale (not of S) so that m and the exponent are in the same units.",
    "fp16": "float16 inputs: tl.dot(P, v) needs both operands in one dtype: cast P (fp32) with "
    "P.to(v.dtype); acc, l_i and m_i stay float32.",
}


def _forward_runner(candidate, config):
    def fn(q, k, v, O, LSE, causal, scale):
        fat.attention_forward(q, k, v, causal, scale, out=(O, LSE), config=config,
                              inner=candidate)

    return fn


def _diagnose_forward(O, q, k, v, case, scale, atol, rtol):
    """The likely bug when O is wrong, found by matching O against variants of attention."""
    variants = (
        (scale * LOG2E, "O is the softmax of S * qk_scale in base e: use exp2 (tl.exp2), not "
         "exp: qk_scale = scale * log2(e) is already folded in, and m is in log2 units."),
        (1.0 / LOG2E, "O ignores the scale: multiply the scores by qk_scale (exp2(S * qk_scale "
         "- m_new)), and compare m with max(S) * qk_scale."),
    )
    for alt_scale, hint in variants:
        O_alt, _ = reference.attention(q, k, v, causal=case.causal, scale=alt_scale)
        if torch.isfinite(O.double()).all() and (O.double() - O_alt).abs().max() <= \
                atol + rtol * O_alt.abs().max():
            return hint
    return None


def _forward_case(*cases, config=None):
    def run(candidate):
        _as_jit(candidate, "forward_inner")
        _check_forward(_forward_runner(candidate, config or FWD_CONFIG), cases)

    return run


def _check_forward(fn, cases, diagnose=True):
    for case, dtype in cases:
        q, k, v = random_qkv(case, dtype, device())
        scale = _scale_of(case)
        O_ref, LSE_ref = reference.attention(q, k, v, causal=case.causal, scale=scale)
        atol, rtol = tolerance(dtype, _max_score(q, k, scale))
        O = poisoned(q.shape, dtype, q.device)
        LSE = poisoned(q.shape[:-1], torch.float32, q.device)
        label = _label(case, dtype)
        snap = snapshot(q, k, v, names=("Q", "K", "V"))
        fn(q, k, v, O, LSE, case.causal, scale)
        if q.is_cuda:
            torch.cuda.synchronize()
        assert_unchanged(snap, case=label)
        try:
            compare("O", O, O_ref, case=label, atol=atol, rtol=rtol, hint=case.hint, dtype=dtype,
                    poisoned=True)
        except CheckFailure as failure:
            better = diagnose and _diagnose_forward(O, q, k, v, case, scale, atol, rtol)
            if better:
                failure.hint = better
            raise
        compare("LSE", LSE, LSE_ref, case=label, atol=atol, rtol=rtol, poisoned=True,
                hint="O is right but LSE is not: LSE comes from the m_i and l_i you return "
                     "(LSE = (m_i + log2 l_i) / log2 e): return m_i in log2 units (a max of "
                     "S * qk_scale) and l_i summed with the same m.")


BN = FWD_CONFIG.kwargs["BLOCK_N"]
D16 = pick(gpu=64, cpu=16)
D32 = pick(gpu=128, cpu=32)
N2 = 2 * BN  # exactly two key tiles
forward_inner.case(f"Nq=Nk={N2} (two key tiles), scores rising along the row")(
    _forward_case((C(f"Nq=Nk={N2}, d={D16}", 1, 1, N2, N2, D16, hint=_HF["two"]), F32))
)
forward_inner.case("ragged: Nq=Nk=37, B=2, H=2")(
    _forward_case((C(f"Nq=Nk=37, B=2, H=2, d={D16}", 2, 2, 37, 37, D16, hint=_HF["ragged"]),
                   F32))
)
forward_inner.case("causal, Nq=Nk=45, and Nq=20 < Nk=50")(
    _forward_case((C(f"causal, Nq=Nk=45, d={D16}", 1, 1, 45, 45, D16, causal=True,
                     hint=_HF["causal"]), F32),
                  (C(f"causal, Nq=20, Nk=50, d={D16}", 1, 1, 20, 50, D16, causal=True,
                     hint=_HF["causal"]), F32))
)
forward_inner.case("large logits (scores of std 50)")(
    _forward_case((C(f"logits x50, Nq=Nk=40, d={D16}", 1, 1, 40, 40, D16, logit_scale=50.0,
                     hint=_HF["large"]), F32))
)
forward_inner.case("float16 inputs, Nq=Nk=48")(
    _forward_case((C(f"Nq=Nk=48, d={D32}", 1, 2, 48, 48, D32, hint=_HF["fp16"]), LOW))
)
forward_inner.case("Nq=1, Nk=1 and Nq=1, Nk=70 causal", hidden=True)(
    _forward_case((C(f"Nq=Nk=1, d={D16}", 1, 1, 1, 1, D16), F32),
                  (C(f"causal, Nq=1, Nk=70, d={D16}", 1, 1, 1, 70, D16, causal=True), F32))
)
forward_inner.case("causal, Nq=70 > Nk=13, and scale 0.3", hidden=True)(
    _forward_case((C(f"causal, Nq=70, Nk=13, d={D16}", 1, 1, 70, 13, D16, causal=True), F32),
                  (C(f"scale=0.3, Nq=33, Nk=50, d={D16}", 1, 1, 33, 50, D16, scale=0.3), F32))
)
forward_inner.case(f"{str(BF16).replace('torch.', '')}, causal, B=2, H=2, Nq=Nk=100, d={D32}",
                   hidden=True)(
    _forward_case((C(f"causal, B=2, H=2, Nq=Nk=100, d={D32}", 2, 2, 100, 100, D32, causal=True,
                     hint=_HF["fp16"]), BF16))
)
forward_inner.case("logits x30, causal, ragged Nq=Nk=53", hidden=True)(
    _forward_case((C(f"logits x30, causal, Nq=Nk=53, d={D16}", 1, 1, 53, 53, D16, causal=True,
                     logit_scale=30.0, hint=_HF["large"]), F32))
)

# ----------------------------------------------------------------------------- causal split

causal_split = Exercise("09.causal_split", "The two loop stages of a query tile", points=2)


@triton.jit
def _split_probe(starts, lengths, out, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, FN_HASH: tl.constexpr):
    # Program p calls SPLIT for query tile starts[p] and Nk = lengths[p]; writes 4 numbers.
    # (FN_HASH: SPLIT's source hash, so that an edited SPLIT compiles a new probe.)
    p = tl.program_id(0)
    start_m = tl.load(starts + p)
    Nk = tl.load(lengths + p)
    lo, hi, diag_lo, diag_hi = SPLIT(start_m, Nk, BLOCK_M, BLOCK_N, CAUSAL)
    tl.store(out + 4 * p, lo)
    tl.store(out + 4 * p + 1, hi)
    tl.store(out + 4 * p + 2, diag_lo)
    tl.store(out + 4 * p + 3, diag_hi)


def split_bounds(split, starts, lengths, block_m, block_n, causal):
    """Run the ``@triton.jit`` function ``split`` for each (start_m, Nk): a list of 4-tuples."""
    starts_t = torch.tensor(starts, dtype=torch.int32, device=device())
    lengths_t = torch.tensor(lengths, dtype=torch.int32, device=device())
    out = torch.full((len(starts), 4), -(2**31), dtype=torch.int32, device=device())
    _split_probe[(len(starts),)](starts_t, lengths_t, out, SPLIT=split, BLOCK_M=block_m,
                                 BLOCK_N=block_n, CAUSAL=bool(causal),
                                 FN_HASH=fat.source_hash(split))
    return [tuple(int(x) for x in row) for row in out.cpu()]


def expected_split(start_m, Nk, block_m, causal):
    """The reference answer: (lo, hi, diag_lo, diag_hi)."""
    if not causal:
        return 0, Nk, Nk, Nk
    return 0, min(start_m, Nk), min(start_m, Nk), min(start_m + block_m, Nk)


def _tiles(lo, hi, block_n):
    return list(range(lo, hi, block_n)) if block_n > 0 else []


def _split_hint(got, start_m, Nk, block_m, block_n, causal):
    lo, hi, dlo, dhi = got
    first, diag = _tiles(lo, hi, block_n), _tiles(dlo, dhi, block_n)
    if any(t >= Nk for t in first + diag):
        return ("a stage visits a key tile that starts at or past Nk (Nq != Nk is possible): "
                "clip the bounds with tl.minimum(..., Nk)")
    if not causal:
        return ("without causal masking every key tile is visited once, unmasked: the first "
                "stage is [0, Nk) and the diagonal stage is empty (e.g. diag_lo = diag_hi = Nk)")
    want_first = _tiles(0, min(start_m, Nk), block_n)
    if want_first and not first:
        return ("the tiles entirely below the diagonal need no mask: give them to the first "
                "stage, [0, min(start_m, Nk)); only keys from start_m on need the mask")
    if first and max(first) + block_n - 1 > start_m:
        return ("the unmasked stage reaches the diagonal: a key tile with a key after start_m "
                "has keys after the first rows of the query tile, so it needs the mask; stop "
                "the first stage at min(start_m, Nk)")
    if first != want_first:
        return ("the first stage stops early: every key before start_m is seen by every row of "
                "the query tile, so [0, min(start_m, Nk)) is unmasked")
    if diag and max(diag) >= start_m + block_m:
        return ("the diagonal stage goes past the query tile: keys >= start_m + BLOCK_M come "
                "after every row of the tile, so their tiles are skipped, not masked")
    return ("the diagonal stage must start where the first stage ends and reach the last key "
            "that the tile's last row (start_m + BLOCK_M - 1) sees: [min(start_m, Nk), "
            "min(start_m + BLOCK_M, Nk))")


def _split_case(block_m, block_n, causal, pairs):
    def run(candidate):
        _as_jit(candidate, "causal_split")
        starts = [s for s, _ in pairs]
        lengths = [n for _, n in pairs]
        results = split_bounds(candidate, starts, lengths, block_m, block_n, causal)
        for (start_m, Nk), got in zip(pairs, results, strict=True):
            want = expected_split(start_m, Nk, block_m, causal)
            same = (_tiles(got[0], got[1], block_n) == _tiles(want[0], want[1], block_n)
                    and _tiles(got[2], got[3], block_n) == _tiles(want[2], want[3], block_n))
            if not same:
                case = (f"causal_split(start_m={start_m}, Nk={Nk}, BLOCK_M={block_m}, "
                        f"BLOCK_N={block_n}, CAUSAL={causal})")
                detail = (f"got {got}: key tiles {_tiles(got[0], got[1], block_n)} unmasked, "
                          f"{_tiles(got[2], got[3], block_n)} masked; expected "
                          f"{_tiles(want[0], want[1], block_n)} unmasked, "
                          f"{_tiles(want[2], want[3], block_n)} masked")
                raise CheckFailure(case, detail,
                                   _split_hint(got, start_m, Nk, block_m, block_n, causal))

    return run


def _split_in_forward(*cases):
    def run(candidate):
        _as_jit(candidate, "causal_split")

        def fn(q, k, v, O, LSE, causal, scale):
            fat.attention_forward(q, k, v, causal, scale, out=(O, LSE), config=FWD_CONFIG,
                                  split=candidate)

        _check_forward(fn, cases, diagnose=False)

    return run


_HS = ("the forward kernel with your causal_split: O must match the reference. Check the two "
       "stages: [0, min(start_m, Nk)) unmasked, [min(start_m, Nk), min(start_m + BLOCK_M, Nk)) "
       "masked.")
causal_split.case("not causal: one unmasked stage over all keys")(
    _split_case(64, 32, False, [(0, 256), (128, 256), (64, 100), (0, 1)])
)
causal_split.case("causal, Nq = Nk, BLOCK_M = BLOCK_N = 64")(
    _split_case(64, 64, True, [(0, 256), (64, 256), (192, 256)])
)
causal_split.case("causal, BLOCK_M = 2 x BLOCK_N")(
    _split_case(128, 64, True, [(0, 1024), (128, 1024), (512, 1024), (896, 1024)])
)
causal_split.case("causal, ragged Nk inside or before the query tile")(
    _split_case(64, 32, True, [(64, 100), (0, 17), (128, 150), (192, 130)])
)
causal_split.case("inside the forward kernel: causal, Nq=50, Nk=37 and Nq=20, Nk=60")(
    _split_in_forward((C(f"causal, Nq=50, Nk=37, d={D16}", 1, 1, 50, 37, D16, causal=True,
                         hint=_HS), F32),
                      (C(f"causal, Nq=20, Nk=60, d={D16}", 1, 1, 20, 60, D16, causal=True,
                         hint=_HS), F32))
)
causal_split.case("causal, Nk < start_m (more queries than keys)", hidden=True)(
    _split_case(32, 16, True, [(64, 20), (32, 32), (96, 1), (32, 33)])
)


def _random_pairs(seed, block_m, count=60):
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(count):
        Nq, Nk = (int(x) for x in torch.randint(1, 400, (2,), generator=g))
        i = int(torch.randint(0, math.ceil(Nq / block_m), (1,), generator=g))
        pairs.append((i * block_m, Nk))
    return pairs


for _bm, _bn in ((16, 16), (32, 16), (128, 32)):
    for _causal in (False, True):
        causal_split.case(f"60 random (start_m, Nk), BLOCK_M={_bm}, BLOCK_N={_bn}, "
                          f"causal={_causal}", hidden=True)(
            _split_case(_bm, _bn, _causal, _random_pairs(_bm + _bn + _causal, _bm))
        )
causal_split.case("inside the forward kernel: float16, causal, Nq=33, Nk=70", hidden=True)(
    _split_in_forward((C(f"causal, Nq=33, Nk=70, d={D32}", 1, 2, 33, 70, D32, causal=True,
                         hint=_HS), LOW))
)

# ----------------------------------------------------------------------------- dK/dV inner

dkdv_inner = Exercise("09.dkdv_inner", "The dK/dV loop of the Triton backward", points=3)


def reference_gradients(q, k, v, dO, causal, scale):
    """float64 ``(O, LSE, dQ, dK, dV, P, dP, D)`` of attention (the closed form of chapter 08)."""
    q, k, v, dO = (t.detach().to(torch.float64) for t in (q, k, v, dO))
    O, LSE = reference.attention(q, k, v, causal=causal, scale=scale)
    S = scale * q @ k.transpose(-2, -1)
    if causal:
        keep = torch.ones(S.shape[-2:], dtype=torch.bool, device=q.device).tril()
        S = S.masked_fill(~keep, -math.inf)
    P = torch.exp(S - LSE[..., None])
    dP = dO @ v.transpose(-2, -1)
    D = (dO * O).sum(-1, keepdim=True)
    dS = P * (dP - D)
    return O, LSE, scale * dS @ k, scale * dS.transpose(-2, -1) @ q, P.transpose(-2, -1) @ dO, \
        P, dP, D


def grad_tolerance(dtype, expected, max_score):
    """``(atol, rtol)`` for a gradient computed from ``dtype`` inputs (see the module doc)."""
    tol = GRAD_TOL[dtype]
    atol = tol * max(1.0, float(expected.abs().max()))
    if dtype == torch.float32:
        atol += SCORE_ATOL * max_score
    return atol, tol


def backward_problem(case, dtype):
    """Fresh ``(q, k, v, O, LSE, dO)`` in ``dtype`` (LSE float32) and the float64 references."""
    q, k, v = random_qkv(case, dtype, device())
    dO = torch.randn(q.shape, device=q.device).to(dtype)
    scale = _scale_of(case)
    ref = reference_gradients(q, k, v, dO, case.causal, scale)
    O, LSE = ref[0].to(dtype).contiguous(), ref[1].float().contiguous()
    return (q, k, v, O, LSE, dO), ref, scale


_HK = {
    "plain": "per query tile: P^T = exp2(S^T * qk_scale - lse2[None, :]) (lse2 = LSE * log2 e, "
    "given), dV += P^T @ dO, dP^T = V @ dO^T, dS^T = P^T * (dP^T - D[None, :]), dK += dS^T @ "
    "Q. Cast P^T and dS^T to the input dtype before their tl.dot.",
    "ragged": "query rows past Nq arrive with q = dO = 0 and lse2 = +inf (given), so their "
    "P^T = exp2(-inf) = 0: no extra mask is needed.",
    "causal": "causal, on the diagonal tiles (DIAGONAL): in S^T the keys are the rows and the "
    "queries the columns; key offs_n[c] is seen by query rows[r] iff offs_n[c] <= rows[r], so "
    "set S^T to -inf where offs_n[:, None] > rows[None, :] before the exp2.",
    "large": "scores of about +-150: P^T = exp2(S^T * qk_scale - lse2) is <= 1 because LSE >= "
    "S; subtract inside the exp2, never divide two exponentials.",
}


def _diagnose_backward(name, got, ref, q, scale):
    """The likely bug when dK or dV is wrong, found by matching variants of the right answer."""
    _, _, _, dK, dV, P, dP, _ = ref
    g = got.double()
    if not torch.isfinite(g).all():
        return None

    def close(x):
        return bool((g - x).abs().max() <= 0.05 * x.abs().max() + 1e-3)

    if name == "dV" and not close(dV) and bool(g.abs().max() == 0):
        return "dV is zero: accumulate dv = tl.dot(P^T, dO, dv) and return the updated dv."
    if name != "dK":
        return None
    if close(scale * (P * dP).transpose(-2, -1) @ q.double()):
        return ("dK matches dS = P * dP: the softmax gradient is dS = P * (dP - D), with D = "
                "rowsum(dO * O) of each query row (Di, given): dS^T = P^T * (dP^T - Di[None, :]).")
    if close(dK * scale):
        return ("dK comes out scale times too small: the kernel multiplies dK by the scale "
                "once, at the end (dK = scale * dS^T Q); do not scale dS^T yourself.")
    if close(dK * scale * LOG2E) or close(dK * LOG2E):
        return ("dK carries an extra factor log2(e) (or qk_scale): qk_scale belongs only inside "
                "exp2; dS^T = P^T * (dP^T - D) has no scale, and the kernel multiplies dK by "
                "scale at the end.")
    if close(dK / scale):
        return ("dK is 1/scale times too large: the kernel multiplies dK by scale at the end; "
                "keep that multiply (you may have divided by it).")
    return None


def _dkdv_case(*cases):
    def run(candidate):
        _as_jit(candidate, "dkdv_inner")
        for case, dtype in cases:
            inputs, ref, scale = backward_problem(case, dtype)
            q, k, v, O, LSE, dO = inputs
            label = _label(case, dtype)
            dQ, dK, dV = (poisoned(t.shape, dtype, t.device) for t in (q, k, v))
            snap = snapshot(*inputs, names=("Q", "K", "V", "O", "LSE", "dO"))
            fat.attention_backward(q, k, v, O, LSE, dO, case.causal, scale, out=(dQ, dK, dV),
                                   dkdv_config=DKDV_CONFIG, dq_config=DQ_CONFIG,
                                   dkdv_inner=candidate)
            if q.is_cuda:
                torch.cuda.synchronize()
            assert_unchanged(snap, case=label)
            max_score = _max_score(q, k, scale)
            for name, got, want in (("dV", dV, ref[4]), ("dK", dK, ref[3])):
                atol, rtol = grad_tolerance(dtype, want, max_score)
                try:
                    compare(name, got, want, case=label, atol=atol, rtol=rtol, dtype=dtype,
                            hint=case.hint or _HK["plain"], poisoned=True)
                except CheckFailure as failure:
                    better = _diagnose_backward(name, got, ref, q, scale)
                    if better:
                        failure.hint = better
                    raise

    return run


DK16 = pick(gpu=64, cpu=16)
DK32 = pick(gpu=128, cpu=32)
NB = DKDV_CONFIG.kwargs["BLOCK_M"]
dkdv_inner.case(f"Nq=Nk={2 * NB} (two query tiles), d={DK16}")(
    _dkdv_case((C(f"Nq=Nk={2 * NB}, d={DK16}", 1, 1, 2 * NB, 2 * NB, DK16, hint=_HK["plain"]),
                F32))
)
dkdv_inner.case("ragged: Nq=37, Nk=29, B=2")(
    _dkdv_case((C(f"Nq=37, Nk=29, B=2, d={DK16}", 2, 1, 37, 29, DK16, hint=_HK["ragged"]), F32))
)
dkdv_inner.case("causal, Nq=Nk=45")(
    _dkdv_case((C(f"causal, Nq=Nk=45, d={DK16}", 1, 1, 45, 45, DK16, causal=True,
                  hint=_HK["causal"]), F32))
)
dkdv_inner.case("float16 inputs, causal, Nq=Nk=40")(
    _dkdv_case((C(f"causal, Nq=Nk=40, d={DK32}", 1, 2, 40, 40, DK32, causal=True,
                  hint=_HK["causal"]), LOW))
)
dkdv_inner.case("causal, Nq=50 > Nk=21, and Nq=9 < Nk=60", hidden=True)(
    _dkdv_case((C(f"causal, Nq=50, Nk=21, d={DK16}", 1, 1, 50, 21, DK16, causal=True,
                  hint=_HK["causal"]), F32),
               (C(f"causal, Nq=9, Nk=60, d={DK16}", 1, 1, 9, 60, DK16, causal=True,
                  hint=_HK["causal"]), F32))
)
dkdv_inner.case("Nq=1, Nk=1, and scale 0.3, logits x30", hidden=True)(
    _dkdv_case((C(f"Nq=Nk=1, d={DK16}", 1, 1, 1, 1, DK16), F32),
               (C(f"scale=0.3, logits x30, Nq=Nk=33, d={DK16}", 1, 2, 33, 33, DK16, scale=0.3,
                  logit_scale=30.0, hint=_HK["large"]), F32))
)
dkdv_inner.case(f"{str(BF16).replace('torch.', '')}, causal, B=2, H=2, Nq=Nk=70, d={DK32}",
                hidden=True)(
    _dkdv_case((C(f"causal, B=2, H=2, Nq=Nk=70, d={DK32}", 2, 2, 70, 70, DK32, causal=True,
                  hint=_HK["causal"]), BF16))
)

__all__ = [
    "DKDV_CONFIG",
    "DQ_CONFIG",
    "FWD_CONFIG",
    "GRAD_TOL",
    "SCORE_ATOL",
    "backward_problem",
    "causal_split",
    "dkdv_inner",
    "expected_split",
    "forward_inner",
    "grad_tolerance",
    "reference_gradients",
    "split_bounds",
]
