"""Chapter 10 (tensor cores): the constants its exercise notebook imports, and the student-side
helpers that tabulate a student's map in one call instead of one call per element.

Nothing here knows an expected value: the grader (``course_utils.grading.specs.ch10``) builds its
own tables and compares what comes back.
"""

from __future__ import annotations

import numpy as np

from ...library import mma

# Imported here, not only inside the helpers, so that the grading worker's snapshot of the
# course's code (sandbox._Pristine, taken once the harness modules are imported) covers them:
# a notebook that replaces mma.mma_m16n8k16 or cuda_cpu.launch_twice is then refused.
from ...toolbox import cuda_cpu

# 10.fragment_map_k32: mma.sync.aligned.m16n8k32 with 8-bit integers; A is 16 x 32 (M x K) and
# each of the 32 lanes holds 16 values of it (4 registers of 4 bytes).
K32_M, K32_K = 16, 32
K32_A_VALUES = 16

# 10.swizzle_64b: a shared bf16 tile of SWIZZLE_ROWS rows of D_SMALL = 32 elements (64 bytes, four
# 16-byte chunks per row): two rows share one 128-byte line of the 32 banks.
D_SMALL = 32
SWIZZLE_ROWS = 64
ELEMENT_BYTES = 2
CHUNK_ELEMENTS = 16 // ELEMENT_BYTES  # 8 bf16 values in one 16-byte chunk (one cp.async)

# 10.wait_placement: the operations a schedule is made of.
OPS = ("copy", "commit", "wait", "sync", "compute")

# 10.warp_loop: where each value of a C fragment (32 lanes x 4 values) sits in a 16 x 8 tile.
_LANES = np.arange(32)
ROW = np.stack([_LANES // 4, _LANES // 4, _LANES // 4 + 8, _LANES // 4 + 8], axis=1)  # (32, 4)
COL = 2 * (_LANES % 4)[:, None] + np.array([0, 1, 0, 1])  # (32, 4): column within the n-tile

MAX_TRACED_MMA = 4096  # the most mma calls traced_forward records (the loop needs far fewer)

__all__ = ["CHUNK_ELEMENTS", "COL", "D_SMALL", "ELEMENT_BYTES", "K32_A_VALUES", "K32_K", "K32_M",
           "LOOP_BC", "LOOP_D", "LOOP_KERNEL", "OPS", "ROW", "SWIZZLE_ROWS", "k_fragment",
           "map_table", "offset_table", "run_warp_flash", "traced_forward",
           "v_fragment"]  # fmt: skip


def _number(value, what: str) -> float:
    """A returned value as a float (integers stay exact up to 2**53); TypeError otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{what} must be a number, got {type(value).__name__} ({value!r})")
    return float(value)


def map_table(fn, lanes: int, values: int):
    """``fn(lane, i)`` for every lane and value index: a float64 array (lanes, values, 2) of the
    (row, col) pairs it returns (floats are kept as they are, so the grader can report them)."""
    out = np.empty((lanes, values, 2), dtype=np.float64)
    for lane in range(lanes):
        for i in range(values):
            got = fn(lane, i)
            if not isinstance(got, (tuple, list)) or len(got) != 2:
                raise TypeError(f"({lane}, {i}) -> {got!r}: return a pair (row, col)")
            out[lane, i] = [_number(x, f"the row or col of ({lane}, {i})") for x in got]
    return out


def offset_table(fn, rows: int, cols: int):
    """``fn(row, col)`` for every element of a rows x cols tile: a float64 array (rows, cols)."""
    out = np.empty((rows, cols), dtype=np.float64)
    for r in range(rows):
        for c in range(cols):
            out[r, c] = _number(fn(r, c), f"the offset of ({r}, {c})")
    return out


def _rows(X, start: int, count: int) -> np.ndarray:
    """Rows start .. start+count-1 of X (float32), zero rows past its end (a ragged last tile)."""
    X = np.asarray(X, dtype=np.float32)
    out = np.zeros((count, X.shape[1]), dtype=np.float32)
    part = X[max(start, 0):start + count]
    out[:len(part)] = part
    return out


def k_fragment(K, key0: int, c: int) -> np.ndarray:
    """The B fragment (32, 4) of S = Q K^T for keys key0 .. key0+7 and head dims c .. c+15: what
    ``ldmatrix`` of K's rows leaves in each lane (B = K^T, so K needs no transpose). Keys past
    the end of K are zero."""

    return mma.fragments(_rows(K, key0, 8)[:, c:c + 16].T, "B")


def v_fragment(V, key0: int, c: int) -> np.ndarray:
    """The B fragment (32, 4) of O += P V for keys key0 .. key0+15 and head dims c .. c+7: what
    ``ldmatrix.trans`` of V's rows leaves in each lane. Keys past the end of V are zero."""

    return mma.fragments(_rows(V, key0, 16)[:, c:c + 8], "B")


def traced_forward(fn, Q, K, V, Bc, causal, q0):
    """Run ``fn(Q, K, V, Bc, causal, q0)`` with every ``mma.mma_m16n8k16`` call recorded.

    Returns ``(O, LSE, trace)``: what ``fn`` returned, and a dict of the operands and results of
    the first :data:`MAX_TRACED_MMA` calls, in call order (``a`` (n, 32, 8), ``b`` (n, 32, 4),
    ``c`` and ``d`` (n, 32, 4), float32) with ``calls``, the number of calls made. The grader
    replays every recorded call and looks in them for the products the loop must make: the
    trace is data it checks, not a verdict.
    """

    real = mma.mma_m16n8k16
    record = {"a": [], "b": [], "c": [], "d": [], "calls": 0}

    def mma_m16n8k16(a_frag, b_frag, c_frag):
        d = real(a_frag, b_frag, c_frag)
        record["calls"] += 1
        if len(record["d"]) < MAX_TRACED_MMA:
            for key, x in zip("abcd", (a_frag, b_frag, c_frag, d), strict=True):
                record[key].append(np.array(x, dtype=np.float32))
        return d

    names = getattr(fn, "__globals__", {})
    aliases = [k for k, v in list(names.items()) if v is real]
    mma.mma_m16n8k16 = mma_m16n8k16
    for k in aliases:
        names[k] = mma_m16n8k16
    try:
        out = fn(np.array(Q, np.float32), np.array(K, np.float32), np.array(V, np.float32),
                 int(Bc), bool(causal), int(q0))
    finally:
        mma.mma_m16n8k16 = real
        for k in aliases:
            names[k] = real
    O, LSE = out if isinstance(out, (tuple, list)) and len(out) == 2 else (out, None)
    shapes = {"a": (32, 8), "b": (32, 4), "c": (32, 4), "d": (32, 4)}
    trace = {k: (np.stack(record[k]) if record[k] else np.zeros((0,) + shapes[k], np.float32))
             for k in "abcd"}
    trace["calls"] = record["calls"]
    return O, LSE, trace


# 10.warp_loop_cuda: the teaching kernel's name and shape (one warp of 32 lanes per 16 rows).
LOOP_KERNEL = "warp_flash_forward"
LOOP_D, LOOP_BC = 64, 32
_built: dict = {}


def run_warp_flash(source, Q, K, V, O, LSE, Nq, N, q_offset, scale, causal):
    """Build the student's ``warp_flash_forward`` with NVRTC (its ``#include "mma_helpers.cuh"``
    pasted in) and launch it on the GPU: one block of 32 threads per 16 query rows. Q, K, V are
    bf16 CUDA tensors, O and LSE float32 (poisoned by the grader). Returns ``(O, LSE)``."""
    import torch

    from ...toolbox.cuda import compile_kernel
    from . import source_text

    text = source_text(source)
    if text not in _built:  # one NVRTC build per source, whatever the number of cases
        _built[text] = compile_kernel(cuda_cpu.with_mma_helpers(text), LOOP_KERNEL)
    _built[text](((Nq + 15) // 16,), (32,), Q, K, V, O, LSE, int(Nq), int(N), int(q_offset),
                 float(scale), int(causal))  # fmt: skip
    torch.cuda.synchronize()
    return O, LSE
