"""Chapter 13's graded cases catch the slips students make, in a visible case, saying why.

The right answers are the solution notebook's own cells (written to a module); each slip
(``NAMED_MISTAKES``) is that code with one edit. The ring's slips run in the grader's rank
processes (``course_utils.grading.ranks``), a few seconds per case.
"""

from pathlib import Path

import pytest
from spec_helpers import Slip, fails_visibly, module_builder, solution_source, stub

from course_utils import grader
from course_utils.grading.checks import CheckFailure
from course_utils.grading.specs import ch13

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)

SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "13_ring_attention.ipynb"
IDS = ["13.zigzag_chunks", "13.causal_schedule", "13.ring_forward", "13.ring_backward"]


def _solution_source() -> str:
    return solution_source(SOLUTION, lambda s: "cu.setup()" not in s and "grader.check(" not in s)


def _builder(stem, keep):
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=f"{stem}-"))
    return module_builder(folder, solution_source(SOLUTION, keep), stem)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``build(*edits)``: the solution's module with ``(old, new)`` edits (each must match)."""
    return module_builder(tmp_path_factory.mktemp("ch13"), _solution_source(), "ch13")


# The ring's cell alone: the ranks run the file that defines the function, as they run the cell.
_ring = _builder("ch13_ring", lambda s: "def ring_forward_gqa" in s)
_back = _builder("ch13_back", lambda s: "def ring_backward_gqa" in s)
_zigzag = _builder("ch13_zigzag", lambda s: "def zigzag_layout" in s or "harness.ch13 import" in s)
_schedule = _builder("ch13_schedule",
                     lambda s: "def causal_schedule" in s or "harness.ch13 import" in s)


@pytest.mark.parametrize("exercise_id", IDS)
def test_stub_is_not_implemented(exercise_id):
    assert grader.check(exercise_id, stub).status == "not implemented"


# The solution's full marks, hidden cases too, are checked once, where the solution notebook is
# graded (tests/test_notebooks.py runs every cell and every case of its checks).


# ----------------------------------------------------------------------------- zig-zag chunks


def test_zigzag_brute_examples():
    held, rank, local = ch13.zigzag_brute(16, 4)
    assert held == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert rank[14] == 0 and local[14] == 2 and rank[9] == 3 and local[9] == 3
    assert ch13.zigzag_brute(4, 1)[0] == [[0, 1, 2, 3]]


def test_zigzag_wrong_exception_type_is_named(build):
    m = build(("if R < 1 or N % (2 * R):\n        raise ValueError(",
               "if R < 1 or N % (2 * R):\n        raise TypeError("))
    fails_visibly("13.zigzag_chunks", m.zigzag_layout, "raised TypeError", "expected a ValueError")


# ----------------------------------------------------------------------------- causal schedule


def test_schedule_brute_examples():
    kinds, flops = ch13.schedule_brute(1, 0, 3, 4)
    assert kinds == [[["diagonal", "skip"], ["full", "diagonal"]]]
    assert flops == [4 * 4 * (6 + 9 + 6)]
    kinds, _ = ch13.schedule_brute(4, 2, 2, 8)
    assert kinds[1] == [["skip", "skip"], ["full", "full"]]  # the picture of the notebook
    for R in (2, 3, 5):
        totals = [sum(ch13.schedule_brute(R, s, 3, 8)[1][r] for s in range(R)) for r in range(R)]
        assert len(set(totals)) == 1


def test_causal_schedule_wrong_forms_are_named():
    fails_visibly("13.causal_schedule", lambda R, s, C, d: ([["full"]] * R, [0] * R),
                  "2 x 2 grids")
    fails_visibly("13.causal_schedule",
                  lambda R, s, C, d: ([[["F", "D"], ["F", "D"]]] * R, [0] * R), "'F'")
    fails_visibly("13.causal_schedule",
                  lambda R, s, C, d: ([[["full"] * 2] * 2] * R, [0.5] * R), "whole numbers")


def _naive_flops(R, s, C, d):
    """The contiguous split's FLOPs (rank r holds chunk pair 2r, 2r + 1, i.e. 2C tokens): the
    kinds of the zig-zag, but the work of the naive ring."""
    kinds, _ = ch13.schedule_brute(R, s, C, d)
    n = 2 * C
    src = [(r - s) % R for r in range(R)]
    work = [0 if src[r] > r else n * n if src[r] < r else n * (n + 1) // 2 for r in range(R)]
    return kinds, [4 * d * w for w in work]


def test_balance_case_rejects_the_naive_split():
    case = next(c for c in ch13.causal_schedule.cases if c.name.startswith("balance"))
    with pytest.raises(CheckFailure, match="same causal work"):
        case.run(grader.as_candidate(_naive_flops))


# ----------------------------------------------------------------------------- named slips

NAMED_MISTAKES = [
    Slip("13.zigzag_chunks", "strided",
         lambda: _zigzag((
             '(2 * R - 1 - r) * C + offs], dim=1)',
             '(R + r) * C + offs], dim=1)')).zigzag_layout,
         'three ranks', 'chunks r and R + r', '2R - 1 - r'),
    Slip("13.zigzag_chunks", "chunks swapped",
         lambda: _zigzag((
             'torch.cat([r * C + offs, (2 * R - 1 - r) * C + offs], dim=1)',
             'torch.cat([(2 * R - 1 - r) * C + offs, r * C + offs], dim=1)')).zigzag_layout,
         'one rank', 'wrong local order'),
    Slip("13.zigzag_chunks", "contiguous",
         lambda: _zigzag((
             'torch.cat([r * C + offs, (2 * R - 1 - r) * C + offs], dim=1)',
             'torch.arange(N).view(R, 2 * C)')).zigzag_layout,
         'three ranks', 'naive contiguous split'),
    Slip("13.zigzag_chunks", "local in chunk",
         lambda: _zigzag((
             'local[index] = torch.arange(2 * C).expand(R, 2 * C)',
             'local[index] = (torch.arange(2 * C) % C).expand(R, 2 * C)')).zigzag_layout,
         'one rank', 'local[', 'second chunk starts at local position C'),
    Slip("13.zigzag_chunks", "rank of chunk",
         lambda: _zigzag((
             'rank[index] = r.expand(R, 2 * C)',
             'rank[index] = torch.arange(N).view(R, 2 * C) // C')).zigzag_layout,
         'rank[', '2R - 1 - c', 'the row of index that holds t'),
    Slip("13.zigzag_chunks", "no error",
         lambda: _zigzag((
             'if R < 1 or N % (2 * R):',
             'if R < 1:')).zigzag_layout,
         'N not a multiple of 2R', 'instead of raising a ValueError'),
    Slip("13.zigzag_chunks", "vague error",
         lambda: _zigzag((
             'raise ValueError(f"N={N} tokens',
             'raise ValueError("N tokens')).zigzag_layout,
         'N not a multiple of 2R', 'should name', 'missing: 20, 6'),
    Slip("13.zigzag_chunks", "float index",
         lambda: _zigzag((
             'return index, rank, local',
             'return index.float(), rank, local')).zigzag_layout,
         'one rank', 'integer torch.Tensor'),
    Slip("13.causal_schedule", "ring direction",
         lambda: _schedule((
             'src = (r - s) % R',
             'src = (r + s) % R')).causal_schedule,
         'steps 1 and 2', 'the other way', '(r - s)'),
    Slip("13.causal_schedule", "diagonal as C*C",
         lambda: _schedule((
             '"diagonal": C * (C + 1) // 2',
             '"diagonal": C * C')).causal_schedule,
         'one rank', 'flops[0]', 'C (C + 1) / 2 of them'),
    Slip("13.causal_schedule", "diagonal without i = j",
         lambda: _schedule((
             '"diagonal": C * (C + 1) // 2',
             '"diagonal": C * (C - 1) // 2')).causal_schedule,
         'one rank', 'the diagonal itself is seen'),
    Slip("13.causal_schedule", "2 d per pair",
         lambda: _schedule((
             'flops.append(4 * d *',
             'flops.append(2 * d *')).causal_schedule,
         'one rank', '4 d per kept pair'),
    Slip("13.causal_schedule", "mask reversed",
         lambda: _schedule((
             'return "full" if kc < qc',
             'return "full" if kc > qc')).causal_schedule,
         'one rank', 'wholly after', "'skip'"),
    Slip("13.causal_schedule", "strided queries",
         lambda: _schedule((
             'for qc in (r, 2 * R - 1 - r)]',
             'for qc in (r, R + r)]')).causal_schedule,
         'three ranks, step 0', 'query chunk 5'),
]

# The ring's slips, each one edit of the solution's cell.
_POST = ("            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, current, "
         "(r + 1) % R),\n"
         "                                            dist.P2POp(dist.irecv, incoming, "
         "(r - 1) % R)])\n")
RING_SLIPS = [
    Slip("13.ring_forward", "send posted after the compute (no overlap)",
         lambda: _ring(("if s < R - 1:  # start moving", "if s < -1:  # start moving"),
                       ("        for work in works:\n",
                        "        if s < R - 1:\n" + _POST + "        for work in works:\n")
                       ).ring_forward_gqa,
         "rank 0, step 0", "posted after the compute"),
    Slip("13.ring_forward", "receives into the buffer it sends (no double buffer)",
         lambda: _ring(("dist.P2POp(dist.irecv, incoming,", "dist.P2POp(dist.irecv, current,")
                       ).ring_forward_gqa,
         "rank 0", "no double buffer"),
    Slip("13.ring_forward", "merge without the LSE weighting",
         lambda: _ring(("O = (torch.exp(LSE - LSE_new)[..., None] * O\n"
                        "                 + torch.exp(LSE_blk - LSE_new)[..., None] * O_blk)",
                        "O = O + O_blk")).ring_forward_gqa,
         "merge without the LSE weighting"),
    Slip("13.ring_forward", "sends to r - 1 (the wrong peer)",
         lambda: _ring(("dist.P2POp(dist.isend, current, (r + 1) % R)",
                        "dist.P2POp(dist.isend, current, (r - 1) % R)"),
                       ("dist.P2POp(dist.irecv, incoming, (r - 1) % R)",
                        "dist.P2POp(dist.irecv, incoming, (r + 1) % R)")).ring_forward_gqa,
         "rank 0, step 0", "wrong peer"),
    Slip("13.ring_forward", "GQA heads expanded before sending",
         lambda: _ring(("current = torch.stack([k, v])",
                        "current = torch.stack([k.repeat_interleave(group_size, dim=1), "
                        "v.repeat_interleave(group_size, dim=1)])"),
                       ("repeat_interleave(group_size, dim=1).to(acc)", "to(acc)")
                       ).ring_forward_gqa,
         "rank 0, step 0", "GQA heads expanded before sending"),
    Slip("13.ring_forward", "no wait() before the swap",
         lambda: _ring(("        for work in works:\n            work.wait()\n", "")
                       ).ring_forward_gqa,
         "never waited", "missing wait()"),
    Slip("13.ring_forward", "a block from the future computed, not skipped",
         lambda: _ring(("if not (causal and owner > r):", "if True:")).ring_forward_gqa,
         "wholly in the future"),
]
NAMED_MISTAKES += RING_SLIPS

# The backward's slips, each one edit of the solution's cell.
_SHARE = "share = per_head.view(2, B, Hkv, group_size, n, d).sum(3)"
BACKWARD_SLIPS = [
    Slip("13.ring_backward", "dK/dV summed over the wrong query heads (h % Hkv)",
         lambda: _back((_SHARE, "share = per_head.view(2, B, group_size, Hkv, n, d).sum(2)")
                       ).ring_backward_gqa,
         "three ranks", "rank 0", "summed over the wrong heads", "h // G == j"),
    Slip("13.ring_backward", "dK/dV averaged over a group's query heads",
         lambda: _back((_SHARE, _SHARE.replace(".sum(3)", ".mean(3)"))).ring_backward_gqa,
         "three ranks", "rank 0", "averaged", "SUM"),
    Slip("13.ring_backward", "dK/dV travel with H heads (reduced only at home)",
         lambda: _back((_SHARE, "share = per_head"),
                       ("arriving = torch.empty((2, B, Hkv, n, d)",
                        "arriving = torch.empty((2, B, H, n, d)"),
                       ("share = torch.zeros((2, B, Hkv, n, d)",
                        "share = torch.zeros((2, B, H, n, d)"),
                       ("return dQ.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype)",
                        "home = home.view(2, B, Hkv, group_size, n, d).sum(3)\n"
                        "    return dQ.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype)")
                       ).ring_backward_gqa,
         "three ranks", "rank 0, step 1", "all H query heads"),
    Slip("13.ring_backward", "no last hop: each rank returns another block's partial sum",
         lambda: _back(("    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, done, "
                        "(r + 1) % R),\n"
                        "                                        dist.P2POp(dist.irecv, home, "
                        "(r - 1) % R)]):\n        work.wait()\n", "    home = done\n")
                       ).ring_backward_gqa,
         "three ranks", "rank 0", "expected R + 1 = 4", "last hop"),
    Slip("13.ring_backward", "dK/dV sent one step early (with the wrong block)",
         lambda: _back(("        if s > 0:  # the dK/dV", "        if True:  # the dK/dV"),
                       ("done = None  # dK/dV", "done = torch.zeros((2, B, Hkv, n, d), "
                        "dtype=acc, device=q.device)  # dK/dV")).ring_backward_gqa,
         "three ranks", "rank 0, step 0", "one step early"),
    Slip("13.ring_backward", "share added to the arriving dK/dV before wait()",
         lambda: _back(("        for work in works:\n            work.wait()\n"
                        "        done = share if s == 0 else arriving + share",
                        "        if s > 0:\n            arriving += share\n"
                        "        for work in works:\n            work.wait()\n"
                        "        done = share if s == 0 else arriving")).ring_backward_gqa,
         "three ranks", "step 1", "before its wait()"),
    Slip("13.ring_backward", "dQ rebound instead of accumulated",
         lambda: _back(("dQ += dS @ K_blk * scale", "dQ = dS @ K_blk * scale")
                       ).ring_backward_gqa,
         "three ranks", "rank 1", "dQ rebound", "accumulates"),
    Slip("13.ring_backward", "P from the block's own softmax, not the final LSE",
         lambda: _back(("P = torch.exp(S - lse)", "P = torch.softmax(S, dim=-1)")
                       ).ring_backward_gqa,
         "three ranks", "rank 0", "own softmax", "FINAL LSE"),
]
NAMED_MISTAKES += BACKWARD_SLIPS


@pytest.mark.parametrize("slip", NAMED_MISTAKES, ids=repr)
def test_named_mistake(slip):
    slip.fails()
