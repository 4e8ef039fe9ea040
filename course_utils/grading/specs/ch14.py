"""Chapter 14, Hopper: graded exercises.

- ``14.descriptors``: the ``wgmma`` matrix descriptors of operands the lecture does not build.
  An operand is described by a dict ``op``: a bf16 tile of ``rows x cols`` that TMA wrote at
  shared byte address ``base`` with the ``swizzle`` of 128, 64 or 32 bytes (``cols / W`` panels
  of ``rows x W``, ``W = swizzle / 2``; see ``course_utils.library.hopper``), the ``major``
  dimension ("K": the product's reduction dimension runs along the tile's rows, an operand row is a
  tile row; "MN": it runs down the tile, an operand row is a tile column), ``first`` (the first tile
  row, "K", or column, "MN", the operand starts at), ``mn`` (its M or N extent) and ``k_steps``
  (the wgmma chain: k-step ``s`` reads K elements ``16 s .. 16 s + 15``). The candidate
  ``descriptor(op, s) -> int`` returns the 64-bit word of k-step ``s``.

  The grading process decodes every word with the CPU model (``hopper.operand_addresses``),
  reads which tile element sits at each byte (``hopper.tile_addresses``, inverted) and compares
  with the element the k-step needs. A failure names the k-step, the first wrong (row, k) and the
  field it points at: the swizzle code first, then the region of the operand that only one field
  reaches (the first 8 rows, or 8 K elements: the start; the next groups: SBO; the next panels
  of an MN-major operand: LBO), with a dedicated hint when LBO and SBO are swapped (they read
  right once exchanged) or when the k-step advance is half the right one (elements, not bytes).
  Nothing here holds the right words: the expected bytes are where TMA put the elements.

  On an sm_90 GPU, words the model accepts then go into ``kernels/hopper_descriptor_probe.cu``:
  TMA copies the tile with the case's swizzle, one ``wgmma`` chain multiplies with the words,
  and the product is compared with torch's (the model itself checked on the hardware).
"""

from __future__ import annotations

import random
from functools import lru_cache

import numpy as np

from ... import paths, runtime
from ...library import hopper
from ..checks import CheckFailure, brief
from ..types import Exercise
from . import require_implemented

descriptors = Exercise(
    "14.descriptors", "wgmma matrix descriptors for V at d = 256, dS^T and the 64/32-byte swizzles",
    points=4,
)  # fmt: skip

SHARED_TOP = 1 << 18  # the start field's 14 bits of address / 16: shared addresses below 256 KiB
RESERVED = sum(1 << b for b in (*range(14, 16), *range(30, 32), *range(46, 49), *range(52, 62)))
BASE_OFFSET = 7 << 49

HINT_SWIZZLE = (
    "the swizzle mode (bits 62-63) must be the one TMA wrote the tile with: 1 for 128-byte rows, "
    "2 for 64-byte rows, 3 for 32-byte rows (0 is no swizzle at all). A tile with 64-byte rows "
    "read as 128-byte-swizzled XORs the wrong address bits."
)
HINT_START = (
    "the start address (bits 0-13, bytes / 16) must be where TMA put the first element this "
    "k-step reads, before the swizzle: the tile's base, plus the panel it lies in (panel p starts "
    "p x rows x row-bytes in), plus its row and byte offset inside that panel."
)
HINT_ADVANCE = (
    "k-step 0 reads the right bytes, but a later k-step starts in the wrong place: the per-k-step "
    "advance. Count it in bytes (2 per bf16; the descriptor holds bytes / 16), and mind when a "
    "k-step crosses into the next panel."
)
HINT_ELEMENTS = (
    "your k-step advance is exactly half of the right one: it counts elements, not bytes (a bf16 "
    "is 2 bytes; the descriptor's start field holds bytes / 16)."
)
HINT_SBO_K = (
    "SBO (bits 32-45) is the distance in bytes from one group of 8 rows to the next. The rows of "
    "a swizzled panel are as wide as the swizzle (128, 64 or 32 bytes), not always 128."
)
HINT_SBO_MN = (
    "SBO (bits 32-45) of an MN-major operand is the distance in bytes from one group of 8 K rows "
    "(tile rows) to the next: 8 rows of the swizzle's width."
)
HINT_LBO = (
    "LBO (bits 16-29) of an MN-major operand is the distance in bytes from one panel of columns "
    "to the next: a whole panel, its rows x the swizzle's row bytes (it depends on this tile's "
    "rows, not on the kernel's)."
)
HINT_SWAPPED = (
    "LBO and SBO are swapped: with the two exchanged every byte is right. For an MN-major operand "
    "LBO (bits 16-29) steps from panel to panel, SBO (bits 32-45) from one 8-row group to the next."
)


def _word(got, op, s, case):
    """The candidate's word for k-step ``s``, checked to be a 64-bit descriptor with no reserved
    bit set (a word is data from the student's side: nothing is read from it before this)."""
    if isinstance(got, bool) or not isinstance(got, (int, np.integer)):
        raise CheckFailure(case, f"descriptor(op, {s}) returned {brief(got)}: expected an int, the "
                           "64-bit descriptor word", None)
    got = int(got)
    if not 0 <= got < 1 << 64:
        raise CheckFailure(case, f"descriptor(op, {s}) returned {brief(got)}: not a 64-bit "
                           "unsigned word (0 <= word < 2**64)", None)
    if got & RESERVED:
        raise CheckFailure(case, f"descriptor(op, {s}) = {got:#018x} sets reserved bits "
                           f"({got & RESERVED:#x}): only bits 0-13, 16-29, 32-45, 49-51 and 62-63 "
                           "hold fields", None)
    if got & BASE_OFFSET:
        raise CheckFailure(case, f"descriptor(op, {s}) = {got:#018x} sets the base offset (bits "
                           "49-51): every tile here starts on a boundary of its swizzle pattern, "
                           "so it stays 0", None)
    return got


def _needed(op, tile, s):
    """(tile rows, tile cols) of the elements k-step ``s`` reads, shape (mn, 16) each."""
    i = op["first"] + np.arange(op["mn"])[:, None]
    k = 16 * s + np.arange(16)[None, :]
    if op["major"] == "K":
        return np.broadcast_to(i, (op["mn"], 16)), np.broadcast_to(k, (op["mn"], 16))
    return np.broadcast_to(k, (op["mn"], 16)), np.broadcast_to(i, (op["mn"], 16))


def _regions(op):
    """Masks over an operand's (mn, 16) elements, in the order a field first reaches them:
    ("start", ...), ("SBO", ...), and for an MN-major operand wider than a panel ("LBO", ...)."""
    i = np.arange(op["mn"])[:, None]
    k = np.arange(16)[None, :]
    shape = (op["mn"], 16)
    if op["major"] == "K":
        return [("start", np.broadcast_to(i < 8, shape)), ("SBO", np.broadcast_to(i >= 8, shape))]
    width = op["swizzle"] // 2
    return [("start", (i < width) & (k < 8)), ("SBO", (i < width) & (k >= 8)),
            ("LBO", np.broadcast_to(i >= width, shape))]


def _first_wrong(op, owner, where, word, s):
    """None when ``word`` reads every element k-step ``s`` needs; else (field, message)."""
    reads = hopper.operand_addresses(word, op["mn"], op["major"])
    rows, cols = _needed(op, where, s)
    want = where[rows, cols]
    if np.array_equal(reads, want):
        return None
    field, bad = next((name, np.argwhere(mask & (reads != want))) for name, mask in _regions(op)
                      if (mask & (reads != want)).any())
    i, k = (int(x) for x in bad[0])
    got = int(reads[i, k])
    at = owner.get(got)
    end = op["base"] + 2 * op["rows"] * op["cols"] - 1
    held = (f"tile element ({at[0]}, {at[1]})" if at else
            f"no element of the tile (it spans bytes {op['base']} .. {end})")
    message = (f"k-step {s}, operand element (row {i}, k {k}) should be tile element "
               f"({int(rows[i, k])}, {int(cols[i, k])}) at byte {int(want[i, k])}, but the "
               f"descriptor {word:#018x} reads byte {got}: {held}")
    return field, message


def _check_op(op, case, words):
    """Every k-step of ``words`` against where TMA put each element; the words the model
    accepts, or a CheckFailure naming the field."""
    where = hopper.tile_addresses(op["rows"], op["cols"], op["base"], op["swizzle"])
    owner = {int(a): (r, c) for (r, c), a in np.ndenumerate(where)}  # byte -> tile element
    unswizzled = hopper.unswizzled_addresses(op["rows"], op["cols"], op["base"], op["swizzle"])
    code = hopper.SWIZZLE_CODE[op["swizzle"]]
    starts = [hopper.decode_descriptor(w)["start"] for w in words]
    for s, word in enumerate(words):
        mode = word >> 62
        if mode != code:
            raise CheckFailure(case, f"k-step {s}: descriptor {word:#018x} has swizzle mode "
                               f"{mode}, but TMA wrote this tile with {op['swizzle']}-byte rows",
                               HINT_SWIZZLE)
    for s, word in enumerate(words):
        wrong = _first_wrong(op, owner, where, word, s)
        if wrong is None:
            continue
        field, message = wrong
        f = hopper.decode_descriptor(word)
        swapped = hopper.encode_descriptor(f["start"], f["sbo"], f["lbo"], f["swizzle"])
        if field != "start" and f["lbo"] != f["sbo"] and _first_wrong(
                op, owner, where, swapped, s) is None:
            hint = HINT_SWAPPED
        elif field == "start":
            hint = HINT_START
            rows, cols = _needed(op, where, s)
            need = int(unswizzled[rows[0, 0], cols[0, 0]])  # where k-step s's first element is
            if s > 0 and _first_wrong(op, owner, where, words[0], 0) is None:
                hint = HINT_ADVANCE
                if starts[s] != starts[0] and 2 * (starts[s] - starts[0]) == need - starts[0]:
                    hint = HINT_ELEMENTS
        elif field == "SBO":
            hint = HINT_SBO_K if op["major"] == "K" else HINT_SBO_MN
        else:
            hint = HINT_LBO
        raise CheckFailure(case, f"{field} is off: {message}", hint)
    return words


def _words(fn, op, case):
    words = []
    for s in range(op["k_steps"]):
        words.append(_word(fn(dict(op), s), op, s, case))
    return words


# ----------------------------------------------------------------------------- on an H100


PROBE = paths.KERNELS / "hopper_descriptor_probe.cu"


@lru_cache(maxsize=1)
def _probe_module():
    from ...toolbox import cuda

    return cuda.load_cuda(PROBE, ["hopper_descriptor_probe"], name="hopper_descriptor_probe",
                          arch="sm_90a")


def _on_hopper() -> bool:
    """The real chip is an sm_90 (not one COURSE_PRETEND_CAPABILITY makes it report)."""
    if not runtime.on_gpu():
        return False
    import torch

    return torch.cuda.get_device_capability()[0] == 9


def _gpu_product(op, words, case):
    """The words in a real wgmma chain (the grading process's GPU): TMA writes the tile with
    the case's swizzle, the chain multiplies, and the product must be torch's."""
    import torch

    gen = torch.Generator().manual_seed(op["base"] + op["rows"])
    X = torch.randn(op["rows"], op["cols"], generator=gen).bfloat16()
    K = 16 * op["k_steps"]
    if op["major"] == "K":
        operand = X[op["first"]:op["first"] + op["mn"], :K]  # (mn, K)
    else:
        operand = X[:K, op["first"]:op["first"] + op["mn"]].T  # (mn, K)
    other = torch.randn(64, K, generator=gen).bfloat16()  # P (B role) or the partner B (A role)
    if op["role"] == "B":
        expected = other.double() @ operand.double().T  # (64, mn)
    else:
        expected = operand.double() @ other.double().T  # (mn = 64, 64)
    word_tensor = torch.tensor([w - (1 << 64) if w >= 1 << 63 else w for w in words],
                               dtype=torch.int64)
    got = _probe_module().hopper_descriptor_probe(
        X.cuda(), other.cuda(), word_tensor.cuda(), op["role"] == "B", op["major"] == "MN",
        op["swizzle"], op["base"], op["mn"]).cpu().double()
    err = (got - expected).abs().max().item()
    if not err <= 1e-3 * max(1.0, expected.abs().max().item()):
        raise CheckFailure(case, f"on this GPU the wgmma chain with your words gives a product "
                           f"{err:.3g} away from torch's, although the CPU model reads the right "
                           "bytes: report it (the model and the hardware disagree)", None)


# ----------------------------------------------------------------------------- the cases


def _op(tile, product, role, major, rows, cols, swizzle, base, first, mn):
    k_steps = (cols if major == "K" else rows) // 16
    return {"tile": tile, "product": product, "role": role, "major": major, "rows": rows,
            "cols": cols, "swizzle": swizzle, "base": base, "first": first, "mn": mn,
            "k_steps": k_steps}


def _case(make):
    def run(fn):
        require_implemented(fn)
        op = make()
        case = (f"{op['tile']} ({op['product']}: {op['role']}, {op['major']}-major, "
                f"{op['swizzle']}-byte swizzle), tile {op['rows']} x {op['cols']} at byte "
                f"{op['base']}, rows/cols from {op['first']}")
        words = _check_op(op, case, _words(fn, op, case))
        if _on_hopper():
            _gpu_product(op, words, case)

    return run


def _fresh_base(align, size):
    """A random base on a pattern boundary, the tile ending below 200 KiB."""
    return random.randrange(0, (200 * 1024 - size) // align) * align


VISIBLE = [
    # O += P V at d = 256: B, N = 256 runs along V's rows of 128 bytes: 4 panels of 64 columns
    lambda: _op("V at d = 256", "O += P V", "B", "MN", 64, 256, 128, 16384, 0, 256),
    # dQ = dS K: A is dS, read from the dS^T tile (keys x queries), the second consumer's 64
    lambda: _op("dS^T, queries 64..127", "dQ = dS K", "A", "MN", 64, 128, 128, 49152, 64, 64),
    # S = Q K^T at d = 32: K's rows are 64 bytes, copied with the 64-byte swizzle
    lambda: _op("K at d = 32", "S = Q K^T", "B", "K", 128, 32, 64, 32768, 0, 128),
    # V at d = 64 with the 64-byte swizzle: two panels of 32 columns
    lambda: _op("V at d = 64", "O += P V", "B", "MN", 64, 64, 64, 8192, 0, 64),
    # Q at d = 32 with the 32-byte swizzle: two panels of 16 columns, one a k-step
    lambda: _op("Q at d = 32", "S = Q K^T", "A", "K", 64, 32, 32, 4096, 0, 64),
]

HIDDEN = [
    lambda: _op("V at d = 256", "O += P V", "B", "MN", 128, 256, 128, _fresh_base(1024, 65536),
                0, 256),
    lambda: _op("V at d = 256, columns 128..255", "O += P V", "B", "MN", 80, 256, 128,
                _fresh_base(1024, 40960), 128, 128),
    lambda: _op("dS^T, queries 64..127", "dQ = dS K", "A", "MN", 128, 128, 128,
                _fresh_base(1024, 32768), 64, 64),
    lambda: _op("dS^T, queries 0..63", "dQ = dS K", "A", "MN", 176, 64, 128,
                _fresh_base(1024, 22528), 0, 64),
    lambda: _op("K at d = 128", "S = Q K^T", "B", "K", 64, 128, 64, _fresh_base(512, 16384),
                0, 64),
    lambda: _op("Q at d = 64, rows 64..127", "S = Q K^T", "A", "K", 128, 64, 64,
                _fresh_base(512, 16384), 64, 64),
    lambda: _op("V at d = 128", "O += P V", "B", "MN", 48, 128, 64, _fresh_base(512, 12288),
                0, 128),
    lambda: _op("V at d = 64", "O += P V", "B", "MN", 32, 64, 32, _fresh_base(256, 4096),
                0, 64),
    lambda: _op("K at d = 64", "S = Q K^T", "B", "K", 128, 64, 32, _fresh_base(256, 16384),
                0, 128),
]

for _make in VISIBLE:
    _example = _make()
    descriptors.case(f"{_example['tile']}, {_example['swizzle']}-byte swizzle")(_case(_make))
for _n, _make in enumerate(HIDDEN):
    _example = _make()
    descriptors.case(f"hidden {_n}: {_example['tile']}, {_example['swizzle']}-byte swizzle",
                     hidden=True)(_case(_make))

# The consumer-loop exercise lives in its own module (a chapter-14 spec of its own size).
from .ch14_overlap import *  # noqa: E402, F403
