"""A CPU model of how Hopper's TMA writes a tile into shared memory and how ``wgmma`` reads it.

Chapter 14's kernel (``kernels/flash_attention_hopper.cu``) never moves a tile element with a
thread: TMA copies a box of global memory into shared memory, and ``wgmma`` reads its operands
straight from there through a 64-bit **matrix descriptor**. The two must agree on the layout,
and a mistake does not crash: the tensor cores just multiply the wrong numbers. This module
computes, byte by byte, both sides of that agreement, so the layout can be checked without a GPU.

**TMA with the 128-byte swizzle.** A box of ``rows x 64`` bf16 values (128 bytes a row) lands
row after row, and inside each group of 8 rows the 16-byte chunk ``c`` of row ``r`` is stored at
chunk ``c ^ (r % 8)``. In address bits: bits 4-6 of the byte offset (the chunk) are XORed with
bits 7-9 (the row within its group of 8), which is :func:`swizzle128`. The 8 rows that hold the
same chunk of 8 consecutive rows then sit in 8 different 16-byte bank groups: reading one chunk
from each of 8 rows has no bank conflict. A tile wider than 64 columns is copied as
``cols / 64`` boxes, one **panel** after the other.

**The matrix descriptor** (PTX ISA, "Matrix Descriptor Format" of the asynchronous warpgroup
matrix instructions): bits 0-13 the start address, 16-29 the *leading* byte offset (LBO), 32-45
the *stride* byte offset (SBO), each divided by 16; bits 49-51 a base offset (0 when every tile
starts on a boundary of its swizzle pattern, as here); bits 62-63 the swizzle mode: 0 none,
1 = 128 bytes, 2 = 64 bytes, 3 = 32 bytes (the PTX ISA's table; the same in CUTLASS's
``GmmaDescriptor`` and Mojo's ``WGMMADescriptor``). The other bits are reserved (0).

**The narrower swizzles.** TMA can also write rows of 64 or 32 bytes (a box of 32 or 16 bf16
columns: ``CU_TENSOR_MAP_SWIZZLE_64B`` / ``_32B``). The XOR then takes fewer bits: with the
64-byte swizzle, bits 4-5 of the offset XOR bits 7-8; with the 32-byte one, bit 4 XORs bit 7
(CUTLASS's ``Swizzle<2,4,3>`` and ``Swizzle<1,4,3>``; ``Swizzle<3,4,3>`` is the 128-byte one).
The pattern repeats every 8 rows, 8 x the row: 1024, 512 or 256 bytes, which is where a tile
must start. A tile wider than one row is copied as panels of ``rows x (row bytes / 2)``
columns, one after the other, as for the 128-byte swizzle. :func:`swizzle` and
:func:`tile_addresses` take the row width ``swizzle=128, 64 or 32``.

What LBO and SBO mean depends on which dimension of the operand runs along the rows (CUTLASS,
``make_gmma_desc``'s canonical layouts, for 16-bit types, ``row`` the swizzle's bytes):

* **K-major** (the reduction dimension K is contiguous; e.g. Q and K in ``S = Q K^T``): element
  ``(mn, k)`` of the 64 x 16 or N x 16 operand is at ``start + (mn % 8) * row + (mn // 8) * SBO +
  2 k`` before the swizzle. SBO is the distance between groups of 8 rows. LBO is ignored: under
  the 128-byte swizzle (and the narrower ones) a k-step's 16 elements never leave one swizzled
  row, and the PTX ISA's table of descriptor strides has the leading byte offset "not used" for
  swizzled K-major layouts. Any value that encodes will do (16 is customary).
* **MN-major** (M or N contiguous; e.g. V in ``O = P V``, whose rows are keys, the K dimension):
  element ``(mn, k)`` is at ``start + 2 (mn % W) + (mn // W) * LBO + (k % 8) * row + (k // 8) *
  SBO``, ``W = row / 2`` elements a row: LBO jumps from one panel of W columns to the next, SBO
  from one group of 8 rows to the next.

The swizzle is applied to the final address, which is why tiles start on a pattern boundary.
"""

from __future__ import annotations

import numpy as np

ELEMENT_BYTES = 2  # bf16 / fp16
ROW_BYTES = 128  # one row of a 128-byte-swizzled panel: 64 bf16
PANEL_COLS = ROW_BYTES // ELEMENT_BYTES
ATOM_BYTES = 8 * ROW_BYTES  # 8 rows: the unit the swizzle repeats over
SWIZZLE_128B = 1  # the descriptor's code for the 128-byte swizzle
# The descriptor's swizzle codes by row width in bytes (PTX ISA, "Matrix Descriptor Format",
# bits 62-63; also CUTLASS's GMMA::LayoutType and Mojo's WGMMADescriptor docs)
SWIZZLE_CODE = {128: 1, 64: 2, 32: 3}
SWIZZLE_BYTES = {code: row for row, code in SWIZZLE_CODE.items()}

__all__ = [
    "ATOM_BYTES",
    "PANEL_COLS",
    "decode_descriptor",
    "descriptor_plus",
    "encode_descriptor",
    "operand_addresses",
    "SCHEDULES",
    "schedule",
    "SWIZZLE_CODE",
    "swizzle",
    "swizzle128",
    "tile_addresses",
    "unswizzled_addresses",
]


def swizzle128(offset):
    """The 128-byte swizzle of a byte offset: bits 4-6 XOR bits 7-9 (numpy arrays welcome)."""
    offset = np.asarray(offset, dtype=np.int64)
    return offset ^ (((offset >> 7) & 7) << 4)


def swizzle(offset, row: int = ROW_BYTES):
    """The swizzle of rows of ``row`` = 128, 64 or 32 bytes: the 16-byte chunk bits (4-6, 4-5
    or 4) XOR the bits just above a row of the 8-row pattern (7-9, 7-8 or 7)."""
    if row not in SWIZZLE_CODE:
        raise ValueError(f"row={row}: TMA's swizzles have rows of 128, 64 or 32 bytes")
    mask = row // 16 - 1  # 7, 3 or 1: the chunk bits the XOR touches
    offset = np.asarray(offset, dtype=np.int64)
    return offset ^ (((offset >> 7) & mask) << 4)


_xor = swizzle  # tile_addresses' argument `swizzle` hides the function's name


def unswizzled_addresses(rows: int, cols: int, base: int = 0, row: int = ROW_BYTES) -> np.ndarray:
    """Where TMA puts element (r, c) of a tile before the swizzle (the address a descriptor's
    fields compute): panels of ``row / 2`` columns, each ``rows x row`` bytes."""
    if row not in SWIZZLE_CODE:
        raise ValueError(f"swizzle={row}: TMA's swizzles have rows of 128, 64 or 32 bytes")
    width = row // ELEMENT_BYTES
    if base % (8 * row):
        raise ValueError(f"base={base}: a swizzled tile must start on a multiple of {8 * row} "
                         "bytes, or the XOR pattern shifts against the rows")
    if cols % width or rows % 8:
        raise ValueError(f"a {rows} x {cols} tile: rows must be a multiple of 8 and cols of "
                         f"{width} (one {row}-byte row of bf16 per panel row)")
    r = np.arange(rows)[:, None]
    c = np.arange(cols)[None, :]
    panel, inner = c // width, c % width
    return base + panel * rows * row + r * row + inner * ELEMENT_BYTES


def tile_addresses(rows: int, cols: int, base: int = 0, swizzle: int = ROW_BYTES) -> np.ndarray:
    """Byte address of every element of a ``rows x cols`` bf16 tile that TMA wrote, swizzled.

    The tile is ``cols / W`` panels of ``rows x W`` (what one TMA box of W columns delivers,
    ``W = swizzle / 2``: 64 columns for the 128-byte swizzle, 32 for 64, 16 for 32), panel
    after panel from ``base``, which must be a multiple of ``8 * swizzle`` (1024 for 128
    bytes). Returns an int64 array of shape ``(rows, cols)``.
    """
    return _xor(unswizzled_addresses(rows, cols, base, swizzle), swizzle)


def encode_descriptor(start: int, lbo: int, sbo: int, swizzle: int = SWIZZLE_128B) -> int:
    """The 64-bit wgmma matrix descriptor of a tile at shared-memory byte address ``start``."""
    for name, value in (("start", start), ("lbo", lbo), ("sbo", sbo)):
        if value % 16 or not 0 <= value >> 4 < 1 << 14:
            raise ValueError(f"{name}={value}: must be a multiple of 16 below {16 << 14} bytes "
                             "(the descriptor stores it divided by 16 in 14 bits)")
    return (start >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (swizzle << 62)


def descriptor_plus(desc: int, elems: int) -> int:
    """The descriptor ``elems`` bf16 elements past ``desc``'s start, as the kernels' ``desc_plus``
    builds it: ``elems * 2 / 16`` added to the low 32 bits. That equals
    ``encode_descriptor(start + 2 * elems, ...)`` while the new start stays below 2^18 bytes (its
    14-bit field); past that the start wraps and the carry lands in the bits above it."""
    lo = ((desc & 0xFFFFFFFF) + elems * 2 // 16) & 0xFFFFFFFF
    return (desc & ~0xFFFFFFFF) | lo


def decode_descriptor(desc: int) -> dict:
    """The fields of a descriptor, in bytes: ``start``, ``lbo``, ``sbo``, ``swizzle``."""
    field = lambda shift: (desc >> shift) & 0x3FFF  # noqa: E731
    return {"start": field(0) << 4, "lbo": field(16) << 4, "sbo": field(32) << 4,
            "swizzle": (desc >> 62) & 3}


def operand_addresses(desc: int, mn: int, major: str, k: int = 16) -> np.ndarray:
    """The byte addresses one ``wgmma`` reads for its ``mn x k`` operand, element ``(i, kk)``.

    ``major="K"``: the operand's K dimension runs along the rows (A of ``S = Q K^T`` is Q, B is
    K: both store d contiguously). ``major="MN"``: M or N runs along them (B of ``O = P V`` is V,
    whose rows are keys, the K dimension of that product). The swizzles of 128, 64 and 32 bytes
    (modes 1, 2, 3) are modelled, not mode 0 (no swizzle: another layout of 8 x 16-byte core
    matrices) nor a nonzero base offset (bits 49-51).
    """
    f = decode_descriptor(desc)
    if f["swizzle"] not in SWIZZLE_BYTES:
        raise ValueError(f"swizzle mode {f['swizzle']} (no swizzle) is not modelled: only the "
                         "128-, 64- and 32-byte swizzles (modes 1, 2, 3)")
    row = SWIZZLE_BYTES[f["swizzle"]]
    width = row // ELEMENT_BYTES
    i = np.arange(mn)[:, None]
    kk = np.arange(k)[None, :]
    if major == "K":
        plain = f["start"] + (i % 8) * row + (i // 8) * f["sbo"] + kk * ELEMENT_BYTES
    elif major == "MN":
        plain = (f["start"] + (i % width) * ELEMENT_BYTES + (i // width) * f["lbo"]
                 + (kk % 8) * row + (kk // 8) * f["sbo"])
    else:
        raise ValueError(f'major must be "K" or "MN", got {major!r}')
    return swizzle(plain, row)


# ---------------------------------------------------------------------------------------------
# A timing model of the consumer loop: who waits for whom on the tensor cores and the exp units
# ---------------------------------------------------------------------------------------------

SCHEDULES = ("one warpgroup", "two warpgroups", "ping-pong", "ping-pong + overlap")


def schedule(kind: str, n_blocks: int, t_gemm: float, t_softmax: float) -> dict:
    """Simulate the key-block loop of one thread block; return what ran where, and when.

    Each key block j takes two matrix products per consumer warpgroup, ``S = Q K_j^T`` ("S") and
    ``O += P V_j`` ("PV"), each ``t_gemm`` long on the SM's tensor cores, and one softmax
    ("softmax", ``t_softmax``) on the exp units and ALUs. The tensor cores run one product at a
    time, in the order they were issued; the exp units one softmax at a time. ``kind``:

    * ``"one warpgroup"``: S, softmax, PV, one after the other, one consumer;
    * ``"two warpgroups"``: two consumers, each as above, in lockstep: both wait for the same K
      and V tiles, so they issue their products together and the tensor cores interleave them
      (each takes twice as long), then both run their softmax at the same time, sharing the exp
      units, while the tensor cores have nothing to do;
    * ``"ping-pong"``: the two take turns on the tensor cores (0, 1, 0, 1, ...: a named barrier
      in the kernel), so that one's softmax runs while the other's products run; each product is
      a turn of its own, two turns a key block, as in variant 1 of the kernel (a turn costs
      nothing here; on an H100 that variant is slower than none);
    * ``"ping-pong + overlap"``: and inside each consumer, S(j) and PV(j - 1) are issued together,
      in one turn, before the softmax of S(j): PV(j - 1) runs under that softmax. One turn a key
      block, as variant 3 and FlashAttention-3 take theirs.

    A consumer issues a *turn* (one or two products), waits for what its next turn needs (its
    S for the softmax, and without overlap its PV too), and issues the next.

    Returns ``{"ops": [(warpgroup, name, j, unit, start, end), ...], "time": the total,
    "tensor_busy": the fraction of that time the tensor cores work}``.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"kind must be one of {SCHEDULES}, got {kind!r}")
    if n_blocks < 1 or t_gemm <= 0 or t_softmax < 0:
        raise ValueError("need n_blocks >= 1, t_gemm > 0 and t_softmax >= 0")
    groups = 1 if kind == "one warpgroup" else 2
    overlap, alternate = kind == "ping-pong + overlap", kind.startswith("ping-pong")
    if overlap:  # (products issued together, the softmax that follows them)
        turns = [([("S", 0)], 0)]
        turns += [([("S", j), ("PV", j - 1)], j) for j in range(1, n_blocks)]
        turns += [([("PV", n_blocks - 1)], None)]
    else:
        turns = [t for j in range(n_blocks) for t in (([("S", j)], j), ([("PV", j)], None))]

    free = {"tensor": 0.0, "exp": 0.0}
    ops, ends = [], {}

    def run(w, name, j, unit, ready, length):
        start = max(ready, free[unit])
        free[unit] = start + length
        ends[(w, name, j)] = start + length
        ops.append((w, name, j, unit, start, start + length))
        return start + length

    if not alternate:  # lockstep: every unit is shared by all consumers at once
        ready = 0.0
        for products, softmax_of in turns:
            start = max(ready, free["tensor"])
            for name, j in products:
                end = start + groups * t_gemm
                for w in range(groups):
                    ops.append((w, name, j, "tensor", start, end))
                    ends[(w, name, j)] = end
                start = free["tensor"] = end
            ready = start
            if softmax_of is not None:
                begin = max(ends[(0, "S", softmax_of)], free["exp"])
                ready = free["exp"] = begin + groups * t_softmax
                ops.extend((w, "softmax", softmax_of, "exp", begin, ready) for w in range(groups))
    else:  # ping-pong: the consumers issue their turns strictly one after the other
        position, ready, last_issue = [0] * groups, [0.0] * groups, 0.0
        for k in range(groups * len(turns)):
            w = k % groups
            issue = max(ready[w], last_issue)
            products, softmax_of = turns[position[w]]
            after = max(run(w, name, j, "tensor", issue, t_gemm) for name, j in products)
            if softmax_of is not None:
                after = max(after, run(w, "softmax", softmax_of, "exp",
                                       ends[(w, "S", softmax_of)], t_softmax))
            ready[w], last_issue = after, issue
            position[w] += 1
    busy_until = sorted({(op[4], op[5]) for op in ops if op[3] == "tensor"})
    total = max(op[5] for op in ops)
    busy = sum(end - start for start, end in busy_until)  # shared intervals counted once
    return {"ops": ops, "time": total, "tensor_busy": busy / total}


# ---------------------------------------------------------------------------------------------
# Register fragments of wgmma (m64nNk16, bf16 inputs, float32 accumulator), for the backward
# ---------------------------------------------------------------------------------------------
# The forward's probes (probe_ss, probe_rs in kernels/flash_attention_hopper.cu) check these two
# layouts on an H100; the backward (kernels/flash_attention_hopper_bwd.cu) builds on them: it
# packs its S^T and dS^T accumulators into A fragments, stores dS^T from them into shared
# memory and adds its dQ accumulator into global memory, all by these formulas.


def accumulator_rows_cols(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each float32 accumulator register of an ``m64nNk16`` wgmma lives in the 64 x n tile.

    Returns ``(rows, cols)``, int arrays of shape ``(128, n // 2)``: thread ``tid`` of the
    warpgroup (warp ``tid // 32``, ``g = lane // 4``, ``t = lane % 4``) holds in register ``i``
    the element ``(16 warp + g + 8 ((i % 4) // 2), 8 (i // 4) + 2 t + i % 2)``.
    """
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"n={n}: wgmma's N is a multiple of 8 from 8 to 256")
    tid = np.arange(128)[:, None]
    i = np.arange(n // 2)[None, :]
    warp, g, t = tid // 32, (tid % 32) // 4, tid % 4
    rows = 16 * warp + g + 8 * ((i % 4) // 2)
    cols = 8 * (i // 4) + 2 * t + i % 2
    return np.broadcast_to(rows, (128, n // 2)).copy(), np.broadcast_to(cols, (128, n // 2)).copy()


def a_fragment_rows_cols() -> tuple[np.ndarray, np.ndarray]:
    """Where the A operand of an ``m64nNk16`` wgmma taken from registers comes from.

    Returns ``(rows, cols)`` of shape ``(128, 4, 2)``: thread ``tid``'s 32-bit register ``r``
    (of 4) holds two bf16, its lower half element ``(rows[tid, r, 0], cols[tid, r, 0])`` of the
    64 x 16 A tile and its upper half ``(rows[tid, r, 1], cols[tid, r, 1])``: registers 0 and 2
    are row ``16 warp + g``, 1 and 3 row ``16 warp + g + 8``; 0 and 1 columns ``2t, 2t + 1``,
    2 and 3 columns ``2t + 8, 2t + 9``.
    """
    return _a_fragment(2)


def _a_fragment(per_register: int) -> tuple[np.ndarray, np.ndarray]:
    """The A fragment of one k-step with ``per_register`` elements a 32-bit register (2 bf16, 4
    e4m3): registers 0 and 2 row ``16 warp + g``, 1 and 3 row ``16 warp + g + 8``; register r,
    element e column ``per_register t + 4 per_register (r // 2) + e`` (the k-step is
    8 per_register columns wide)."""
    e = per_register
    tid = np.arange(128)[:, None, None]
    r = np.arange(4)[None, :, None]
    b = np.arange(e)[None, None, :]
    warp, g, t = tid // 32, (tid % 32) // 4, tid % 4
    rows = 16 * warp + g + 8 * (r % 2)
    cols = e * t + 4 * e * (r // 2) + b
    return np.broadcast_to(rows, (128, 4, e)).copy(), np.broadcast_to(cols, (128, 4, e)).copy()


def a_fragment_rows_cols_e4m3() -> tuple[np.ndarray, np.ndarray]:
    """Where the A operand of an ``m64nNk32`` wgmma on e4m3 taken from registers comes from.

    Returns ``(rows, cols)`` of shape ``(128, 4, 4)``: thread ``tid``'s 32-bit register ``r``
    (of 4) holds four e4m3, byte ``b`` (0 the lowest) element ``(rows[tid, r, b],
    cols[tid, r, b])`` of the 64 x 32 A tile: registers 0 and 2 are row ``16 warp + g``, 1 and 3
    row ``16 warp + g + 8``; 0 and 1 columns ``4t .. 4t + 3``, 2 and 3 columns ``16 + 4t ..``.
    Against the bf16 fragment (:func:`a_fragment_rows_cols`) a register covers 4 consecutive
    columns, not 2: the accumulator of S (:func:`accumulator_rows_cols`) has them in another
    order, which the FP8 kernel absorbs into V^T's order of the keys (``key_order``).
    """
    return _a_fragment(4)


__all__ += ["a_fragment_rows_cols", "a_fragment_rows_cols_e4m3", "accumulator_rows_cols"]
