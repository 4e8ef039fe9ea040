"""The attention checks: the standard edge cases, random inputs, and whole-implementation checks.

:func:`attention_cases` (each case with a hint about the bug that fails it), :func:`random_qkv`,
:func:`check_attention` (the candidate against the float64 reference on every case) and
:func:`check_against_sdpa` (a report: the reference, SDPA and the candidate side by side), with
:class:`AttentionCase` and :class:`CheckSummary`. Its own room: the one part of the checks that
knows attention; it is built from the general parts (compare, buffers, validation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import reference, runtime
from .checks_buffers import assert_unchanged, poisoned, snapshot
from .checks_compare import compare, tolerance
from .checks_failure import CheckFailure
from .checks_returned import validated

# ---------------------------------------------------------------------------------------------
# Attention test cases and inputs
# ---------------------------------------------------------------------------------------------

_HINT_PLAIN = (
    "the basic case fails: check S = scale * Q K^T, P = exp(S - m) / l, O = P V. Nk spans 2 key "
    "tiles, so a missing rescale of l and O by exp(m_old - m_new), when a later tile raises the "
    "row max m, shows up here first."
)
_HINT_HEADS = (
    "only some (batch, head) slices are right? Each program/block must offset Q, K, V, O and "
    "LSE by its own batch and head index (use the strides), not always read head 0."
)
_HINT_RAGGED = (
    "the last partial tile: guard loads with j < Nk (a padded key gets S = -inf and a V row of "
    "0) and stores with i < Nq. Errors only in the last rows or columns are an off-by-one at "
    "the tile edge."
)
_HINT_ONE_QUERY = (
    "a single query: its tile is all padding but one row. Rows i >= Nq must never be stored, "
    "and the grid needs ceil(Nq / Br) = 1 program, not 0 (integer division rounds down)."
)
_HINT_ONE_KEY = (
    "a single key: every row has P = [1], so O[i] = V[0] and LSE[i] = S[i, 0]. Padded keys "
    "must get S = -inf (not 0), or they take part of the softmax."
)
_HINT_FEWER_Q = (
    "Nq < Nk: a kernel that uses one length N for both loops misses keys. Loop over "
    "Tc = ceil(Nk / Bc) key tiles for each of the Tr = ceil(Nq / Br) query tiles."
)
_HINT_MORE_Q = (
    "Nq > Nk: a kernel that uses one length N for both loops reads past the end of K and V. "
    "Bound the key loop and the key mask by Nk, the query rows by Nq."
)
_HINT_CAUSAL = (
    "causal: query i sees keys j <= i, the diagonal included. Skip tiles entirely above the "
    "diagonal and mask (S = -inf) the elements j > i of the tile that straddles it; a mask of "
    "j < i, or one applied per tile instead of per element, fails here."
)
_HINT_CAUSAL_RECT = (
    "causal with Nq != Nk is aligned top-left, as SDPA's is_causal: query i sees keys j <= i "
    "(not j <= i + Nk - Nq, the bottom-right alignment of the flash-attn library)."
)
_HINT_SCALE = (
    "the scale argument is not 1/sqrt(d) in this case: compute S = scale * Q K^T with the scale "
    "passed in, not a hard-coded 1/sqrt(d)."
)
_HINT_LARGE = (
    "scores reach about +-150 here, and exp overflows float32 above 88.7 (float16 above 11.1): "
    "subtract the running row max m before exp, and rescale l and O by exp(m_old - m_new) "
    "whenever m grows."
)
_HINT_LSE = (
    "LSE is the natural-log logsumexp of each scaled score row: LSE = m + log(l), with m the "
    "row max and l = sum_j exp(S - m). Returning l or m alone, log2 instead of ln, or forgetting "
    "the scale fails here."
)
_TF32_NOTE = (
    " (On a GPU, tl.dot on float32 inputs uses TF32, ~1e-3 relative error, unless you pass "
    "input_precision='ieee'.)"
)

_LARGE_LOGIT_STD = 50.0  # row maxima then exceed 88.7, where exp overflows float32


def attention_cases(d=None, tile=16, sizes="auto"):
    """The standard edge cases for an attention forward pass, each with a hint about its bug.

    Args:
        d: head dimension; default 64 for ``sizes="large"``, 16 for ``"small"``.
        tile: the tile size the kernel uses (Br = Bc = ``tile``), so that lengths are chosen
            to be, or not to be, multiples of it. At least 2.
        sizes: ``"small"`` (N up to ~45: fast in the CPU simulator), ``"large"`` (N around
            1024: realistic on a GPU), or ``"auto"`` (large on a GPU, small otherwise).

    Returns:
        A list of :class:`AttentionCase`: plain; several heads; a length that is not a multiple
        of the tile; a single query; a single key; Nq < Nk; Nq > Nk; causal; causal with
        Nq != Nk; a scale that is not 1/sqrt(d); large logits.
    """
    if sizes == "auto":
        sizes = "large" if runtime.on_gpu() else "small"
    if sizes not in ("small", "large"):
        raise ValueError(f"sizes must be 'small', 'large' or 'auto', got {sizes!r}")
    if not isinstance(tile, int) or tile < 2:
        raise ValueError(f"tile must be an int >= 2 (the kernel's Br = Bc), got {tile!r}")
    if d is None:
        d = 16 if sizes == "small" else 64
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"d={d!r}: the head dimension must be an int >= 1 (a score is a dot "
                         "product over d, and the default scale is 1/sqrt(d)), e.g. d=16")
    # base is an even number of tiles, so that base and base // 2 are multiples of the tile;
    # off is in [1, tile - 1], so adding it makes a length that is not.
    tiles = 2 if sizes == "small" else 2 * math.ceil(512 / tile)
    base = tiles * tile
    off = max(1, tile // 3)
    ragged, short, long = base + off, base // 2 + off, base + base // 2 - off
    heads = (2, 3) if sizes == "small" else (2, 4)
    scale = round(1.5 / math.sqrt(d), 4)
    t = f"the tile Br=Bc={tile}"
    C = AttentionCase
    return [
        C(f"plain: Nq={base}, Nk={base} (a multiple of {t})", 1, 1, base, base, d,
          hint=_HINT_PLAIN),
        C(f"B={heads[0]}, H={heads[1]}, Nq={base}, Nk={base} (several batches and heads)",
          *heads, base, base, d, hint=_HINT_HEADS),
        C(f"Nq={ragged}, Nk={ragged} (not a multiple of {t})", 1, 1, ragged, ragged, d,
          hint=_HINT_RAGGED),
        C(f"Nq=1, Nk={ragged} (a single query)", 1, 1, 1, ragged, d, hint=_HINT_ONE_QUERY),
        C(f"Nq={ragged}, Nk=1 (a single key)", 1, 1, ragged, 1, d, hint=_HINT_ONE_KEY),
        C(f"Nq={short}, Nk={long} (fewer queries than keys)", 1, 1, short, long, d,
          hint=_HINT_FEWER_Q),
        C(f"Nq={long}, Nk={short} (more queries than keys)", 1, 1, long, short, d,
          hint=_HINT_MORE_Q),
        C(f"causal, Nq={ragged}, Nk={ragged}", 1, 1, ragged, ragged, d, causal=True,
          hint=_HINT_CAUSAL),
        C(f"causal, Nq={short}, Nk={long} (top-left aligned, as SDPA's is_causal)", 1, 1,
          short, long, d, causal=True, hint=_HINT_CAUSAL_RECT),
        C(f"scale={scale} (not the default 1/sqrt(d)={1 / math.sqrt(d):.4g}), Nq={base}, "
          f"Nk={base}", 1, 1, base, base, d, scale=scale, hint=_HINT_SCALE),
        C(f"large logits (scores of std {_LARGE_LOGIT_STD:g}), H=2, Nq={base}, Nk={base}",
          1, 2, base, base, d, logit_scale=_LARGE_LOGIT_STD, hint=_HINT_LARGE),
    ]  # fmt: skip


def random_qkv(case, dtype=torch.float32, device=None, generator=None):
    """Fresh random ``(q, k, v)`` for ``case``, each of shape ``(B, H, N, d)``.

    Entries are standard normal, except that ``q`` and ``k`` are multiplied by
    ``sqrt(case.logit_scale)``, so that the scores ``S = q k^T / sqrt(d)`` have a standard
    deviation of about ``logit_scale``. New values on every call (a kernel cannot pass by
    being right on one lucky input) unless a seeded ``torch.Generator`` is passed.

    Args:
        case: an :class:`AttentionCase`.
        dtype: floating dtype of the tensors.
        device: default ``course_utils.device()``.
        generator: optional ``torch.Generator`` for reproducible inputs.

    Returns:
        ``q``: ``(B, H, Nq, d)``, ``k``: ``(B, H, Nk, d)``, ``v``: ``(B, H, Nk, d)``, all ``dtype``.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"random_qkv needs a floating dtype such as torch.float32, got {dtype!r}")
    device = runtime.device() if device is None else torch.device(device)
    where = generator.device if generator is not None else device
    B, H, d = case.B, case.H, case.d
    amplitude = math.sqrt(case.logit_scale)

    def normal(n, a=1.0):
        x = torch.randn(B, H, n, d, generator=generator, dtype=torch.float32, device=where)
        return (x * a).to(device=device, dtype=dtype)

    return normal(case.Nq, amplitude), normal(case.Nk, amplitude), normal(case.Nk)


# ---------------------------------------------------------------------------------------------
# Whole-implementation checks
# ---------------------------------------------------------------------------------------------


def check_attention(
    fn,
    *,
    cases=None,
    dtype=torch.float32,
    device=None,
    out=False,
    returns_lse=True,
    scale="default",
    verbose=True,
    batched=True,
):
    """Run an attention forward ``fn`` through the edge cases; raise :class:`CheckFailure`.

    For each case: fresh random inputs, the float64 :func:`reference.attention` on the same
    inputs, one call of ``fn``, then checks that Q, K, V are unchanged and that O (and LSE)
    match within :func:`tolerance` of ``dtype``. Stops at the first failing case.

    Args:
        fn: the candidate. Called as ``fn(q, k, v, causal=..., scale=...)`` returning
            ``(O, LSE)`` (or only ``O`` when ``returns_lse=False``); with ``out=True`` called
            as ``fn(q, k, v, O, LSE, causal=..., scale=...)`` (``fn(q, k, v, O, ...)`` when
            ``returns_lse=False``) and must write into the NaN-poisoned buffers ``O``
            (like ``q`` with ``v``'s last dim, ``dtype``) and ``LSE`` (``(..., Nq)``, float32;
            float64 for float64 inputs).
            ``q``: ``(B, H, Nq, d)``, ``k``, ``v``: ``(B, H, Nk, d)``, all ``dtype`` (or
            ``(N, d)`` with ``batched=False``); ``scale`` is always a float.
        cases: a list of :class:`AttentionCase`; default :func:`attention_cases` sized for
            ``device`` (small on the CPU, realistic on a GPU).
        dtype: dtype of the inputs (and of ``O``). LSE may be any floating dtype.
        device: default ``course_utils.device()``.
        out: see ``fn``.
        returns_lse: whether ``fn`` produces LSE too.
        scale: ``"default"``: 1/sqrt(d), except in cases that set their own scale;
            ``"random"``: a random scale in [0.5, 1.5] / sqrt(d) for every case.
        verbose: print one line on success.
        batched: False for a candidate that takes single-head ``(N, d)`` inputs; cases with
            B * H > 1 are then skipped.

    Returns:
        A :class:`CheckSummary` (number of cases, worst error and its tolerance).
    """
    if not callable(fn):
        raise TypeError(f"check_attention needs a function to check, got {type(fn).__name__}")
    if scale not in ("default", "random"):
        raise ValueError(f"scale must be 'default' or 'random', got {scale!r}")
    device = runtime.device() if device is None else torch.device(device)
    if cases is None:
        cases = attention_cases(sizes="large" if device.type == "cuda" else "small")
    if not batched:
        cases = [c for c in cases if c.B * c.H == 1]
    if not cases:
        raise ValueError("check_attention got no cases to run")
    atol, rtol = tolerance(dtype)
    worst = (0.0, atol, "")  # (error, tolerance, case) at the highest error / tolerance ratio
    for case in cases:
        q, k, v = random_qkv(case, dtype, device)
        if not batched:
            q, k, v = q[0, 0], k[0, 0], v[0, 0]
        s = _case_scale(case, scale)
        O_ref, LSE_ref = reference.attention(q, k, v, causal=case.causal, scale=s)
        max_score = float((q.double() @ k.double().transpose(-2, -1)).abs().amax()) * abs(s)
        atol, rtol = tolerance(dtype, max_score)

        snap = snapshot(q, k, v, names=("Q", "K", "V"))
        O, LSE = _call(fn, q, k, v, case, s, dtype, out, returns_lse)
        assert_unchanged(snap, case=case.name)

        try:
            err, tol = compare("O", O, O_ref, case=case.name, atol=atol, rtol=rtol,
                               hint=case.hint, dtype=dtype, poisoned=out)  # fmt: skip
            if returns_lse:
                err_l, tol_l = compare("LSE", LSE, LSE_ref, case=case.name, atol=atol,
                                       rtol=rtol, hint=_HINT_LSE, poisoned=out)  # fmt: skip
                if err_l / tol_l > err / tol:
                    err, tol = err_l, tol_l
        except CheckFailure as failure:
            failure.detail += f" [{str(dtype).replace('torch.', '')} inputs on {device}]"
            small = failure.worst_error is not None and failure.worst_error < 1e-2
            if small and dtype == torch.float32 and device.type == "cuda":
                failure.hint = (failure.hint or "") + _TF32_NOTE  # a near miss: TF32?
            raise
        if err / tol >= worst[0] / worst[1]:
            worst = (err, tol, case.name)
    summary = CheckSummary(len(cases), worst[0], worst[1], worst[2], dtype, str(device))
    if verbose:
        print(summary)
    return summary


def check_against_sdpa(
    fn=None,
    *,
    cases=None,
    dtype=torch.float32,
    device=None,
    returns_lse=True,
    scale="default",
    verbose=True,
):
    """Compare the float64 reference, PyTorch's SDPA and (optionally) ``fn`` on the same inputs.

    A report, not a gate: nothing is raised. It shows that the course's reference and
    ``torch.nn.functional.scaled_dot_product_attention`` agree (so checking against one is
    checking against the other), and where your ``fn`` stands between them. Works on CPU
    tensors too. Only O is compared: SDPA does not return LSE. Rows in which the reference
    finds no key to attend to (LSE = -inf) are skipped: depending on the version and backend,
    SDPA returns NaN, 0 or an average of V there.

    Args:
        fn: optional candidate, called like in :func:`check_attention` (``out=False``).
        cases, dtype, device, returns_lse, scale: as in :func:`check_attention`.
        verbose: print a table.

    Returns:
        A list of dicts, one per case: ``case``, ``sdpa_vs_ref``, ``yours_vs_ref``,
        ``yours_vs_sdpa`` (max absolute errors of O; None without ``fn``), ``tolerance``
        (atol for the case) and ``ok`` (whether ``fn`` is within tolerance; None without it).
    """
    import torch.nn.functional as F

    if scale not in ("default", "random"):
        raise ValueError(f"scale must be 'default' or 'random', got {scale!r}")
    device = runtime.device() if device is None else torch.device(device)
    if cases is None:
        cases = attention_cases(sizes="large" if device.type == "cuda" else "small")
    rows = []
    for case in cases:
        q, k, v = random_qkv(case, dtype, device)
        s = _case_scale(case, scale)
        O_ref, LSE_ref = reference.attention(q, k, v, causal=case.causal, scale=s)
        max_score = float((q.double() @ k.double().transpose(-2, -1)).abs().amax()) * abs(s)
        atol, rtol = tolerance(dtype, max_score)
        rows_seen = torch.isfinite(LSE_ref)[..., None]  # (..., Nq, 1)
        O_sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, scale=s)
        row = {
            "case": case.name,
            "sdpa_vs_ref": _max_error(O_sdpa, O_ref, rows_seen),
            "yours_vs_ref": None,
            "yours_vs_sdpa": None,
            "tolerance": atol,
            "ok": None,
        }
        if fn is not None:
            O, _ = _call(fn, q, k, v, case, s, dtype, False, returns_lse)
            O = validated(O, O_ref.shape, what="O", case=case.name)
            row["yours_vs_ref"] = _max_error(O, O_ref, rows_seen)
            row["yours_vs_sdpa"] = _max_error(O, O_sdpa, rows_seen)
            excess = (O.double() - O_ref).abs() - atol - rtol * O_ref.abs()
            row["ok"] = bool(not torch.where(rows_seen, excess > 0, False).any()) and bool(
                torch.isfinite(torch.where(rows_seen, O.double(), 0.0)).all()
            )
        rows.append(row)
    if verbose:
        _print_sdpa_table(rows, dtype, device)
    return rows


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _max_error(x, y, rows_seen):
    """Max ``|x - y|`` over the rows where ``rows_seen`` (``(..., Nq, 1)``) is True."""
    diff = (x.double() - y.double()).abs()
    return float(torch.where(rows_seen, diff, torch.zeros_like(diff)).amax())


def _case_scale(case, mode):
    """The float scale for ``case``: its own, 1/sqrt(d), or a random one."""
    if mode == "random":
        return float(torch.empty(()).uniform_(0.5, 1.5)) / math.sqrt(case.d)
    return case.scale if case.scale is not None else 1.0 / math.sqrt(case.d)


def _call(fn, q, k, v, case, scale, dtype, out, returns_lse):
    """Call the candidate as the check requires; return ``(O, LSE)`` (LSE None if not produced)."""
    try:
        if out:
            O = poisoned(q.shape[:-1] + v.shape[-1:], dtype, q.device)
            lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            LSE = poisoned(q.shape[:-1], lse_dtype, q.device)
            buffers = (O, LSE) if returns_lse else (O,)
            fn(q, k, v, *buffers, causal=case.causal, scale=scale)
            result = buffers
        else:
            result = fn(q, k, v, causal=case.causal, scale=scale)
        if q.is_cuda:
            torch.cuda.synchronize(q.device)
    except Exception as error:
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(f"(raised by the function under test, in case {case.name!r})")
        raise
    if out:
        return result if returns_lse else (result[0], None)
    is_pair = isinstance(result, (tuple, list))
    if returns_lse:
        if not is_pair or len(result) != 2:
            what = f"a {type(result).__name__}" if not is_pair else f"{len(result)} values"
            raise CheckFailure(
                case.name,
                f"the function returned {what}, but this check expects the pair (O, LSE)",
                "return O, LSE, or check O alone with check_attention(..., returns_lse=False).",
            )
        return result[0], result[1]
    if is_pair:
        raise CheckFailure(
            case.name,
            f"the function returned {len(result)} values, but this check expects O alone",
            "return only O, or check (O, LSE) with check_attention(..., returns_lse=True).",
        )
    return result, None


def _print_sdpa_table(rows, dtype, device):
    width = max(len(r["case"]) for r in rows)
    print(f"O errors (max |difference|), {str(dtype).replace('torch.', '')} inputs on {device}")
    print(f"{'case':<{width}}  {'SDPA vs ref':>11}  {'yours vs ref':>12}  "
          f"{'yours vs SDPA':>13}  {'atol':>9}")  # fmt: skip
    for r in rows:
        yours = "-" if r["yours_vs_ref"] is None else f"{r['yours_vs_ref']:.1e}"
        vs_sdpa = "-" if r["yours_vs_sdpa"] is None else f"{r['yours_vs_sdpa']:.1e}"
        mark = "" if r["ok"] is None else ("  ✅" if r["ok"] else "  ❌")
        print(f"{r['case']:<{width}}  {r['sdpa_vs_ref']:>11.1e}  {yours:>12}  {vs_sdpa:>13}  "
              f"{r['tolerance']:>9.1e}{mark}")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Classes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionCase:
    """One attention problem: ``Q`` is ``(B, H, Nq, d)``, ``K`` and ``V`` are ``(B, H, Nk, d)``.

    ``logit_scale`` multiplies the standard deviation of the scores (see :func:`random_qkv`);
    ``scale`` is the softmax scale (None: 1/sqrt(d)); ``hint`` says which bug usually fails
    this case.
    """

    name: str
    B: int
    H: int
    Nq: int
    Nk: int
    d: int
    causal: bool = False
    logit_scale: float = 1.0
    hint: str | None = None
    scale: float | None = None

    def __post_init__(self):
        for field in ("B", "H", "Nq", "Nk", "d"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"AttentionCase {self.name!r}: {field} must be an int >= 1, "
                                 f"got {value!r}")  # fmt: skip
        if not self.logit_scale > 0:
            raise ValueError(f"AttentionCase {self.name!r}: logit_scale must be > 0")


@dataclass(frozen=True)
class CheckSummary:
    """What a passing :func:`check_attention` found; ``str()`` is its one-line report."""

    cases: int
    worst_error: float
    tolerance: float
    worst_case: str
    dtype: torch.dtype
    device: str

    def __str__(self):
        dtype = str(self.dtype).replace("torch.", "")
        return (
            f"✅ {self.cases} cases passed ({dtype} on {self.device}; worst error "
            f"{self.worst_error:.1e}, tolerance {self.tolerance:.1e})"
        )

    def __repr__(self):  # what a notebook cell ending with the check shows: short, not a wall
        dtype = str(self.dtype).replace("torch.", "")
        return (f"CheckSummary(cases={self.cases}, worst_error={self.worst_error:.2e}, "
                f"tolerance={self.tolerance:.2e}, dtype={dtype}, device={self.device!r},\n"
                f"             worst_case={self.worst_case!r})")
