"""Chapter 07's ``07.combine_splits``: the split-KV ("flash-decoding") combine in CUDA C++,
written from a blank body.

Its own room because it is the chapter's one CUDA C++ exercise: compiled (nvcc or NVRTC),
launched on a GPU or under the CPU emulation, and judged on float64 models of the combine's
slips; nothing here is shared with the Python and Numba exercises. ``ch07`` binds the exercise
last among the chapter's exercises.
"""

from __future__ import annotations

import math

import torch

from ... import reference
from ...runtime import device, on_gpu
from .. import emulated
from ..checks import AttentionCase, CheckFailure, Mistake, compare, random_qkv, tolerance
from ..harness.ch07 import COMBINE_KERNEL
from ..types import Exercise, invoke
from . import compiled_resources, source_of
from .ch07_common import window_keep

combine_splits = Exercise(
    "07.combine_splits", "Combine split-KV partial results (CUDA C++, flash-decoding)", points=2
)

_HC = {
    "plain": "O = sum_s exp(LSE_s - LSE) O_s with LSE = log(sum_s exp(LSE_s)): take the max M of "
    "the LSE_s first, then w_s = exp(LSE_s - M), LSE = M + log(sum w_s), "
    "O = sum w_s O_s / sum w_s.",
    "empty": "a split whose keys the row never sees has LSE_s = -inf and O_s = 0: its weight "
    "exp(-inf - M) is 0; if every split is empty (M = -inf) write O = 0 and LSE = -inf, never "
    "exp(-inf - (-inf)) = NaN.",
    "large": "LSE_s of +-hundreds: exp(LSE_s) overflows float32 above 88.7; subtract their max.",
}

_compiled: dict[str, str] = {}  # source -> what the compile step said

MISTAKE_NO_MAX = Mistake(
    "exp(LSE_s) without subtracting the max M",
    "exp of an LSE_s above 88.7 is inf in float32 (and a row whose every LSE_s is -inf divides "
    "0 by 0): take M = max over s of LSE_s first and weigh by exp(LSE_s - M)",
)
MISTAKE_NO_EMPTY_GUARD = Mistake(
    "no guard for a row that sees no key (M = -inf)",
    "when every LSE_s of a row is -inf, exp(LSE_s - M) is exp(NaN): test M == -inf first and "
    "write O = 0, LSE = -inf",
)
MISTAKE_LSE_NO_MAX = Mistake(
    "LSE = log(sum of the weights), without + M",
    "the weights were scaled by exp(-M), so their log is LSE - M: add M back",
)
MISTAKE_NOT_NORMALISED = Mistake(
    "O not divided by the sum of the weights",
    "O is a weighted mean of the O_s: divide the weighted sum by the sum of the weights",
)


def _combine_mistakes(O_parts, LSE_parts, O, LSE):
    """(slips of O, slips of LSE): what each known wrong combine computes on these inputs."""

    def no_max():  # float32, in the kernel's order: the overflow is the point
        w = torch.exp(LSE_parts.float().cpu())
        total = torch.zeros(w.shape[1])
        out = torch.zeros(O_parts.shape[1:])
        for s in range(w.shape[0]):
            total = total + w[s]
            out = out + w[s][:, None] * O_parts[s].float().cpu()
        return out / total[:, None], torch.log(total)

    lse = LSE_parts.double().cpu()
    M = lse.max(dim=0).values
    empty = torch.isneginf(M)
    e_O, e_LSE = O.double().cpu(), LSE.double().cpu()
    nan = torch.tensor(math.nan, dtype=torch.float64)
    no_guard_O = torch.where(empty[:, None], nan, e_O)
    no_guard_LSE = torch.where(empty, nan, e_LSE)
    lse_minus_M = torch.where(empty, e_LSE, e_LSE - M)
    scale = torch.exp(torch.where(empty, 0.0, e_LSE - M))  # sum of the weights exp(LSE_s - M)
    not_normalised = torch.where(empty[:, None], e_O, e_O * scale[:, None])
    # the missing guard first: where no LSE_s is large, a combine without the max gives the
    # same NaN in the rows that see no key (0 / 0), and the guard is what those rows need
    return ([(MISTAKE_NO_EMPTY_GUARD, no_guard_O), (MISTAKE_NO_MAX, lambda: no_max()[0]),
             (MISTAKE_NOT_NORMALISED, not_normalised)],
            [(MISTAKE_NO_EMPTY_GUARD, no_guard_LSE), (MISTAKE_NO_MAX, lambda: no_max()[1]),
             (MISTAKE_LSE_NO_MAX, lse_minus_M)])  # fmt: skip


def _combine_problem(rows, Nk, d, n_splits, logit_scale=1.0):
    """Partial results of ``n_splits`` key chunks (inputs) and the full attention (expected).

    The mask is the exercises' bottom-right causal one: the rows are the last ``rows``
    positions, so with rows > Nk the first rows see no key at all.
    """
    dev = device()
    case = AttentionCase("combine", 1, 1, rows, Nk, d, logit_scale=logit_scale)
    q, k, v = (t[0, 0] for t in random_qkv(case, device=dev))
    keep = window_keep(rows, Nk, None).to(dev)
    bounds = [round(s * Nk / n_splits) for s in range(n_splits + 1)]
    O_parts = torch.empty(n_splits, rows, d, device=dev)
    LSE_parts = torch.empty(n_splits, rows, device=dev)
    for s in range(n_splits):
        a, b = bounds[s], bounds[s + 1]
        O_s, LSE_s = reference.attention(q, k[a:b], v[a:b], mask=keep[:, a:b])
        O_parts[s], LSE_parts[s] = O_s.float(), LSE_s.float()
    O, LSE = reference.attention(q, k, v, mask=keep)
    max_score = float(LSE_parts[torch.isfinite(LSE_parts)].abs().max()) if keep.any() else 0.0
    return (O_parts, LSE_parts), (O, LSE), max_score


def _combine_case(*problems):
    """problems: (name, rows, Nk, d, n_splits, logit_scale, hint)."""

    def run(candidate):
        source = source_of(candidate)
        name = problems[0][0]
        if source not in _compiled:
            try:  # compile errors (CheckFailure) show on any machine
                compiled_resources(source, COMBINE_KERNEL, case=name,
                                   hint=f"keep the kernel's name {COMBINE_KERNEL}")  # fmt: skip
                _compiled[source] = "compiled with nvcc"
            except NotImplementedError:  # the placeholder (a RuntimeError too)
                raise
            except RuntimeError as exc:  # no compiler here: nothing to say before a GPU runs it
                _compiled[source] = f"not compiled ({str(exc).split(':')[0]})"
        for name, rows, Nk, d, n_splits, logit_scale, hint in problems:
            (O_parts, LSE_parts), (O, LSE), max_score = _combine_problem(
                rows, Nk, d, n_splits, logit_scale)
            out_O = torch.full((rows, d), math.nan, device=O_parts.device)
            out_LSE = torch.full((rows,), math.nan, device=O_parts.device)
            if on_gpu():
                got = invoke(candidate, "course_utils.grading.harness.ch07:run_combine", O_parts,
                             LSE_parts, out_O, out_LSE)  # fmt: skip
            else:  # the same body on the CPU (course_utils.toolbox.cuda_cpu): one block per row
                name = f"{name} (CPU emulation)"
                emulated.run_case(candidate, COMBINE_KERNEL, (rows,), (d,), O_parts, LSE_parts,
                                  out_O, out_LSE, n_splits, rows, d, case=name)  # fmt: skip
                got = (out_O, out_LSE)
            if not isinstance(got, (tuple, list)) or len(got) != 2:
                raise CheckFailure(name, "the launch returned no (O, LSE)")
            atol, rtol = tolerance(torch.float32, max_score)
            slips_O, slips_LSE = _combine_mistakes(O_parts, LSE_parts, O, LSE)
            compare("O", got[0], O, case=name, atol=atol, rtol=rtol, dtype=torch.float32,
                    hint=hint, poisoned=True, mistakes=slips_O)  # fmt: skip
            compare("LSE", got[1], LSE, case=name, atol=atol, rtol=rtol, dtype=torch.float32,
                    hint=hint, poisoned=True, mistakes=slips_LSE)  # fmt: skip

    return run


combine_splits.case("4 splits of 64 keys, 8 rows, d=64")(
    _combine_case(("4 splits, rows=8, Nk=256, d=64", 8, 256, 64, 4, 1.0, _HC["plain"]))
)
combine_splits.case("splits a row never sees (LSE_s = -inf), rows that see no key, d=32")(
    _combine_case(("3 splits, rows=50 > Nk=40, d=32", 50, 40, 32, 3, 1.0, _HC["empty"]))
)
# std 100, not 30: at std 30 the largest LSE_s of a draw is about 90, and now and then below
# 88.7, where exp does not overflow yet and a combine without the max slips through
combine_splits.case("scores of std 100: LSE_s far apart, d=128")(
    _combine_case(("5 splits, rows=8, Nk=300, d=128, logits x100", 8, 300, 128, 5, 100.0,
                   _HC["large"]))  # fmt: skip
)
combine_splits.case("rows that see no key at all; 1 split; 16 splits", hidden=True)(
    _combine_case(("rows=20 > Nk=8, 2 splits, d=16", 20, 8, 16, 2, 1.0, _HC["empty"]),
                  ("1 split, rows=5, Nk=50, d=64", 5, 50, 64, 1, 1.0, _HC["plain"]),
                  ("16 splits, rows=3, Nk=1000, d=128", 3, 1000, 128, 16, 1.0, _HC["plain"]))
)
