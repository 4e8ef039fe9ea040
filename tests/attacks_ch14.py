"""Attack notebooks aimed at chapter 14's descriptor grader (``14.descriptors``), which takes the
student's descriptor words as data and decodes them with ``course_utils.library.hopper`` in the
grading process.

Each attack hands in something that is not the right words and tries to make it pass: the
model's own decode table (what the words should read) instead of words, words with every
reserved bit set to make the decoder misread or crash, ints too large for 64 bits, an int
subclass that lies about its bits, and the model patched in the student's own process so that
any word "reads the right bytes". None may score. ``tests/test_grading_attacks.py`` grades them
with the others (``register(attack)``).
"""

from __future__ import annotations

CHECK = 'grader.check("14.descriptors", descriptor)'

# What the words should make wgmma read, computed with the model: data, not a descriptor
DECODE_TABLE = '''
import numpy as np
from course_utils import hopper


def descriptor(op, s):
    tile = hopper.tile_addresses(op["rows"], op["cols"], op["base"], op["swizzle"])
    first, mn = op["first"], op["mn"]
    if op["major"] == "K":
        return tile[first:first + mn, 16 * s:16 * s + 16]
    return tile[16 * s:16 * s + 16, first:first + mn].T
'''

# Every bit set, then the fields right but the reserved bits and the base offset set as well
RESERVED_BITS = '''
def descriptor(op, s):
    if s == 0 and op["swizzle"] == 128:
        return (1 << 64) - 1
    row = op["swizzle"]
    garbage = (3 << 14) | (3 << 30) | (7 << 46) | (7 << 49) | (0x3FF << 52)
    return garbage | ({128: 1, 64: 2, 32: 3}[row] << 62) | (op["base"] >> 4)
'''

GIANT = '''
def descriptor(op, s):
    return 10 ** 4000 + s
'''

# An int whose shifts and masks answer what the grader would want to see
LYING_INT = '''
class Word(int):
    def __rshift__(self, n):
        return 1 if n == 62 else 0

    def __and__(self, other):
        return 0

    def __index__(self):
        return 1 << 62

    def __int__(self):
        return 1 << 62


def descriptor(op, s):
    return Word(0)
'''

# The model patched where the student's code runs: any word "reads the right bytes" (the
# grader's side, course_utils.grading.specs, cannot even be imported there)
PATCHED_MODEL = '''
import numpy as np
from course_utils import hopper

_tile = hopper.tile_addresses


def _reads_whatever_is_needed(desc, mn, major, k=16):
    return np.zeros((mn, k), dtype=np.int64)


hopper.operand_addresses = _reads_whatever_is_needed
hopper.tile_addresses = lambda *a, **k: np.zeros_like(_tile(*a, **k))
hopper.decode_descriptor = lambda desc: {"start": 0, "lbo": 16, "sbo": 1024, "swizzle": 1}


def descriptor(op, s):
    return 1 << 62
'''


def register(attack):
    attack("ch14_descriptors_decode_table", [DECODE_TABLE, CHECK], {"14.descriptors": 0},
           chapter="14")
    attack("ch14_descriptors_reserved_bits", [RESERVED_BITS, CHECK], {"14.descriptors": 0},
           chapter="14")
    attack("ch14_descriptors_giant_int", [GIANT, CHECK], {"14.descriptors": 0}, chapter="14")
    attack("ch14_descriptors_lying_int", [LYING_INT, CHECK], {"14.descriptors": 0},
           chapter="14")
    attack("ch14_descriptors_patched_model", [PATCHED_MODEL, CHECK], {"14.descriptors": 0},
           chapter="14")
