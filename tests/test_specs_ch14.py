"""Chapter 14's graded cases catch the mistakes of wgmma matrix descriptors, naming the field.

The right answer is the solution notebook's own cell (written to a module); each named slip
(``NAMED_MISTAKES``) is that code with one edit and must fail a *visible* case whose hint names
the field. The byte model the grader decodes with (``course_utils.library.hopper``) is checked here
on its own too: the 64- and 32-byte swizzles keep 16-byte chunks whole, spread a column of chunks
over the banks, and the descriptors of the lecture's kernel still read what it needs.
"""

import tempfile
from pathlib import Path

import numpy as np
import pytest
from spec_helpers import Slip, module_builder, solution_source

from course_utils import cuda as C
from course_utils import grader, hopper
from course_utils.grading.checks import CheckFailure
from course_utils.grading.specs import ch14

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)

SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "14_hopper_flash_attention.ipynb"
_build = module_builder(
    Path(tempfile.mkdtemp(prefix="ch14_")),
    solution_source(SOLUTION, lambda s: "def descriptor(" in s),
    "ch14",
)
_modules = {}


def descriptor(*edits):
    """The solution's ``descriptor`` with ``(old, new)`` edits (each must match)."""
    if edits not in _modules:
        _modules[edits] = _build(*edits)
    return _modules[edits].descriptor


NAMED_MISTAKES = [
    Slip("14.descriptors", "LBO and SBO swapped",
         lambda: descriptor(("lbo, sbo = panel, 8 * row", "lbo, sbo = 8 * row, panel")),
         "LBO and SBO are swapped", "V at d = 256"),
    Slip("14.descriptors", "the 128-byte swizzle code for a tile of 64-byte rows",
         lambda: descriptor(("hopper.SWIZZLE_CODE[row])", "1)")),
         "swizzle mode 1", "64-byte rows", "bits 62-63"),
    Slip("14.descriptors", "the k-step advance counted in elements, not bytes",
         lambda: descriptor(("+ 16 * s * row +", "+ 16 * s * width +"),
                            ("+ (col % width) * 2\n        lbo, sbo = 16",
                             "+ (col % width)\n        lbo, sbo = 16")),
         "start is off", "k-step 1", "counts elements, not bytes"),
    Slip("14.descriptors", "SBO left at 1024 for a 64-byte swizzle",
         lambda: descriptor(("lbo, sbo = 16, 8 * row", "lbo, sbo = 16, 1024")),
         "SBO is off", "8 rows"),
    Slip("14.descriptors", "V's panel stride taken from the kernel's 128-key tiles",
         lambda: descriptor(("lbo, sbo = panel, 8 * row", "lbo, sbo = 128 * row, 8 * row")),
         "LBO is off", "one panel of columns to the next"),
    Slip("14.descriptors", "the start not moved into the operand's panel",
         lambda: descriptor(('start = op["base"] + (col // width) * panel + 16 * s * row',
                             'start = op["base"] + 16 * s * row')),
         "start is off", "dS^T", "the panel it lies in"),
    Slip("14.descriptors", "every k-step at the start of k-step 0",
         lambda: descriptor(("col = 16 * s  #", "col = 0  #"),
                            ("+ 16 * s * row +", "+ 0 * row +")),
         "start is off", "k-step 1", "advance"),
]


@pytest.mark.parametrize("slip", NAMED_MISTAKES, ids=str)
def test_named_mistake(slip):
    slip.fails()


def test_the_solution_scores_every_case():
    r = grader.check("14.descriptors", descriptor())
    assert r.status == "passed" and r.hidden_run and r.passed == r.total


@pytest.mark.parametrize("bad, words", [
    (lambda op, s: "0x4000", ["returned '0x4000'", "expected an int"]),
    (lambda op, s: True, ["expected an int"]),
    (lambda op, s: 1 << 64, ["not a 64-bit unsigned word"]),
    (lambda op, s: -1, ["not a 64-bit unsigned word"]),
    (lambda op, s: 1 << 60, ["reserved bits"]),
    (lambda op, s: (1 << 62) | (3 << 49), ["base offset (bits 49-51)"]),
    (lambda op, s: 0, ["swizzle mode 0"]),
])
def test_a_malformed_word_is_refused_with_a_reason(bad, words):
    r = grader.check("14.descriptors", bad)
    assert r.status == "failed" and r.passed == 0
    for word in words:
        assert word in r.message, r.message


def test_a_word_reading_past_the_tile_says_so():
    r = grader.check("14.descriptors", lambda op, s: hopper.encode_descriptor(
        (1 << 18) - 16, 16, 1024))
    assert r.status == "failed" and "no element of the tile" in r.message


# ------------------------------------------------------------------ the model it decodes with


@pytest.mark.parametrize("row", [128, 64, 32])
def test_each_swizzle_keeps_chunks_and_spreads_a_column_over_the_banks(row):
    addr = hopper.tile_addresses(64, 2 * row, base=8 * row * 3, swizzle=row)
    assert len(np.unique(addr)) == addr.size
    assert addr.min() == 8 * row * 3 and addr.max() == 8 * row * 3 + 64 * 2 * row * 2 - 2
    # the 8 elements of a 16-byte chunk stay together and in order
    assert (np.diff(addr.reshape(64, -1, 8), axis=-1) == 2).all()
    # chunk 0 of 8 consecutive rows: 8 different 16-byte bank groups of a 128-byte line
    for r0 in range(0, 64, 8):
        assert sorted((addr[r0:r0 + 8, 0] % 128) // 16) == list(range(8))
    # the pattern repeats every 8 rows: a base that is not on it is refused
    with pytest.raises(ValueError, match=f"multiple of {8 * row}"):
        hopper.tile_addresses(8, row // 2, base=8 * row // 2, swizzle=row)


def test_swizzle_128_is_the_lectures():
    offsets = np.arange(1 << 14)
    assert (hopper.swizzle(offsets, 128) == hopper.swizzle128(offsets)).all()


def test_the_unswizzled_layout_is_plain_panels():
    plain = hopper.unswizzled_addresses(16, 64, 512, 64)
    assert plain[0, 0] == 512 and plain[1, 0] == 512 + 64 and plain[0, 32] == 512 + 16 * 64


def test_the_cases_fit_the_descriptor_and_shared_memory():
    for make in ch14.VISIBLE + ch14.HIDDEN:
        op = make()
        end = op["base"] + 2 * op["rows"] * op["cols"]
        assert end <= 227 * 1024 and op["base"] % (8 * op["swizzle"]) == 0
        assert op["mn"] % 8 == 0 and 8 <= op["mn"] <= 256
        assert op["role"] == "B" or op["mn"] == 64  # wgmma's A has M = 64
        assert op["role"] == "A" or op["mn"] in (64, 128, 256)  # the probe's B widths
        assert op["k_steps"] <= 16  # the probe's chain


# ------------------------------------------------------------------ the GPU probe


@pytest.mark.skipif(C.nvcc_path() is None, reason="nvcc not found")
def test_the_probe_compiles_for_sm90a_without_spills():
    report = C.resource_usage(ch14.PROBE, arch="sm_90a", extra_flags=["-DFA_KERNEL_ONLY"])
    assert len(report) == 8  # B: N = 64, 128, 256 x either major; A: either major
    for r in report:
        assert r.spills == 0, f"{r.name}: {r.spills} bytes spilled"


needs_sm90 = pytest.mark.skipif(not ch14._on_hopper(), reason="needs an sm_90 GPU (H100/H200)")


@needs_sm90
@pytest.mark.parametrize("make", ch14.VISIBLE + ch14.HIDDEN, ids=lambda m: m()["tile"])
def test_on_an_h100_the_right_words_give_torchs_product(make):
    op = make()
    words = [descriptor()(op, s) for s in range(op["k_steps"])]
    ch14._gpu_product(op, words, "probe")  # raises CheckFailure when the product is off


@needs_sm90
def test_on_an_h100_swapped_strides_give_another_product():
    """The probe has teeth: LBO and SBO swapped (bytes still inside the tile) multiply other
    numbers, and the comparison with torch says so."""
    op = ch14.VISIBLE[0]()  # V at d = 256: both strides matter
    wrong = descriptor(("lbo, sbo = panel, 8 * row", "lbo, sbo = 8 * row, panel"))
    words = [wrong(op, s) for s in range(op["k_steps"])]
    with pytest.raises(CheckFailure, match="away from torch's"):
        ch14._gpu_product(op, words, "probe")
