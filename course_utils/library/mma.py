"""A CPU model of the warp-level tensor-core instruction ``mma.sync.aligned.m16n8k16`` and of
``ldmatrix``: which lane of a warp holds which matrix element, and what the instruction computes.

On a GPU, ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 d, a, b, c`` is executed by all
32 lanes of a warp together: D (16 x 8) = A (16 x 16) @ B (16 x 8) + C (16 x 8). No lane holds a
whole row or column; each holds a few elements in its registers (its *fragment*):

* A: 8 bf16 values per lane (4 32-bit registers of 2 values each), ``a[lane, i]``, i < 8
* B: 4 bf16 values per lane (2 registers),                          ``b[lane, i]``, i < 4
* C and D: 4 fp32 values per lane (4 registers),                     ``c[lane, i]``, i < 4

Which element ``(row, col)`` the value ``i`` of ``lane`` is, with ``g = lane // 4`` (the lane's
*group*, 0..7) and ``t = lane % 4`` (its place in the group)::

    A: row g      for i in {0, 1, 4, 5}, g + 8 otherwise;  col 2t + i % 2, plus 8 for i >= 4
    B: row 2t + i % 2, plus 8 for i >= 2;                  col g
    C: row g      for i in {0, 1},       g + 8 otherwise;  col 2t + i % 2

(the table of the PTX ISA, section "Matrix Fragments for mma.m16n8k16"). So a row of C lives in
the 4 lanes of one group, which is why a row max in FlashAttention takes two shuffles.

``ldmatrix.sync.aligned.m8n8.x4.shared.b16`` loads four 8 x 8 matrices of 16-bit values from
shared memory: lanes 8j .. 8j+7 give the addresses of the 8 rows of matrix j, and lane ``l``
receives, in register j, the two elements of row ``l // 4``, columns ``2 (l % 4)`` and ``+1``
of matrix j. With ``.trans`` it receives the same positions of the transposed matrix.

Everything here works on numpy arrays (float32 for values; bf16 rounding is modelled by
``to_bf16``), so the layouts, the exercises built on them and their checks run without a GPU.
"""

from __future__ import annotations

import numpy as np

M, N, K = 16, 8, 16  # the shape of one mma.sync.m16n8k16
LANES = 32
A_VALUES, B_VALUES, C_VALUES = 8, 4, 4  # values per lane in each fragment


def _check_lane(lane: int, i: int, count: int, what: str) -> None:
    if not (isinstance(lane, int | np.integer) and 0 <= lane < LANES):
        raise ValueError(f"{what}: lane must be an int in 0..31, got {lane!r}")
    if not (isinstance(i, int | np.integer) and 0 <= i < count):
        raise ValueError(f"{what}: value index i must be an int in 0..{count - 1}, got {i!r}")


def a_element(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of A (16 x 16) that value ``i`` (0..7) of ``lane`` holds."""
    _check_lane(lane, i, A_VALUES, "a_element")
    g, t = lane // 4, lane % 4
    row = g if i in (0, 1, 4, 5) else g + 8
    col = 2 * t + i % 2 + (8 if i >= 4 else 0)
    return row, col


def b_element(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of B (16 x 8, k x n) that value ``i`` (0..3) of ``lane`` holds."""
    _check_lane(lane, i, B_VALUES, "b_element")
    g, t = lane // 4, lane % 4
    return 2 * t + i % 2 + (8 if i >= 2 else 0), g


def c_element(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of C or D (16 x 8) that value ``i`` (0..3) of ``lane`` holds."""
    _check_lane(lane, i, C_VALUES, "c_element")
    g, t = lane // 4, lane % 4
    return (g if i < 2 else g + 8), 2 * t + i % 2


_ELEMENT = {"A": (a_element, A_VALUES, (M, K)), "B": (b_element, B_VALUES, (K, N)),
            "C": (c_element, C_VALUES, (M, N))}


def _layout(which: str):
    if which not in _ELEMENT:
        raise ValueError(f"which must be 'A', 'B' or 'C', got {which!r}")
    return _ELEMENT[which]


def _as_matrix(X, shape, name: str) -> np.ndarray:
    X = np.asarray(X, dtype=np.float32)
    if X.shape != shape:
        raise ValueError(f"{name} must be {shape[0]} x {shape[1]}, got shape {X.shape}")
    return X


def fragments(X, which: str) -> np.ndarray:
    """Distribute matrix X over the warp: an array (32, values per lane) for A, B or C."""
    element, count, shape = _layout(which)
    X = _as_matrix(X, shape, which)
    frag = np.empty((LANES, count), dtype=np.float32)
    for lane in range(LANES):
        for i in range(count):
            frag[lane, i] = X[element(lane, i)]
    return frag


def gather(frag, which: str) -> np.ndarray:
    """The inverse of ``fragments``: put each lane's values back into the matrix."""
    element, count, shape = _layout(which)
    frag = np.asarray(frag, dtype=np.float32)
    if frag.shape != (LANES, count):
        raise ValueError(f"{which} fragments must have shape (32, {count}), got {frag.shape}")
    X = np.full(shape, np.nan, dtype=np.float32)
    for lane in range(LANES):
        for i in range(count):
            X[element(lane, i)] = frag[lane, i]
    return X


def to_bf16(x) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even), returned as float32."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    out = rounded.astype(np.uint32).view(np.float32)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, np.float32(np.nan), out)


def mma_m16n8k16(a_frag, b_frag, c_frag) -> np.ndarray:
    """What one ``mma.sync.m16n8k16`` (bf16 inputs, fp32 accumulators) leaves in each lane.

    a_frag (32, 8), b_frag (32, 4), c_frag (32, 4): each lane's registers, as ``fragments``
    lays them out. The inputs are rounded to bf16 first, the products are summed in float32.
    Returns d_frag (32, 4).
    """
    A = to_bf16(gather(a_frag, "A"))
    B = to_bf16(gather(b_frag, "B"))
    C = gather(c_frag, "C")
    D = (A.astype(np.float64) @ B.astype(np.float64)).astype(np.float32) + C
    return fragments(D, "C")


def ldmatrix_x4(matrices, trans: bool = False) -> np.ndarray:
    """What ``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16`` leaves in each lane.

    matrices: four 8 x 8 arrays (the rows that lanes 8j .. 8j+7 point at form matrix j).
    Returns (32, 4, 2): register j of lane l holds two consecutive values of matrix j, from row
    l // 4, columns 2 (l % 4) and 2 (l % 4) + 1; with ``trans=True`` of the transposed matrix.
    """
    mats = [np.asarray(m, dtype=np.float32) for m in matrices]
    if len(mats) != 4 or any(m.shape != (8, 8) for m in mats):
        raise ValueError("ldmatrix_x4 takes four 8 x 8 matrices")
    out = np.empty((LANES, 4, 2), dtype=np.float32)
    for lane in range(LANES):
        r, c = lane // 4, 2 * (lane % 4)
        for j, m in enumerate(mats):
            src = m.T if trans else m
            out[lane, j] = src[r, c], src[r, c + 1]
    return out


def quad_allreduce(values, op=np.maximum) -> np.ndarray:
    """Two butterfly shuffles (``__shfl_xor_sync`` with 1, then 2) over each group of 4 lanes.

    values: (32,) one value per lane. Returns (32,): every lane of a group gets ``op`` over the
    group's 4 values, which is how a row max or row sum of a C fragment is formed.
    """
    v = np.asarray(values, dtype=np.float32)
    if v.shape != (LANES,):
        raise ValueError(f"quad_allreduce takes one value per lane, shape (32,), got {v.shape}")
    lanes = np.arange(LANES)
    for mask in (1, 2):
        v = op(v, v[lanes ^ mask])
    return v


def c_to_a(c_left, c_right) -> np.ndarray:
    """Reuse two C fragments (columns 0-7 and 8-15 of a 16 x 16 result) as one A fragment.

    Lane by lane, no data moves between lanes: a lane's C values of the left tile are A values
    0-3 and those of the right tile are A values 4-7. This is why FlashAttention can feed P
    (computed as S = Q K^T in C fragments) straight into O += P V as the A operand.
    """
    left, right = (np.asarray(x, dtype=np.float32) for x in (c_left, c_right))
    for name, x in (("c_left", left), ("c_right", right)):
        if x.shape != (LANES, C_VALUES):
            raise ValueError(f"{name} must have shape (32, 4), got {x.shape}")
    return np.concatenate([left, right], axis=1)


def lane_map(which: str) -> str:
    """A text picture of the matrix with, in each cell, the lane that holds it and the index.

    ``print(mma.lane_map("C"))`` shows rows 0..15 and columns 0..7 of C, each cell ``lane:i``.
    """
    element, count, shape = _layout(which)
    owner = [[""] * shape[1] for _ in range(shape[0])]
    for lane in range(LANES):
        for i in range(count):
            r, c = element(lane, i)
            owner[r][c] = f"{lane}:{i}"
    width = max(len(s) for row in owner for s in row)
    header = "     " + " ".join(f"{c:>{width}}" for c in range(shape[1]))
    lines = [f"{which} ({shape[0]} x {shape[1]}), each cell lane:value", header]
    lines += [f"{r:>3}  " + " ".join(f"{s:>{width}}" for s in row) for r, row in enumerate(owner)]
    return "\n".join(lines)


def shared_wavefronts(byte_addresses, width: int = 16) -> int:
    """Passes shared memory needs to serve one phase of accesses (bank conflicts included).

    byte_addresses: where each access of the phase starts (an ldmatrix phase is 8 rows of 16
    bytes); width: bytes per access. Shared memory has 32 banks of 4 bytes; a pass serves one
    4-byte word per bank, so the count is the largest number of *distinct* words any bank must
    deliver. 1 means conflict-free.
    """
    if width % 4 or width <= 0:
        raise ValueError(f"width must be a positive multiple of 4 bytes, got {width}")
    words_of_bank: dict[int, set[int]] = {}
    for address in byte_addresses:
        if address % width:
            raise ValueError(f"address {address} is not aligned to the access width {width}")
        for word in range(address // 4, (address + width) // 4):
            words_of_bank.setdefault(word % 32, set()).add(word)
    return max((len(w) for w in words_of_bank.values()), default=0)


def swizzled_offset(row: int, col: int, row_elements: int, element_bytes: int = 2) -> int:
    """Byte offset of element (row, col) of a shared tile whose 16-byte chunks are swizzled:
    chunk c of row r is stored at chunk c XOR (r mod 8). Rows must hold at least 8 chunks."""
    per_chunk = 16 // element_bytes
    if row_elements % per_chunk or row_elements // per_chunk < 8:
        raise ValueError(f"a swizzled row needs a multiple of 8 chunks of 16 bytes, got "
                         f"{row_elements} elements of {element_bytes} bytes")
    chunk = (col // per_chunk) ^ (row % 8)
    return (row * row_elements + chunk * per_chunk + col % per_chunk) * element_bytes


def _tile_rows(X, start: int, count: int) -> np.ndarray:
    """Rows start .. start+count-1 of X, zero rows past its end (a ragged last tile)."""
    part = X[start:start + count]
    return np.concatenate([part, np.zeros((count - len(part),) + X.shape[1:], X.dtype)])


def warp_attention_backward_kv(Q, K, V, dO, lse, delta, *, scale=None, Bq: int = 16,
                               causal: bool = False, k0: int = 0):
    """One warp's share of the FlashAttention-2 backward on the CPU model: dK and dV for 16 keys.

    K, V (16, d) are keys k0 .. k0+15; Q, dO (Nq, d); lse (Nq,) the forward's natural-log LSE;
    delta (Nq,) = rowsum(dO * O). The warp walks over the queries Bq at a time and, with the keys
    as the rows of every product, keeps everything in the layouts mma.sync gives it:

    1. S^T = K Q^T (16 keys x Bq): A = K's fragment, B = Q's rows (as ldmatrix gives them);
    2. P^T = exp(S^T - LSE of each column's query), masked (a query sees key c when c <= q);
    3. dV += P^T dO: P^T's C fragments are the A fragment, dO's rows with .trans are B;
    4. dP^T = V dO^T: A = V's fragment, B = dO's rows; dS^T = P^T * (dP^T - delta);
    5. dK += dS^T Q * scale: dS^T's C fragments are the A fragment, Q's rows with .trans are B.

    Returns (dK (16, d), dV (16, d)) float32. dQ needs dS with the queries as rows: chapter 10
    computes it in a second pass (or with atomics), as chapter 08 does.
    """
    Q, K, V, dO = (np.asarray(x, dtype=np.float32) for x in (Q, K, V, dO))
    lse, delta = (np.asarray(x, dtype=np.float32) for x in (lse, delta))
    d = K.shape[1]
    if K.shape != (16, d) or V.shape != (16, d) or d % 16:
        raise ValueError(f"K and V must be 16 x d, d a multiple of 16, got {K.shape}, {V.shape}")
    if Q.ndim != 2 or Q.shape[1] != d or dO.shape != Q.shape:
        raise ValueError(f"Q and dO must be Nq x {d}, one shape, got {Q.shape}, {dO.shape}")
    if lse.shape != (Q.shape[0],) or delta.shape != (Q.shape[0],):
        raise ValueError(f"lse and delta must have shape ({Q.shape[0]},)")
    if Bq <= 0 or Bq % 16:
        raise ValueError(f"Bq must be a positive multiple of 16, got {Bq}")
    Nq = Q.shape[0]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    lanes = np.arange(LANES)
    key_of = k0 + np.stack([lanes // 4, lanes // 4, lanes // 4 + 8, lanes // 4 + 8], axis=1)
    k_frag = [fragments(K[:, c:c + 16], "A") for c in range(0, d, 16)]
    v_frag = [fragments(V[:, c:c + 16], "A") for c in range(0, d, 16)]
    dk = [np.zeros((LANES, C_VALUES), np.float32) for _ in range(d // 8)]
    dv = [np.zeros((LANES, C_VALUES), np.float32) for _ in range(d // 8)]
    zero = np.zeros((LANES, C_VALUES), np.float32)
    for q0 in range(0, Nq, Bq):
        n = min(Bq, Nq - q0)
        q_t, do_t, lse_t, delta_t = (_tile_rows(X, q0, Bq) for X in (Q, dO, lse, delta))
        pT, dsT = [], []
        for nt in range(Bq // 8):                      # 8 queries = the columns of one n-tile
            s = zero
            dp = zero
            for kc, c in enumerate(range(0, d, 16)):   # 1. and 4.: queries' rows as B
                cols = slice(c, c + 16)
                s = mma_m16n8k16(k_frag[kc], fragments(q_t[nt * 8:nt * 8 + 8, cols].T, "B"), s)
                dp = mma_m16n8k16(v_frag[kc], fragments(do_t[nt * 8:nt * 8 + 8, cols].T, "B"), dp)
            col = nt * 8 + 2 * (lanes % 4)[:, None] + np.array([0, 1, 0, 1])  # query in the tile
            query = q0 + col
            visible = (col < n) & ((key_of <= query) if causal else True)
            lse_c = np.where(col < n, lse_t[np.minimum(col, Bq - 1)], 0.0)
            p = np.where(visible, np.exp(s * np.float32(scale) - lse_c), 0.0).astype(np.float32)
            pT.append(p)                               # 2.
            dsT.append(p * (dp - delta_t[np.minimum(col, Bq - 1)]))
        for kc in range(Bq // 16):                     # 3. and 5.: 16 queries at a time
            p_a = to_bf16(c_to_a(pT[2 * kc], pT[2 * kc + 1]))
            ds_a = to_bf16(c_to_a(dsT[2 * kc], dsT[2 * kc + 1]))
            for nd in range(d // 8):
                rows = slice(kc * 16, kc * 16 + 16)
                dv[nd] = mma_m16n8k16(p_a, fragments(do_t[rows, nd * 8:nd * 8 + 8], "B"), dv[nd])
                dk[nd] = mma_m16n8k16(ds_a, fragments(q_t[rows, nd * 8:nd * 8 + 8], "B"), dk[nd])
    dK = np.concatenate([gather(x, "C") for x in dk], axis=1) * np.float32(scale)
    dV = np.concatenate([gather(x, "C") for x in dv], axis=1)
    return dK.astype(np.float32), dV.astype(np.float32)
