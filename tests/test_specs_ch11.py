"""Chapter 11's graded cases catch the slips students make, in a visible case, saying why.

The right answers are the solution notebook's own cells (written to a module, since Triton reads
a kernel's source from its file); each slip is that code with one line changed.
"""

import math
from pathlib import Path

import pytest
import torch
from spec_helpers import fails_visibly, module_builder, solution_source, stub

from course_utils import grader
from course_utils.grading.harness.ch11 import prefix_reads
from course_utils.grading.specs import ch11, ch11_splits

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)

SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "11_serving_attention.ipynb"
IDS = ["11.shared_prefix", "11.chunked_mask", "11.num_splits", "11.split_plan",
       "11.paged_prefill"]


def _solution_source() -> str:
    return solution_source(SOLUTION, lambda s: "cu.setup()" not in s and "grader.check(" not in s)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``build(**replacements)``: the solution's module with ``old -> new`` edits (each must
    match, so that a slip test cannot silently test the right answer)."""
    folder = tmp_path_factory.mktemp("ch11")
    base = _solution_source()
    return module_builder(folder, base, "ch11")


@pytest.mark.parametrize("exercise_id", IDS)
def test_stub_is_not_implemented(exercise_id):
    assert grader.check(exercise_id, stub).status == "not implemented"


# The solution's full marks, hidden cases too, are checked once, where the solution notebook is
# graded (tests/test_notebooks.py runs every cell and every case of its checks).


# ----------------------------------------------------------------------------- shared prefix


def _per_sequence(q, K_prefix, V_prefix, K_suffix, V_suffix, cu_seqlens_q, cu_seqlens_k, scale):
    """Right O and LSE, but the prefix concatenated with each suffix: read B times."""
    Tq, Hq, d = q.shape
    P, Hkv, _ = K_prefix.shape
    O, LSE = torch.empty_like(q), torch.empty(Hq, Tq, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        K = torch.cat([K_prefix, K_suffix[ck[b]:ck[b + 1]]]).repeat_interleave(Hq // Hkv, 1)
        V = torch.cat([V_prefix, V_suffix[ck[b]:ck[b + 1]]]).repeat_interleave(Hq // Hkv, 1)
        nq, n = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        S = scale * torch.einsum("ihd,jhd->hij", q[cq[b]:cq[b + 1]], K)
        j, i = torch.arange(P + n, device=q.device), torch.arange(nq, device=q.device)[:, None]
        S = S.masked_fill((j >= P) & (j - P > n - nq + i), -math.inf)
        LSE[:, cq[b]:cq[b + 1]] = torch.logsumexp(S, -1)
        O[cq[b]:cq[b + 1]] = (torch.softmax(S, -1) @ V.transpose(0, 1)).transpose(0, 1)
    return O, LSE


def test_prefix_reads_count_once_for_the_solution_and_b_times_per_sequence(build):
    problem = ch11.cascade_problem(32, [5, 8, 1, 12, 3, 7], [1, 2, 1, 3, 1, 2], 4, 2, 16)
    once = 32 * 2 * 16
    _, reads_K, reads_V = prefix_reads(build().cascade_attention, *problem)
    assert (reads_K, reads_V) == (once, once)
    _, reads_K, reads_V = prefix_reads(_per_sequence, *problem)
    assert (reads_K, reads_V) == (6 * once, 6 * once)


def test_prefix_copied_per_sequence_fails_the_reads_case():
    r = fails_visibly("11.shared_prefix", _per_sequence, "prefix reads counted",
                       "6 times the prefix", "not once per sequence", every_case=True)
    assert r.passed == r.total - 2  # O and LSE are right everywhere: 2 cases count reads


def test_prefix_gathered_for_every_query_fails_the_reads_case(build):
    m = build(('LSE_pre, O_pre = part(scale * torch.einsum("tkgd,pkd->tkgp", qg, K_prefix), '
               'V_prefix)',
               'B = len(cq0) - 1\n'
               '    seq = torch.repeat_interleave(torch.arange(B, device=q.device),\n'
               '                                  torch.diff(cq0).long())\n'
               '    Kb = K_prefix.expand(B, -1, -1, -1)[seq]  # the prefix of every query\n'
               '    LSE_pre, O_pre = part(scale * torch.einsum("tkgd,tpkd->tkgp", qg, Kb), '
               'V_prefix)'),
              ("qg = q.view(Tq, Hkv, G, d)", "qg = q.view(Tq, Hkv, G, d)\n    cq0 = cu_seqlens_q"))
    fails_visibly("11.shared_prefix", m.cascade_attention, "K_prefix", "not once per sequence")


def test_empty_suffix_without_a_guard_gives_nan_and_says_why(build):
    m = build(("m = torch.where(torch.isinf(m), torch.zeros_like(m), m)", "pass"))
    fails_visibly("11.shared_prefix", m.cascade_attention, "an empty suffix", "NaN",
                   "LSE_suffix = -inf")


def test_top_left_suffix_is_named(build):
    m = build(("> i + n - nq, -math.inf)", "> i, -math.inf)"))
    fails_visibly("11.shared_prefix", m.cascade_attention, "decode", "top-left")


def test_gqa_heads_interleaved_is_named(build):
    m = build(("qg = q.view(Tq, Hkv, G, d)", "qg = q.view(Tq, G, Hkv, d).transpose(1, 2)"
               ".contiguous()"),
              ("return O.view(Tq, Hq, d), LSE.view(Tq, Hq).T.contiguous()",
               "return O.transpose(1, 2).reshape(Tq, Hq, d), "
               "LSE.transpose(1, 2).reshape(Tq, Hq).T.contiguous()"))
    fails_visibly("11.shared_prefix", m.cascade_attention, "GQA [", "h // G")


def test_prefix_part_alone_is_named(build):
    m = build(("torch.logaddexp(LSE_pre[rows], LSE_suf)", "LSE_pre[rows]"),
              ("+ torch.exp(LSE_suf - LSE[rows])[..., None] * O_suf)", ")"))
    fails_visibly("11.shared_prefix", m.cascade_attention, "decode", "prefix part alone")


def test_sdpa_is_forbidden():
    def with_sdpa(q, *rest):
        torch.nn.functional.scaled_dot_product_attention(q[None], q[None], q[None])
        return _per_sequence(q, *rest)

    assert grader.check("11.shared_prefix", with_sdpa).status == "forbidden"


# ----------------------------------------------------------------------------- chunked mask


@pytest.mark.parametrize("edit, words", [
    (("+ nk[seq] - nq[seq]", ""), ["chunk = 8", "top-left"]),
    (("first_key = cu_seqlens_k[seq].long()", "first_key = torch.zeros_like(pos)"),
     ["chunk = 8", "add the sequence's start"]),
    (("lo = first_key + torch.div(pos.clamp_min(0), chunk, rounding_mode=\"floor\") * chunk",
      "lo = first_key + (pos - chunk + 1).clamp_min(0)"), ["chunk = 4", "sliding window"]),
    (("hi = torch.where(pos >= 0, first_key + pos + 1, lo)",
      "hi = torch.where(pos >= 0, first_key + pos, lo)"), ["chunk = 4", "one past the last"]),
    (("hi = torch.where(pos >= 0, first_key + pos + 1, lo)", "hi = first_key + pos + 1"),
     ["chunk = 2", "sees no key", "lo == hi"]),
], ids=["top-left", "local indices", "sliding window", "inclusive hi", "p < 0"])
def test_chunked_mask_slips_are_named(build, edit, words):
    m = build(edit)
    fails_visibly("11.chunked_mask", m.chunk_key_ranges, *words)


def test_chunked_mask_negative_floor_is_caught(build):
    m = build(("pos.clamp_min(0)", "pos"), ("hi = torch.where(pos >= 0, first_key + pos + 1, lo)",
                                           "hi = first_key + pos + 1"))
    fails_visibly("11.chunked_mask", m.chunk_key_ranges, "position p = -", "sees none")


def test_chunked_mask_wrong_types_are_named():
    fails_visibly("11.chunked_mask", lambda cq, ck, c: ([0], [0]), "integer torch.Tensor")
    fails_visibly("11.chunked_mask", lambda cq, ck, c: (cq, ck), "has shape")


# ----------------------------------------------------------------------------- num splits


@pytest.mark.parametrize("edits, words", [
    ([("// (B * Hkv), n_blocks))", "// B, n_blocks))")],
     ["long context", "Hkv=8", "B * Hkv * num_splits"]),
    ([("wave = num_sms * programs_per_sm", "wave = num_sms")],
     ["programs_per_sm=2", "num_sms * programs_per_sm"]),
    ([("    while splits > 1 and", "    while False and")],
     ["leave a split empty", "with no key block", "Skip those counts", "next smaller count"]),
    ([("min(target_waves * wave // (B * Hkv), n_blocks)",
       "min(-(-target_waves * wave // (B * Hkv)), n_blocks)")],
     ["got 17, expected 16", "more than 1 wave(s) hold", "tail wave", "largest count that fits"]),
    ([("min(target_waves * wave // (B * Hkv), n_blocks)", "target_waves * wave // (B * Hkv)"),
      ("    while splits > 1 and", "    while False and")],
     ["long context", "seqlen_k=32768", "more splits than the 256 key blocks"]),
], ids=["no Hkv", "no programs per SM", "empty splits", "ceil", "no cap"])
def test_num_splits_slips_are_named(build, edits, words):
    m = build(*edits)
    fails_visibly("11.num_splits", m.num_splits, *words)


def test_num_splits_must_return_an_int():
    fails_visibly("11.num_splits", lambda *a: 1.0, "expected an int")


def test_best_num_splits_examples():
    assert ch11.best_num_splits(1, 8, 131072, 64, 132, 1, 1) == 16  # 128 programs, not 136
    assert ch11.best_num_splits(1, 8, 131072, 64, 132, 1, 1, fit=False) == 17
    assert ch11.best_num_splits(4, 4, 65536, 64, 132, 1, 1) == 8
    assert ch11.best_num_splits(64, 8, 4096, 64, 132, 1, 1) == 1
    assert ch11.best_num_splits(1, 1, 160, 16, 6, 1, 1) == 5  # 6 splits leave one empty
    assert ch11.best_num_splits(1, 1, 9000, 64, 132, 1, 1) == 71  # 72..132 leave some empty
    assert ch11.best_num_splits(1, 8, 1, 64, 132, 1, 1) == 1
    assert [len(r) for r in ch11.split_ranges(10, 6)] == [2, 2, 2, 2, 2, 0]


# ----------------------------------------------------------------------------- split plan


@pytest.mark.parametrize(("edits", "words"), [
    ([("    wave = max(1, num_sms // Hkv, sum(1 for x in blocks if x > 0))",
       "    wave = max(1, num_sms, sum(1 for x in blocks if x > 0))")],
     ["skewed batch", "more than one wave", "Hkv programs", "num_sms // Hkv items"]),
    ([("    while sum(-(-x // chunk) for x in blocks) > wave:", "    while False:")],
     ["items that round up", "more than one wave", "rounds its item count up",
      "grow the chunk"]),
    ([("    chunk = max(1, -(-sum(blocks) // wave))", "    chunk = max(1, sum(blocks) // wave)"),
      ("    while sum(-(-x // chunk) for x in blocks) > wave:", "    while False:")],
     ["more than one wave", "grow the chunk"]),  # floor = ceil when W divides the blocks
    ([("min((first + chunk) * BLOCK_N, lengths[b])", "(first + chunk) * BLOCK_N")],
     ["skewed batch", "runs past sequence", "ends at the sequence's length"]),
    ([("        for first in range(0, x, chunk):",
       "        if x == 0:\n            work.append((b, 0, 0))\n"
       "        for first in range(0, x, chunk):")],
     ["empty sequences", "holds no key", "needs no work item"]),
    ([("    while sum(-(-x // chunk) for x in blocks) > wave:\n        chunk += 1",
       "    per = max(1, wave // max(1, sum(1 for x in blocks if x > 0)))  # splits each"),
      ("        for first in range(0, x, chunk):",
       "        chunk = max(1, -(-x // per))\n        for first in range(0, x, chunk):")],
     ["skewed batch", "largest work item holds", "one split count for every sequence"]),
    ([("        for first in range(0, x, chunk):",
       "        for first in range(0, x - 1, chunk):")],
     ["covered up to"]),
], ids=["no Hkv", "ideal chunk not grown", "floor", "past the end", "idle item", "one count",
        "a block missing"])
def test_split_plan_slips_are_named(build, edits, words):
    m = build(*edits)
    fails_visibly("11.split_plan", m.split_plan, *words)


def test_split_plan_format_is_checked():
    fails_visibly("11.split_plan", lambda *a: 3, "expected a list of (b, start, end) ints")
    fails_visibly("11.split_plan", lambda lengths, *a: [(0, 0.0, 5.0)],
                  "expected a list of (b, start, end) ints")


def test_split_plan_model_examples():
    blocks, W, best = ch11.plan_rules([131072, 1024, 1024, 1024], 8, 64, 132)
    assert (blocks, W, best) == ([2048, 16, 16, 16], 16, 158)  # the ideal 131 overflows
    assert ch11.plan_rules([0, 0], 8, 64, 7)[1:] == (1, 1)
    assert ch11.plan_rules([300] * 40, 8, 64, 132)[1:] == (40, 5)  # one item each
    same = ch11.plan_slip([131072, 1024, 1024, 1024], 8, 64, 132, "same")
    assert sum(1 for b, _, _ in same if b == 0) == 4  # the long sequence keeps 4 items


def test_the_kernel_case_uses_the_plan_it_was_given(build, monkeypatch):
    # the kernel case hands the candidate's items to make_plan: a plan with every block its own
    # item (legal, far past one wave) is caught by the rules before the kernel runs
    m = build()

    def per_block(lengths, Hkv, BLOCK_N, num_sms):
        return [(b, s, min(s + BLOCK_N, n)) for b, n in enumerate(lengths)
                for s in range(0, n, BLOCK_N)]

    fails_visibly("11.split_plan", per_block, "more than one wave")
    r = grader.check("11.split_plan", m.split_plan)
    assert r.status == "passed"


def test_best_num_splits_is_the_largest_that_fits_with_no_empty_split():
    """The brute force against the rule written another way: the most that fit the waves, at
    most ``n_blocks``, then one fewer while the last split would start past the last block."""
    for args in ch11_splits._random_split_rows(3):
        B, Hkv, seqlen_k, BLOCK_N, num_sms, programs_per_sm, target_waves = args
        n_blocks = -(-seqlen_k // BLOCK_N)
        fit = target_waves * num_sms * programs_per_sm // (B * Hkv)
        s = max(1, min(fit, n_blocks))
        while s > 1 and (s - 1) * -(-n_blocks // s) >= n_blocks:
            s -= 1
        assert ch11.best_num_splits(*args) == s, args


# ----------------------------------------------------------------------------- paged prefill


@pytest.mark.parametrize("edit, words", [
    (("phys = tl.load(table + start_n // PAGE_SIZE).to(tl.int64)",
      "phys = tl.zeros([], tl.int64) + start_n // PAGE_SIZE"),
     ["one sequence", "NaN", "BLOCK_TABLE"]),
    ((", mask=in_cache, other=0.0)", ")"), ["one sequence", "NaN", "other=0.0"]),
    (("seen = cols[None, :] <= pos[:, None]", "seen = cols[None, :] <= offs_m[:, None]"),
     ["chunked prefill after cached keys", "top-left"]),
    (("* Hkv + kv_head) * HEAD_DIM", "* Hkv + h % Hkv) * HEAD_DIM"),
     ["chunked prefill after cached keys", "h // GROUP"]),
], ids=["logical page order", "unmasked loads", "top-left", "K/V head h % Hkv"])
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's max of NaN
def test_paged_prefill_slips_are_named(build, edit, words):
    m = build(edit)
    fails_visibly("11.paged_prefill", m.paged_prefill_kernel, *words)


def test_paged_prefill_refuses_a_python_function(build):
    m = build()
    fails_visibly("11.paged_prefill", m.paged_prefill_kernel.fn, "not a Triton function")


def test_paged_problem_shuffles_pages_and_poisons_the_rest():
    inputs, (K, _) = ch11.paged_problem([2, 3], [20, 40], 2, 1, 16, torch.float32, seed=7)
    q, K_cache, _, table, _, seqlens_k, _ = inputs
    assert table[:, :2].flatten().tolist() != list(range(4))
    for b, n in enumerate(seqlens_k.tolist()):
        logical = torch.cat([K_cache[p] for p in table[b].tolist()])[:n]
        assert torch.equal(logical.cpu(), K[b].cpu())
        assert torch.isnan(torch.cat([K_cache[p] for p in table[b].tolist()])[n:]).all()


def test_token_first_lse_is_named(build):
    """LSE (Tq, Hq), the layout chapter 11 used before issue 41: the shape is named, heads first."""
    m = build(("return O.view(Tq, Hq, d), LSE.view(Tq, Hq).T.contiguous()",
               "return O.view(Tq, Hq, d), LSE.view(Tq, Hq)"))
    fails_visibly("11.shared_prefix", m.cascade_attention, "LSE has shape", "a transpose")
