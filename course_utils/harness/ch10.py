"""Chapter 10 (tensor cores): the constants its exercise notebook imports, and the student-side
helpers that tabulate a student's map in one call instead of one call per element.

Nothing here knows an expected value: the grader (``course_utils.specs.ch10``) builds its own
tables and compares what comes back.
"""

from __future__ import annotations

import numpy as np

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

__all__ = ["CHUNK_ELEMENTS", "D_SMALL", "ELEMENT_BYTES", "K32_A_VALUES", "K32_K", "K32_M", "OPS",
           "SWIZZLE_ROWS", "map_table", "offset_table"]  # fmt: skip


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
