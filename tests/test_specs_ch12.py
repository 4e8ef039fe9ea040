"""Chapter 12's graded cases catch the slips students make, in a visible case, saying why.

The right answers are the solution notebook's own cells (written to a module, as the other
chapters' tests do); each slip is that code with one line changed. Compiling is the cost here (a
second or two per compiled case on a CPU), so each slip test stops at its first failing case.
"""

import re
from pathlib import Path

import pytest
import torch
from spec_helpers import fails_visibly, module_builder, solution_source, stub

from course_utils import grader
from course_utils.grading.harness import ch12 as harness
from course_utils.grading.specs import ch12

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)

SOLUTION = (Path(__file__).resolve().parent.parent / "solutions"
            / "12_custom_op_torch_compile.ipynb")
IDS = ["12.varlen_fake", "12.autograd_registration", "12.no_graph_break", "12.kv_cache_write"]


def _solution_source() -> str:
    # the definitions only: no setup, no checks, no demonstrations that print or compile
    text = solution_source(SOLUTION, lambda s: s.lstrip().startswith(("def ", "import ", "from "))
                           and "cu.setup()" not in s)
    # the demonstration lines after the block's definitions
    text = re.sub(r"(?ms)^problem = block_inputs.*?(?=^def |\Z)", "", text)
    text = re.sub(r"(?ms)^args = packed_problem.*?(?=^def |\Z)", "", text)
    text = re.sub(r"(?ms)^k_cache, v_cache, cache_seqlens.*?(?=^def |\Z)", "", text)
    return text


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``build(*edits)``: the solution's module with ``old -> new`` edits (each must match, so
    that a slip test cannot silently test the right answer)."""
    folder = tmp_path_factory.mktemp("ch12")
    base = "import course_utils as cu\ndev = cu.device()\n" + _solution_source()
    return module_builder(folder, base, "ch12")


def _case_fails(exercise, name, candidate, *words):
    """Run one visible case alone (compiling every case of a slip costs seconds each)."""
    case = next(c for c in exercise.cases if c.name.startswith(name))
    assert not case.hidden
    with pytest.raises(ch12.CheckFailure) as info:
        case.run(grader.as_candidate(candidate, exercise))
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def _stub2(*args):  # a second function: register_autograd takes two
    raise NotImplementedError("replace this line with your code")


@pytest.mark.parametrize("exercise_id", IDS)
def test_stub_is_not_implemented(exercise_id):
    candidate = (stub, _stub2) if exercise_id == "12.autograd_registration" else stub
    assert grader.check(exercise_id, candidate).status == "not implemented"


# The solution's full marks, hidden cases too, are checked once, where the solution notebook is
# graded (tests/test_notebooks.py runs every cell and every case of its checks).


# ----------------------------------------------------------------------------- varlen fake

O_LINE = "O = q.new_empty((Tq, Hq, dv))"
LSE_LINE = "LSE = q.new_empty((Hq, Tq), dtype=torch.float32)"


def test_the_expected_metadata_is_what_the_real_op_returns():
    problem = ch12._real_packing([4, 3], [5, 6], 4, 2, 16, 8, 0)
    O, LSE = harness.varlen_attention_reference(*problem)
    q = problem[0]
    desc = {"q": {"shape": list(q.shape), "dtype": "float32", "device": str(q.device)},
            "v": {"shape": list(problem[2].shape)}}
    want = ch12.expected_varlen_meta(desc)
    assert [list(O.shape), list(O.stride())] == [want[0]["shape"], want[0]["stride"]]
    assert [list(LSE.shape), list(LSE.stride())] == [want[1]["shape"], want[1]["stride"]]
    assert LSE.dtype == torch.float32 and not q.is_contiguous()


def test_empty_like_q_is_named(build):
    m = build((O_LINE, "O = torch.empty_like(q)"))
    fails_visibly("12.varlen_fake", m.varlen_attention_fake, "GQA", "empty_like")


def test_empty_like_q_with_dv_equal_d_fails_on_strides(build):
    m = build((O_LINE, "O = torch.empty_like(q)  # d = dv in that case"))
    problems = [ch12._packed([6, 2], [6, 2], 4, 2, 16, 16, q_order=(1, 0, 2))]
    case = ch12._varlen_case("transposed q", problems, "hint")
    with pytest.raises(ch12.CheckFailure, match="strides") as info:
        case(m.varlen_attention_fake)
    assert "empty_like" in info.value.hint


def test_lse_transposed_is_named(build):
    m = build((LSE_LINE, "LSE = q.new_empty((Tq, Hq), dtype=torch.float32).t()"))
    fails_visibly("12.varlen_fake", m.varlen_attention_fake, "LSE has strides", "(Hq, Tq)")


def test_lse_in_q_dtype_is_named(build):
    m = build((LSE_LINE, "LSE = q.new_empty((Hq, Tq))"))
    fails_visibly("12.varlen_fake", m.varlen_attention_fake, "float16", "float32")


def test_forgotten_device_is_named(build):
    m = build((O_LINE, "O = torch.empty((Tq, Hq, dv), dtype=q.dtype)"))
    fails_visibly("12.varlen_fake", m.varlen_attention_fake, "cuda", "device=q.device")


def test_sizes_from_data_are_named(build):
    m = build(("Tq, Hq, dv = q.shape[0], q.shape[1], v.shape[-1]",
               "Tq, Hq, dv = int(cu_seqlens_q[-1]), q.shape[1], v.shape[-1]"))
    fails_visibly("12.varlen_fake", m.varlen_attention_fake, "the fake raised", "no data")


def test_sizes_from_max_seqlen_are_wrong_for_ragged_batches(build):
    m = build(("Tq, Hq, dv = q.shape[0], q.shape[1], v.shape[-1]",
               "Tq, Hq, dv = max_seqlen_q * (cu_seqlens_q.shape[0] - 1), q.shape[1], "
               "v.shape[-1]"))
    fails_visibly("12.varlen_fake", m.varlen_attention_fake, "has shape")


# ----------------------------------------------------------------------------- autograd


def test_no_gradient_for_the_cap_is_named(build):
    m = build(("return grad_scores, grad_cap", "return grad_scores, None"))
    fails_visibly("12.autograd_registration", (m.setup_context, m.backward), "c.grad is None",
                   "learnable")


def test_chain_rule_factor_is_named(build):
    m = build(("grad_scores = grad_y * slope", "grad_scores = grad_y * slope / cap"))
    fails_visibly("12.autograd_registration", (m.setup_context, m.backward), "x.grad",
                   "cancel")


def test_cap_gradient_without_its_second_term_is_named(build):
    m = build(("(grad_y * (t - u * slope))", "(grad_y * t)"))
    fails_visibly("12.autograd_registration", (m.setup_context, m.backward), "c.grad",
                   "c appears twice")


@pytest.mark.filterwarnings("ignore:Error detected in GeneratedBackward")  # anomaly mode's
def test_numpy_in_backward_fails_when_compiled(build):
    m = build(("t = torch.tanh(u)",
               "t = torch.from_numpy(__import__('numpy').tanh(u.detach().cpu().numpy()))"
               ".to(u.device)"))
    r = fails_visibly("12.autograd_registration", (m.setup_context, m.backward),
                       "torch.compile", "fake tensors", every_case=True)
    assert r.passed == r.total - 2, r.message  # eager cases pass: only compiling shows it


def test_a_single_function_is_refused():
    r = grader.check("12.autograd_registration", lambda ctx, g: g)
    assert r.status == "failed" and "pair" in r.message, r.message


# ----------------------------------------------------------------------------- no graph break


def test_the_given_block_breaks_the_graph_and_the_reason_is_named(build):
    m = build()
    fails_visibly("12.no_graph_break", m.attention_block_eager, "fullgraph=True",
                   "torch.where")


def test_a_print_left_in_is_named(build):
    m = build(("    return O.flatten(2) @ W_o",
               "    print('largest |O|', O.abs().max())\n    return O.flatten(2) @ W_o"))
    _case_fails(ch12.no_graph_break, "two sequence lengths", m.attention_block,
                "fullgraph=True", "print")


def test_a_block_that_raises_without_compiling_is_told_so(build):
    m = build(("    return O.flatten(2) @ W_o", "    return O @ W_o"))  # (B, N, H, d) @ (D, D)
    _case_fails(ch12.no_graph_break, "two sequence lengths", m.attention_block,
                "called without torch.compile", "raised RuntimeError")


def test_always_capping_is_named(build):
    m = build(("S = torch.where(S.abs().amax() > CAP, CAP * torch.tanh(S / CAP), S)",
               "S = CAP * torch.tanh(S / CAP)"))
    _case_fails(ch12.no_graph_break, "two sequence lengths", m.attention_block,
                "scores below CAP", "global")


def test_never_capping_is_named(build):
    m = build(("S = torch.where(S.abs().amax() > CAP, CAP * torch.tanh(S / CAP), S)", "pass"))
    _case_fails(ch12.no_graph_break, "the cap on", m.attention_block, "the cap on", "global")


def test_a_specialised_length_recompiles(build):
    m = build(("rows = torch.arange(N, device=x.device)[:, None]",
               "rows = torch.arange(int(N), device=x.device)[:, None]\n"
               "    if N > 8:\n        S = S + 0.0"))
    _case_fails(ch12.no_graph_break, "two sequence lengths", m.attention_block,
                "graphs were compiled", "no Python branch on a size")


def test_block_reference_matches_the_given_block(build):
    m = build()
    args = ch12.block_problem(2, 7, 16, 2, [7, 3], 40.0, 0)
    want = ch12.block_reference(*args)
    got = m.attention_block_eager(*args)
    assert torch.allclose(got.double(), want, atol=1e-4)


# ----------------------------------------------------------------------------- kv cache write

MUTATES = 'mutates_args=("k_cache", "v_cache", "cache_seqlens")'
KV = "12.kv_cache_write"


def test_the_reference_is_the_definition():
    """append_kv_reference against the lecture's op: the same write through slot numbers."""
    from course_utils import kv_cache

    p = harness.append_problem(3, 3, 4, 2, 8, "float32", 0, lengths=[5, 8, 0])
    k_cache, v_cache, lengths, k, v, table = p
    pos = lengths.long()
    slots = table[torch.arange(3), pos // 4].long() * 4 + pos % 4
    want_k, want_v = kv_cache.kv_cache_write_reference(k_cache, v_cache, k, v, slots)
    got_k, got_v, got_lengths = ch12.append_kv_reference(*p)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert got_lengths.tolist() == [6, 9, 1]


def test_no_mutates_args_is_named(build):
    m = build((MUTATES, "mutates_args=()"))
    fails_visibly(KV, m.register_append_kv, "declares no mutation", "drop it")


def test_the_lengths_not_declared_is_named(build):
    m = build((MUTATES, 'mutates_args=("k_cache", "v_cache")'))
    fails_visibly(KV, m.register_append_kv, "does not declare cache_seqlens",
                  "cache_seqlens += 1")


def test_a_read_only_argument_declared_is_named(build):
    m = build((MUTATES, 'mutates_args=("k_cache", "v_cache", "cache_seqlens", "block_table")'))
    fails_visibly(KV, m.register_append_kv, "block_table as mutated", "only reads")


def test_a_fake_that_returns_a_cache_is_named(build):
    m = build(("    return None  # the writes are in the schema", "    return k_cache  #"))
    fails_visibly(KV, m.register_append_kv, "fake tensors", "returns nothing (None)")


def test_swapped_page_and_row_is_named(build):
    m = build(("page = block_table[b, pos // page_size].long()",
               "page = block_table[b, pos % page_size].long()"),
              ("row = pos % page_size", "row = pos // page_size"))
    fails_visibly(KV, m.register_append_kv, "k_cache after the eager call",
                  "page and row swapped")


def test_the_logical_page_is_named(build):
    m = build(("page = block_table[b, pos // page_size].long()", "page = pos // page_size"))
    fails_visibly(KV, m.register_append_kv, "k_cache after", "the logical page")


END = "    cache_seqlens += 1\n\n\ndef append_kv_fake"  # the last line of append_kv


def test_writing_after_the_increment_is_named(build):
    m = build(("    pos = cache_seqlens.long()\n",
               "    cache_seqlens += 1\n    pos = cache_seqlens.long()\n"),
              (END, "\n\ndef append_kv_fake"))
    fails_visibly(KV, m.register_append_kv, "k_cache after", "cache_seqlens + 1")


def test_lengths_not_moved_on_is_named(build):
    m = build((END, "\n\ndef append_kv_fake"))
    fails_visibly(KV, m.register_append_kv, "cache_seqlens did not change", "in place")


def test_writing_into_a_reshaped_copy_is_named(build):
    """Right on contiguous caches, lost on views: the hidden case, run here directly."""
    m = build(("    v_cache[page, row] = v\n",
               "    v_cache.reshape(-1, *v_cache.shape[2:])[page * page_size + row] = v\n"))
    assert grader.check(KV, m.register_append_kv).passed >= 2  # contiguous: reshape is a view
    case = ch12._append_case("views", [(2, 2, 4, 2, 8, "float32", 0, {})], strided=True)
    with pytest.raises(ch12.CheckFailure, match="v_cache after the eager, strided") as info:
        case(grader.as_candidate(m.register_append_kv, ch12.kv_cache_write))
    assert "COPY" in info.value.hint


def test_returning_the_cache_is_named(build):
    m = build(("v: torch.Tensor, block_table: torch.Tensor) -> None:",
               "v: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:"),
              (END, "    cache_seqlens += 1\n    return k_cache\n\n\ndef append_kv_fake"))
    fails_visibly(KV, m.register_append_kv, "returns nothing")
