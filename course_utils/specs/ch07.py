"""Chapter 07, the FlashAttention-2 forward pass: graded exercises.

- ``07.torch_forward``: ``flash_attention_forward(Q, K, V, causal=False, scale=None)`` in plain
  PyTorch, tiled (Br query rows x Bc keys at a time, online softmax), returning ``(O, LSE)`` for
  ``(B, H, N, d)`` float32 inputs. softmax, log_softmax, logsumexp and SDPA are forbidden, and
  no tensor as large as half the Nq x Nk score matrix may appear.
- ``07.online_update``: the online-softmax update and the final normalisation inside a Numba
  kernel with one thread per query row (``ONLINE_BR`` rows per block, K/V tiles of
  ``ONLINE_BC`` keys, head dim ``ONLINE_D``), launched as
  ``kernel[(ceil(Nq / ONLINE_BR), B * H), ONLINE_BR](Q, K, V, O, LSE, scale, causal)``.
- ``07.causal_skip``: ``kv_tile_count(i, Br, Bc, Nq, Nk, causal)``, the number of K/V tiles
  (tiles 0 .. n-1) that query tile ``i`` must visit; causal masking is top-left aligned.
- ``07.lse_epilogue``: the epilogue of the chapter's CUDA C++ kernel
  (course_utils/kernels/flash_attention_forward.cu, between ``// BEGIN EPILOGUE`` and
  ``// END EPILOGUE``): finish l, write O and LSE. The candidate is the epilogue's source text
  (or a function returning it). Without a GPU it is compiled (nvcc, sm_90) and checked for what
  it must contain; on a GPU it is built with ``load_cuda`` and run.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from ..checks import AttentionCase, CheckFailure, attention_cases, check_attention
from ..grader import Exercise
from ..runtime import kernel_array, on_gpu, pick, synchronize
from . import compiled_resources, require_implemented, source_of

FORBIDDEN = ("scaled_dot_product_attention", "softmax", "log_softmax", "logsumexp")

ONLINE_D = 16  # head dim of 07.online_update's kernel (its local arrays are sized by it)
ONLINE_BR = 16  # query rows per block = threads per block
ONLINE_BC = 8  # keys per K/V tile

KERNEL_PATH = Path(__file__).resolve().parent.parent / "kernels" / "flash_attention_forward.cu"
EPILOGUE_BEGIN = "// BEGIN EPILOGUE"
EPILOGUE_END = "// END EPILOGUE"
CUDA_FUNCTION = "flash_attention_forward"
CUDA_KERNEL = "flash_attention_forward_kernel"

C = AttentionCase


def _run_attention(fn, cases, *, out=False):
    check_attention(fn, cases=cases, out=out, verbose=False)


# ----------------------------------------------------------------------------- torch forward

torch_forward = Exercise(
    "07.torch_forward", "Tiled FlashAttention-2 forward (PyTorch)", points=3, forbidden=FORBIDDEN
)

HINT_MATERIALISED = (
    "a tiled forward never holds the whole Nq x Nk score matrix: loop over query tiles of Br "
    "rows and, inside, over K/V tiles of Bc rows; S, P exist for one (query tile, key tile) "
    "pair at a time (Br = Bc = 64 is a good choice)."
)


class _LargestTensor(TorchFunctionMode):
    """Remembers the largest number of elements of any tensor a torch function returned."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for r in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(r, torch.Tensor):
                self.largest = max(self.largest, r.numel())
        return result


def _not_materialised(fn):
    Nq = Nk = pick(gpu=4096, cpu=512)
    case = f"B=1, H=1, Nq=Nk={Nq}, d=16: S is never materialised"
    q, k, v = (torch.randn(1, 1, n, 16, device="cuda" if on_gpu() else "cpu")
               for n in (Nq, Nk, Nk))  # fmt: skip
    spy = _LargestTensor()
    with spy:
        fn(q, k, v, causal=False, scale=0.25)
    if spy.largest >= Nq * Nk // 2:
        raise CheckFailure(
            case,
            f"a tensor of {spy.largest} elements appeared; the full S has {Nq * Nk}",
            HINT_MATERIALISED,
        )


def _torch_cases(cases):
    def run(fn):
        _run_attention(fn, cases)

    return run


_small = attention_cases(d=16, tile=16, sizes="small")
torch_forward.case("the standard edge cases, d=16 (ragged N, Nq != Nk, causal, scale, logits)")(
    _torch_cases(_small)
)
torch_forward.case("does not materialise the Nq x Nk scores")(_not_materialised)
torch_forward.case("B=3, H=4, Nq=Nk=100, d=64, causal", hidden=True)(
    _torch_cases([C("B=3, H=4, N=100, d=64, causal", 3, 4, 100, 100, 64, causal=True)])
)
torch_forward.case("Nq=1000, Nk=17, d=128 and Nq=17, Nk=1000 causal", hidden=True)(
    _torch_cases([
        C("Nq=1000, Nk=17, d=128", 1, 1, 1000, 17, 128),
        C("causal, Nq=17, Nk=1000, d=128", 1, 1, 17, 1000, 128, causal=True),
    ])
)
torch_forward.case("logits x30, ragged, causal, d=64", hidden=True)(
    _torch_cases([C("logits x30, causal, Nq=Nk=217, d=64", 1, 2, 217, 217, 64, causal=True,
                    logit_scale=30.0)])  # fmt: skip
)

# ----------------------------------------------------------------------------- online update

online_update = Exercise(
    "07.online_update", "Online softmax update inside a Numba kernel", points=3,
    forbidden=FORBIDDEN,
)  # fmt: skip


def _online_launcher(kernel):
    def fn(q, k, v, O, LSE, causal, scale):
        B, H, Nq = q.shape[:3]
        grid = (math.ceil(Nq / ONLINE_BR), B * H)
        args = [kernel_array(t) for t in (q, k, v, O, LSE)]
        kernel[grid, ONLINE_BR](*args, np.float32(scale), bool(causal))
        synchronize()

    return fn


def _online_case(*cases):
    def run(kernel):
        require_implemented(kernel)
        _run_attention(_online_launcher(kernel), list(cases), out=True)

    return run


_H = {  # the checks' own hints, by the bug they name
    "plain": "two key tiles: when a later tile raises the row max, l and every element of o "
    "must be multiplied by alpha = exp(m_old - m_new) before adding the new tile's terms.",
    "ragged": "padded keys (c >= Nk) arrive with s = -inf: exp(-inf - m) = 0 takes them out, "
    "as long as m is finite; store only rows r < Nq.",
    "large": "scores of +-150: subtract the running max m before exp (exp overflows float32 "
    "above 88.7), and rescale l and o by exp(m_old - m_new) when m grows.",
}
D = ONLINE_D
online_update.case(f"Nq=Nk=16 (two key tiles of {ONLINE_BC}), d={D}")(
    _online_case(C("Nq=Nk=16", 1, 1, 16, 16, D, hint=_H["plain"]))
)
online_update.case("ragged: Nq=Nk=21, B=2, H=2")(
    _online_case(C("ragged Nq=Nk=21, B=2, H=2", 2, 2, 21, 21, D, hint=_H["ragged"]))
)
online_update.case("causal, Nq=13, Nk=30")(
    _online_case(C("causal, Nq=13, Nk=30", 1, 1, 13, 30, D, causal=True))
)
online_update.case("large logits (std 50)")(
    _online_case(C("large logits, Nq=Nk=24", 1, 1, 24, 24, D, logit_scale=50.0,
                   hint=_H["large"]))  # fmt: skip
)
online_update.case("Nq=33, Nk=5, causal (Nq > Nk)", hidden=True)(
    _online_case(C("causal, Nq=33, Nk=5", 1, 1, 33, 5, D, causal=True))
)
online_update.case("Nq=1, Nk=1", hidden=True)(_online_case(C("Nq=Nk=1", 1, 1, 1, 1, D)))
online_update.case("Nq=20, Nk=13, B=2, H=2, scale 0.1", hidden=True)(
    _online_case(C("Nq=20, Nk=13, scale 0.1", 2, 2, 20, 13, D, scale=0.1))
)
online_update.case("logits x30, causal, Nq=Nk=19", hidden=True)(
    _online_case(C("logits x30, causal, Nq=Nk=19", 1, 1, 19, 19, D, causal=True,
                   logit_scale=30.0))  # fmt: skip
)

# ----------------------------------------------------------------------------- causal skip

causal_skip = Exercise("07.causal_skip", "Which K/V tiles a query tile visits", points=2)


def expected_kv_tile_count(i, Br, Bc, Nq, Nk, causal):
    """Brute force: 1 + the last K/V tile holding a key that some real row of tile i sees."""
    last = -1
    for r in range(i * Br, min((i + 1) * Br, Nq)):
        key = min(r, Nk - 1) if causal else Nk - 1  # the last key row r sees (top-left)
        last = max(last, key // Bc)
    return last + 1


def _skip_hint(got, i, Br, Bc, Nq, Nk, causal):
    Tc = math.ceil(Nk / Bc)
    end = min((i + 1) * Br, Nq)
    if got == min(end, Nk) // Bc or got == end // Bc:
        return "a partly visible tile must be visited: round up (ceil), not down"
    if causal and got == math.ceil(min(Nk, (i + 1) * Br) / Bc):
        return ("the last query tile may be partial: rows >= Nq do not exist, so only rows up "
                "to min((i + 1) * Br, Nq) - 1 count")  # fmt: skip
    if causal and got == Tc:
        return "with causal=True the tiles entirely above the diagonal are skipped, not visited"
    if got == math.ceil(end / Bc):
        return "never more than Tc = ceil(Nk / Bc) tiles: clip the last key at Nk - 1"
    return ("query row r sees keys 0..min(r, Nk - 1) (top-left aligned, like SDPA's is_causal); "
            "the tile's last real row is min((i + 1) * Br, Nq) - 1; count the tiles up to the "
            "one holding its last visible key")  # fmt: skip


def _skip_case(params):
    def run(fn):
        for i, Br, Bc, Nq, Nk, causal in params:
            case = f"kv_tile_count(i={i}, Br={Br}, Bc={Bc}, Nq={Nq}, Nk={Nk}, causal={causal})"
            got = fn(i, Br, Bc, Nq, Nk, causal)
            want = expected_kv_tile_count(i, Br, Bc, Nq, Nk, causal)
            if isinstance(got, bool) or not isinstance(got, int):
                try:
                    got = int(got) if float(got) == int(got) else got
                except (TypeError, ValueError):
                    raise CheckFailure(case, f"expected an int, got {type(got).__name__}") from None
            if got != want:
                raise CheckFailure(case, f"got {got}, expected {want}",
                                   _skip_hint(got, i, Br, Bc, Nq, Nk, causal))  # fmt: skip

    return run


causal_skip.case("not causal: every tile, ragged Nk")(
    _skip_case([(0, 64, 64, 256, 256, False), (3, 64, 64, 256, 100, False),
                (0, 16, 16, 5, 17, False)])  # fmt: skip
)
causal_skip.case("causal, square, tile-aligned")(
    _skip_case([(0, 64, 64, 256, 256, True), (1, 64, 64, 256, 256, True),
                (3, 64, 64, 256, 256, True)])  # fmt: skip
)
causal_skip.case("causal, Br != Bc")(
    _skip_case([(0, 128, 64, 1024, 1024, True), (2, 64, 128, 1024, 1024, True),
                (1, 32, 48, 500, 500, True)])  # fmt: skip
)
causal_skip.case("causal, ragged last query tile (Nq=100, Br=64)")(
    _skip_case([(1, 64, 16, 100, 100, True), (1, 64, 64, 70, 200, True)])
)
causal_skip.case("causal, Nq > Nk and Nq < Nk", hidden=True)(
    _skip_case([(5, 16, 16, 100, 20, True), (0, 16, 16, 10, 1000, True),
                (0, 64, 64, 1, 1, True), (2, 16, 8, 40, 37, True)])  # fmt: skip
)


def _random_sweep():
    g = torch.Generator().manual_seed(7)
    params = []
    for _ in range(300):
        Br, Bc = (int(x) for x in torch.randint(1, 9, (2,), generator=g) * 8)
        Nq, Nk = (int(x) for x in torch.randint(1, 300, (2,), generator=g))
        for causal in (False, True):
            i = int(torch.randint(0, math.ceil(Nq / Br), (1,), generator=g))
            params.append((i, Br, Bc, Nq, Nk, causal))
    return params


causal_skip.case("300 random shapes", hidden=True)(_skip_case(_random_sweep()))

# ----------------------------------------------------------------------------- LSE epilogue

lse_epilogue = Exercise("07.lse_epilogue", "The epilogue of the CUDA C++ kernel", points=2)


def kernel_source_with(epilogue: str) -> str:
    """The chapter's kernel source with its epilogue replaced by ``epilogue``."""
    lines = KERNEL_PATH.read_text().split("\n")
    begin = next(n for n, line in enumerate(lines) if line.strip() == EPILOGUE_BEGIN)
    end = next(n for n, line in enumerate(lines) if line.strip() == EPILOGUE_END)
    body = epilogue.strip("\n").rstrip().split("\n")
    return "\n".join(lines[: begin + 1] + body + lines[end:])


_STRUCTURE = (
    (r"LSEbh\s*\[", "the epilogue never writes LSE", "store LSEbh[r] = (m[a] + log2f(l_row)) * LN2 "
     "for rows r < Nq (one thread per row, e.g. tx == 0)"),
    (r"Obh\s*\[", "the epilogue never writes O", "store Obh[r * D + o_col<D>(tx, q)] = "
     "acc_o[a][q] / l_row for rows r < Nq"),
    (r"__shfl_xor_sync|__shfl_down_sync|__shfl_sync", "l is never summed across the 16 threads "
     "of a row", "each thread's l[a] is only its partial sum over its own TN columns: add the 16 "
     "partials with __shfl_xor_sync(0xffffffff, x, off) for off = 8, 4, 2, 1, outside any "
     "branch on r"),
    (r"log2f?\s*\(|logf?\s*\(|__logf\s*\(", "no logarithm: LSE = m + log(l), not l",
     "m is in log2 units (S was multiplied by log2(e)), so LSE = (m + log2f(l)) * LN2"),
    (r"<\s*Nq", "no bound on the rows", "rows r >= Nq of the last query tile do not exist: "
     "store only when r < Nq"),
)


def _epilogue_compiles(candidate):
    case = "compiles for sm_90 (nvcc; no GPU needed) and writes O and LSE"
    text = source_of(candidate)
    kernels = compiled_resources(kernel_source_with(text), case=case,
                                 extra_flags=["-DFA_KERNEL_ONLY"])  # fmt: skip
    for k in kernels:
        if k.spills:
            hint = "keep the epilogue to scalars: no local arrays indexed at run time"
            raise CheckFailure(case, f"{k.name} spills {k.spills} bytes with your epilogue", hint)
    code = re.sub(r"//[^\n]*", "", text)
    for pattern, detail, hint in _STRUCTURE:
        if not re.search(pattern, code):
            raise CheckFailure(case, detail, hint)


_modules: dict[str, object] = {}


def _epilogue_runs(cases):
    def run(candidate):
        from ..cuda import load_cuda

        source = kernel_source_with(source_of(candidate))
        if source not in _modules:
            _modules[source] = load_cuda(source, [CUDA_FUNCTION], name="fa07_epilogue")
        module = _modules[source]

        def fn(q, k, v, causal, scale):
            return getattr(module, CUDA_FUNCTION)(q, k, v, causal, scale)

        _run_attention(fn, cases)

    return run


lse_epilogue.case("compiles, 0 spills, writes O and LSE")(_epilogue_compiles)
if on_gpu():  # results can only be graded where the kernel can run
    lse_epilogue.case("GPU: the standard edge cases, d=64")(
        _epilogue_runs(attention_cases(d=64, tile=64, sizes="large"))
    )
    lse_epilogue.case("GPU: d=16 and d=128, ragged, Nq != Nk", hidden=True)(
        _epilogue_runs([
            C("d=16, Nq=1000, Nk=17", 3, 4, 1000, 17, 16),
            C("d=128, causal, Nq=17, Nk=1000", 1, 4, 17, 1000, 128, causal=True),
            C("d=128, logits x30, N=100", 1, 1, 100, 100, 128, logit_scale=30.0),
        ])
    )

__all__ = [
    "CUDA_FUNCTION",
    "FORBIDDEN",
    "KERNEL_PATH",
    "ONLINE_BC",
    "ONLINE_BR",
    "ONLINE_D",
    "causal_skip",
    "expected_kv_tile_count",
    "kernel_source_with",
    "lse_epilogue",
    "online_update",
    "torch_forward",
]
