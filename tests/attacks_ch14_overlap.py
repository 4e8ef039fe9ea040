"""Attack notebooks aimed at chapter 14's consumer-loop grader (``14.consumer_loop``), which takes
the student's list of operations as data and runs it on the model of the asynchronous tensor core
(``course_utils.library.hopper_pipeline``) in the grading process.

Each attack hands in a wrong loop (or none) and tries to make it pass: a list too long to read, a
generator that never ends, objects that pretend to be operations, a model patched in the
student's own process to report success. None may score. ``tests/test_grading_attacks.py`` grades
them with the others (``register(attack)``).
"""

from __future__ import annotations

CHECK = 'grader.check("14.consumer_loop", consumer_loop)'

# variant 0's loop: right numbers, no overlap (the wrong answer the patches try to pass off)
NO_OVERLAP = '''
def consumer_loop(n_tiles, stages):
    ops = []
    for j in range(n_tiles):
        p = (j // stages) % 2
        ops += [("wait_k", j, p), ("fence",), ("issue_s", j), ("commit",), ("wait_group", 0),
                ("release_k", j), ("softmax", j), ("rescale", j), ("pack_p", j),
                ("wait_v", j, p), ("fence",), ("issue_pv", j), ("commit",), ("wait_group", 0),
                ("release_v", j)]
    return ops
'''

FLOOD = '''
def consumer_loop(n_tiles, stages):
    return [("fence",)] * 20_000
'''

ENDLESS = '''
import itertools


def consumer_loop(n_tiles, stages):
    return (("fence",) for _ in itertools.count())
'''

WIDE_OP = '''
def consumer_loop(n_tiles, stages):
    return [("fence", *range(200_000))]
'''

# a str that equals every name, ints that are not ints: nothing of it may be run or trusted
HOSTILE = '''
class Name(str):
    def __eq__(self, other):
        return True

    __hash__ = str.__hash__


class Tile:
    def __index__(self):
        raise SystemExit("the grader called my __index__")

    def __int__(self):
        return 0


def consumer_loop(n_tiles, stages):
    return [(Name("fence"),), (Name("issue_s"), Tile())] * n_tiles
'''

# the model and the comparison patched where the student's code runs, around a loop that has
# no wgmma.fence at all (it fails every case, the one-tile case included)
PATCHED_MODEL = NO_OVERLAP.replace('("fence",), ', "") + '''
import numpy as np
from course_utils import checks
from course_utils import hopper_pipeline as hp

_real = hp.run_consumer


def _claims_success(ops, **kw):
    r = _real(ops, **kw)
    r.overlapped = [(i, j, True) for i, j, _ in r.overlapped]  # "every softmax overlapped"
    return r


hp.run_consumer = _claims_success
hp.PipelineError = type("NeverRaised", (Exception,), {})
checks.compare = lambda *a, **k: (0.0, 1.0)
checks.CheckFailure.__init__ = lambda self, *a, **k: None
'''


def register(attack):
    attack("ch14_overlap_flood", [FLOOD, CHECK], {"14.consumer_loop": 0}, chapter="14")
    attack("ch14_overlap_endless_generator", [ENDLESS, CHECK], {"14.consumer_loop": 0},
           chapter="14")
    attack("ch14_overlap_wide_operation", [WIDE_OP, CHECK], {"14.consumer_loop": 0},
           chapter="14")
    attack("ch14_overlap_hostile_objects", [HOSTILE, CHECK], {"14.consumer_loop": 0},
           chapter="14")
    attack("ch14_overlap_patched_model", [PATCHED_MODEL, CHECK], {"14.consumer_loop": 0},
           chapter="14")
