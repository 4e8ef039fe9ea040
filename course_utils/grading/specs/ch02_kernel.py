"""Chapter 02's ``02.softmax_kernel``: the Numba row log-softmax kernel, one block of
``THREADS`` threads per row, with its reads of x counted (at most two per element).

Its own room because it is the chapter's one kernel: launched on NaN-poisoned buffers, judged
on float64 models of the kernel slips, and measured by the memory tracer (``access_counts``,
which ``ch03`` uses too). ``ch02`` binds the exercise last among the chapter's exercises.
"""

from __future__ import annotations

import math

import torch

from ... import reference
from ...runtime import kernel_array, pick, synchronize
from ..checks import (
    CheckFailure,
    Mistake,
    assert_unchanged,
    brief,
    compare,
    poisoned,
    snapshot,
    tolerance,
    validated,
)
from ..harness.ch02 import THREADS  # threads per block of 02.softmax_kernel
from ..types import Exercise, invoke
from . import require_implemented
from .ch02_common import _add, _randn

softmax_kernel = Exercise(
    "02.softmax_kernel",
    "Row log-softmax and LSE in Numba: two reads of x, one tree merge of (m, l)", points=4,
)

HINT_KERNEL = (
    "one block per row (row = blockIdx.x): each thread folds its elements "
    "j = threadIdx.x, threadIdx.x + THREADS, ... < N into an online state (m, l); the block "
    "merges the THREADS states by a tree reduction in shared memory, with a barrier after each "
    "level (merging two states (m, l) rescales each l by exp(m_side - m_new)); then "
    "lse = m + log(l), thread 0 writes lse[row], and every thread writes "
    "out[row, j] = x[row, j] - lse for its own j"
)
HINT_KERNEL_LONG = (
    "the row is longer than the block: each thread must loop over j = threadIdx.x, "
    "threadIdx.x + THREADS, ... while j < N, in the reduction and in the output loop"
)
HINT_KERNEL_SHORT = (
    "threads with no element (threadIdx.x >= N) must not read x[row, j] for j >= N, but must "
    "still put the neutral state (m = -inf, l = 0) in shared memory and reach every barrier; "
    "merging two neutral states must not compute exp(-inf - (-inf)) = NaN"
)
HINT_KERNEL_ONE = (
    "N = 1: only thread 0 has an element; the other threads hold m = -inf, l = 0, and merging "
    "two such states must not compute exp(-inf - (-inf)) = NaN (test m == -inf first)"
)
HINT_KERNEL_LARGE = (
    "subtract the running max before exp (exp overflows float32 above 88.7), and form "
    "x - lse with lse = m + log(l), never log(exp(x - m) / l): exp(x - m) underflows to 0 for "
    "logits far below the max, and log(0) = -inf"
)
HINT_KERNEL_LSE = (
    "lse[row] = m + log(l) with the row's merged m and l (natural log), written once per row "
    "(by thread 0, say)"
)
HINT_KERNEL_READS = (
    "read each x[row, j] at most twice: once in the online pass that folds it into the "
    "thread's (m, l), once in the output pass. A separate pass for the max and another for the "
    "sum (the lecture's kernel) is three reads; merge (m, l) states instead."
)


def log_softmax_reference(x):
    """``x - logsumexp(x)`` row by row, in float64."""
    return x.double() - reference.logsumexp(x)[:, None]


def _kernel_outputs(x):
    return poisoned(x.shape, device=x.device), poisoned(x.shape[:1], device=x.device)


MISTAKE_KERNEL_NAN = Mistake(
    "two states of no elements merged into NaN",
    "with N < THREADS, some threads have no element and keep (m, l) = (-inf, 0); a tree level "
    "that merges two of them computes exp(-inf - (-inf)) = NaN, and the NaN reaches the row's "
    "state. Leave such a pair at (-inf, 0): test whether the merged max is -inf first",
)
MISTAKE_KERNEL_LSE_NO_M = Mistake(
    "lse = log(l), the max left out",
    "l is a sum of exp(x - m), in units of exp(m): log(l) is the logsumexp minus m. "
    "lse = m + log(l), with the row's merged m",
)
MISTAKE_KERNEL_SOFTMAX = Mistake(
    "the softmax written instead of the log-softmax",
    "out is the log of the softmax, x - lse: no exp in the output pass",
)
MISTAKE_KERNEL_NO_STRIDE = Mistake(
    "one element per thread (no loop over the row)",
    HINT_KERNEL_LONG,
)
MISTAKE_KERNEL_LOG_EXP = Mistake(
    "log(exp(x - m) / l) in the output pass",
    "exp(x - m) underflows to 0 for logits far below the max, and log(0) = -inf; "
    "x - (m + log(l)) needs no exp and stays finite",
)


def _kernel_mistakes(x):
    """(mistakes for out, mistakes for lse): what the usual slips of 02.softmax_kernel write."""
    R, N = x.shape
    x64 = x.double()
    lse = reference.logsumexp(x)  # (R,)
    top = x64.amax(dim=-1)

    def all_nan(shape):
        def model():
            if N >= THREADS // 2:
                raise ValueError("every pair of a tree level holds an element")
            return torch.full(shape, math.nan, dtype=torch.float64, device=x.device)

        return model

    def first_block():  # only the first THREADS columns, the rest never written
        head = reference.logsumexp(x[:, :THREADS])
        out = torch.full_like(x64, math.nan)
        out[:, :THREADS] = x64[:, :THREADS] - head[:, None]
        return out, head

    def log_of_exp(dtype):  # exp underflows below -103 in float32 (a GPU), -745 in float64
        def model():  # (the simulator runs math.exp in float64)
            shifted = (x64 - top[:, None]).to(dtype)
            return torch.log(torch.exp(shifted) / (lse - top).exp().to(dtype)[:, None]).double()

        return model

    found_out = [(MISTAKE_KERNEL_NAN, all_nan((R, N))),
                 (MISTAKE_KERNEL_LSE_NO_M, lambda: x64 - (lse - top)[:, None]),
                 (MISTAKE_KERNEL_SOFTMAX, lambda: torch.exp(x64 - lse[:, None])),
                 (MISTAKE_KERNEL_NO_STRIDE, lambda: first_block()[0]),
                 (MISTAKE_KERNEL_LOG_EXP, log_of_exp(torch.float32)),
                 (MISTAKE_KERNEL_LOG_EXP, log_of_exp(torch.float64))]  # fmt: skip
    found_lse = [(MISTAKE_KERNEL_NAN, all_nan((R,))),
                 (MISTAKE_KERNEL_LSE_NO_M, lambda: lse - top),
                 (MISTAKE_KERNEL_NO_STRIDE, lambda: first_block()[1])]  # fmt: skip
    return found_out, found_lse


def _compare_kernel(x, out, lse, where, hint):
    atol, rtol = tolerance(torch.float32, float(x.abs().max()))
    slips_out, slips_lse = _kernel_mistakes(x)
    compare("out", out, log_softmax_reference(x), case=where, atol=atol, rtol=rtol, hint=hint,
            poisoned=True, mistakes=slips_out)  # fmt: skip
    compare("lse", lse, reference.logsumexp(x), case=where, atol=atol, rtol=rtol,
            hint=hint if hint is not HINT_KERNEL else HINT_KERNEL_LSE, poisoned=True,
            mistakes=slips_lse)  # fmt: skip


def _kernel_case(case, R, N, *, std=3.0, hint=HINT_KERNEL):
    def run(kernel):
        where = f"{case} [{R} blocks of {THREADS} threads]"
        x = _randn(R, N, std=std)
        out, lse = _kernel_outputs(x)  # NaN: an element the kernel never writes cannot pass
        snap = snapshot(x, names=["x"])
        require_implemented(kernel)
        try:
            kernel[R, THREADS](kernel_array(x), kernel_array(out), kernel_array(lse))
            synchronize()
        except IndexError as exc:  # the simulator checks every index; a GPU would not
            raise CheckFailure(where, f"a thread indexed out of bounds: {exc}",
                               HINT_KERNEL_SHORT) from None  # fmt: skip
        except ValueError as exc:  # the simulator's math.log(0); a GPU gives -inf
            if "math domain error" not in str(exc):
                raise
            raise CheckFailure(where, f"a thread took the log of 0 (the simulator's {exc}; a "
                               "GPU would write -inf)", MISTAKE_KERNEL_LOG_EXP.hint_for("out")
                               ) from None  # fmt: skip
        assert_unchanged(snap, case=where)
        _compare_kernel(x, out, lse, where, hint)

    return run


def access_counts(counts, shapes, case):
    """What ``harness.ch02.count_accesses`` sent back, checked before it is read: a dict with,
    for each array named in ``shapes``, integer ``reads`` and ``writes`` tensors and the array
    after the launch, ``value``, each of the array's shape (``checks.validated``)."""
    if not isinstance(counts, dict):
        raise CheckFailure(case, f"the access counts are {brief(counts)}, not a dict")
    checked = {}
    for name, shape in shapes.items():
        entry = counts.get(name)
        if not isinstance(entry, dict):
            raise CheckFailure(case, f"the access counts of {name} are {brief(entry)}, not a "
                               "dict of reads, writes and value")  # fmt: skip
        got = {}
        for key in ("reads", "writes"):
            t = validated(entry.get(key), shape, what=f"the {key} of {name}", case=case)
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise CheckFailure(case, f"the {key} of {name} are {t.dtype} values, not counts")
            got[key] = t
        got["value"] = validated(entry.get("value"), shape, what=name, case=case)
        checked[name] = got
    return checked


def _reads_case(case, R, N):
    def run(kernel):
        where = f"{case} [{R} blocks of {THREADS} threads, traced in the simulator]"
        x = torch.randn(R, N) * 3.0  # on the CPU: the tracer runs the simulator
        out, lse = _kernel_outputs(x)
        require_implemented(kernel)
        try:
            counts = invoke(kernel, "course_utils.grading.harness.ch02:count_accesses", R, THREADS,
                            [x.clone(), out, lse], ["x", "out", "lse"])  # fmt: skip
        except IndexError as exc:
            raise CheckFailure(where, f"a thread indexed out of bounds: {exc}",
                               HINT_KERNEL_SHORT) from None  # fmt: skip
        counts = access_counts(counts, {"x": (R, N), "out": (R, N), "lse": (R,)}, where)
        reads, writes = counts["x"]["reads"], counts["x"]["writes"]
        if int(writes.sum()) > 0:
            raise CheckFailure(where, f"the kernel wrote into x {int(writes.sum())} times",
                               "x is the input: write only out and lse")  # fmt: skip
        most = int(reads.max())
        if most > 2:
            r, j = divmod(int(reads.argmax()), N)
            raise CheckFailure(where, f"x[{r}, {j}] was read {most} times from global memory "
                               f"(at most 2 allowed); {int((reads > 2).sum())} of {R * N} "
                               "elements were read more than twice", HINT_KERNEL_READS)
        if int(reads.min()) < 1:
            raise CheckFailure(where, f"{int((reads == 0).sum())} elements of x were never read",
                               HINT_KERNEL_LONG)  # fmt: skip
        _compare_kernel(x, counts["out"]["value"], counts["lse"]["value"], where, HINT_KERNEL)

    return run


_add(softmax_kernel, "4 rows x 50 (longer than the block, not a power of two)", _kernel_case,
     4, 50)
_add(softmax_kernel, "3 rows x 7 (shorter than the block)", _kernel_case, 3, 7,
     hint=HINT_KERNEL_SHORT)
_add(softmax_kernel, "each x[row, j] read at most twice (counted), 2 rows x 70", _reads_case,
     2, 70)
_add(softmax_kernel, "read at most twice, 2 rows x 9 (shorter than the block, counted)",
     _reads_case, 2, 9)
_add(softmax_kernel, "2 rows x 40, logits of std 1000", _kernel_case, 2, 40, std=1000.0,
     hint=HINT_KERNEL_LARGE)
_add(softmax_kernel, "2 rows x 32 (exactly one block)", _kernel_case, 2, 32)
_add(softmax_kernel, "2 rows x 1 (length 1)", _kernel_case, 2, 1, hint=HINT_KERNEL_ONE)
_add(softmax_kernel, "3 rows x 1 (length 1)", _kernel_case, 3, 1, hint=HINT_KERNEL_ONE,
     hidden=True)
_add(softmax_kernel, "2 rows x 100, logits of std 1000", _kernel_case, 2, 100, std=1000.0,
     hint=HINT_KERNEL_LARGE, hidden=True)
_add(softmax_kernel, "3 rows x 32 (exactly one block)", _kernel_case, 3, 32, hidden=True)
_add(softmax_kernel, "rows much longer than the block", _kernel_case,
     *pick(gpu=(300, 5003), cpu=(2, 131)), hint=HINT_KERNEL_LONG, hidden=True)
_add(softmax_kernel, "read at most twice, rows shorter than the block (counted)", _reads_case,
     3, 9, hidden=True)
