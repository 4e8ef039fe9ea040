"""The grading process bounds what a candidate returns before it reads it.

Whatever a candidate returns (tensors, arrays, numbers, strings, lists, dicts: decoded from the
worker's message when a notebook is graded) is read by the grader's own code. These tests hand
every exercise that reads such data adversarial answers: a list of 10**6 items, a 4-byte tensor
expanded to 2**30 elements, an ``as_strided`` view whose elements overlap, a huge tensor of the
wrong shape, a list nested 10**5 levels deep, and broadcast or overlapping views of the shape a
case expects. Each must score 0, every case failing with a ``CheckFailure`` (a message that
says what was wrong, not a crash of the grader's code), in a few seconds and without the
process's memory growing by more than about 100 MB.

The candidates stand where the sandboxed worker stands: calls return the payload in the
structure the exercise asks for (a pair, a triple), and every ``harness`` helper a case invokes
(traced launches, measured calls, Triton probes, compiled runs) answers with forged data, as a
notebook that replaced those helpers could make its worker answer. Kernels launched by a case
write nothing. Exercises whose cases only read buffers the grader allocated itself (kernels
writing their outputs in place, CUDA sources compiled here) are listed in ``NOTHING_RETURNED``.
"""

import resource
import threading
import time

import numpy as np
import pytest
import torch

from course_utils import checks, grader, specs
from course_utils.grading.checks import CheckFailure

SECONDS = 20.0  # one exercise, every case, hidden ones included
MEGABYTES = 100.0  # growth of the resident memory while it runs

# ----------------------------------------------------------------------------- payloads


def _first_tensor(args):
    return next((a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2), None)


def _deep(depth=100_000):
    nested = []
    for _ in range(depth):
        nested = [nested]
    return nested


LONG, DEEP = [1] * 10**6, _deep()  # built once: the grader only reads them


def _broadcast_like(args):
    t = _first_tensor(args)
    return torch.zeros(1).expand(t.shape) if t is not None else torch.zeros(1).expand(2**30)


def _overlap_like(args):
    """A view of the first tensor argument's shape whose strides are all 1: its elements
    overlap (its storage holds sum(n - 1) + 1 floats, not prod(n))."""
    t = _first_tensor(args)
    shape = tuple(t.shape) if t is not None else (2048, 2048)
    return torch.zeros(sum(n - 1 for n in shape) + 1).as_strided(shape, (1,) * len(shape))


PAYLOADS = {
    "list of 10**6 items": lambda args: LONG,
    "4 bytes expanded to 2**30 elements": lambda args: torch.zeros(1).expand(2**30),
    "overlapping as_strided view": lambda args: torch.zeros(4096).as_strided((2048, 2048),
                                                                             (1, 1)),
    "huge tensor of the wrong shape": lambda args: torch.zeros(1).expand(2**15, 2**15),
    "numpy array broadcast to 2**30 elements": lambda args: np.broadcast_to(np.zeros(1),
                                                                             (2**30,)),
    "list nested 10**5 deep": lambda args: DEEP,
    "broadcast view of the input's shape": _broadcast_like,
    "overlapping view of the input's shape": _overlap_like,
}

# ----------------------------------------------------------------------------- candidates


def ret(p, args):
    return p


def pair(p, args):
    return (p, p)


def triple(p, args):
    return (p, p, p)


def each(form):
    """One ``form`` per item of the helper's first argument (a probe's list of inputs)."""
    return lambda p, args: [form(p, args) for _ in args[0]]


def fields(*keys, **forms):
    """A dict of ``keys`` (the payload each) and ``forms`` (built from the payload)."""
    return lambda p, args: {**{k: p for k in keys}, **{k: f(p, args) for k, f in forms.items()}}


def _counts(*names):
    return fields(**{n: fields("reads", "writes", "value") for n in names})


class Forged(grader.LocalCandidate):
    """The student's side of grading answering with forged data.

    ``obj`` is a function (or a tuple of them) carrying ``call`` (the form of what a call
    returns) and ``helpers`` (harness helper name -> form); a form maps the payload and the
    call's arguments to the value sent back.
    """

    def _spec(self):
        return self.obj[0] if isinstance(self.obj, tuple) else self.obj

    def __call__(self, *args, **kwargs):
        spec = self._spec()
        return spec.call(spec.payload(args), args)

    def _launch(self, launch_config, args):
        return None  # a kernel that writes nothing

    def invoke(self, target, *args, **kwargs):
        name = target.rpartition(":")[2]
        if name in ("stub_reason", "jit_problem"):
            return ""
        if name == "source_text":
            return "// no source"
        spec = self._spec()
        form = spec.helpers.get(name, spec.call)
        return form(spec.payload(args), args)


def forged(ex, payload, call=ret, helpers=None, pair_of=False):
    def student(*args, **kwargs):
        raise AssertionError("the forged candidate's function is never run")

    student.payload, student.call, student.helpers = payload, call, helpers or {}
    one = Forged(student, ex.forbidden, ex.torch_only)
    return (one, Forged(student, ex.forbidden, ex.torch_only)) if pair_of else one


# id -> (what a call returns, harness helpers' answers, whether the candidate is a pair)
FORMS = {
    "00.elements_touched": (ret, {}, False),
    "01.naive_attention": (ret, {}, False),
    "01.split_merge_heads": (ret, {}, True),
    "01.memory_formula": (ret, {}, False),
    "02.stable_softmax": (ret, {}, False),
    "02.online_softmax": (ret, {}, False),
    "02.merge_states": (triple, {}, False),
    "02.online_attention_row": (pair, {"largest_fresh_tensor": lambda p, a: ((p, p), p)}, False),
    "02.softmax_kernel": (ret, {"count_accesses": _counts("x", "out", "lse")}, False),
    "03.arithmetic_intensity": (ret, {}, False),
    "03.bound": (pair, {}, False),
    "03.next_wave": (ret, {}, False),
    "03.efficient_size": (ret, {}, False),
    "03.layernorm_bytes": (pair, {}, False),
    "03.in_flight": (triple, {}, False),
    "03.fused_kernel": (ret, {"count_accesses": _counts("x", "y")}, False),
    "04.tiled_qk": (ret, {"traced_qk": fields("S", "q_sectors", "k_sectors", "summary")},
                    False),
    "04.global_reads": (ret, {}, False),
    "04.register_qk": (ret, {"traced_register_qk": fields(
        "S", "q_loads", "k_loads", "s_stores", "shared_loads", "shared_lines", "barriers",
        "races", "race_examples", "summary")}, False),
    "05.sectors_per_request": (ret, {}, False),
    "05.swizzled_transpose": (ret, {"traced_transpose": fields(
        "dst", "src_load_sectors", "dst_store_sectors", "shared_requests", "worst_conflict",
        "worst_line", "worst_source", "shared_bytes", "summary")}, False),
    "06.launch_bounds": (ret, {}, False),
    "06.flash_budget": (pair, {}, False),
    "07.torch_forward": (pair, {"largest_tensor": triple}, False),
    "07.causal_skip": (pair, {}, False),
    "08.delta": (ret, {"call_and_largest": pair}, False),
    "08.torch_backward": (triple, {}, False),
    "08.causal_skip": (pair, {}, False),
    "09.window_split": (ret, {"window_split_bounds": each(lambda p, a: (p, p, p, p))}, False),
    "09.window_inner": (ret, {"run_window_forward": pair}, False),
    "09.gqa_dkdv": (ret, {"run_gqa_dkdv": pair}, False),
    "10.fragment_map_k32": (ret, {"map_table": ret}, False),
    "10.warp_loop": (ret, {"traced_forward": lambda p, a: (p, p, {"a": p, "b": p, "c": p, "d": p,
                                                                  "calls": p})}, False),
    "10.swizzle_64b": (ret, {"offset_table": ret}, False),
    "10.wait_placement": (ret, {}, False),
    "11.shared_prefix": (pair, {"prefix_reads": lambda p, a: ((p, p), p, p)}, False),
    "11.chunked_mask": (pair, {}, False),
    "11.num_splits": (ret, {}, False),
    "11.split_plan": (ret, {}, False),
    "11.paged_prefill": (ret, {"run_paged_prefill": pair}, False),
    "12.varlen_fake": (ret, {"run_varlen_fake": each(fields(outputs=pair))}, False),
    "12.autograd_registration": (ret, {"run_softcap_autograd": fields(
        "graphs", "opcheck", eager=triple, compiled=each(triple))}, True),
    "12.no_graph_break": (ret, {"run_compiled": fields("graphs", outputs=each(ret))}, False),
    "12.kv_cache_write": (ret, {"run_append_kv": fields(
        "schema", "fake", "graphs", "opcheck",
        eager=each(fields("k_cache", "v_cache", "cache_seqlens", "returned", "outside_view")),
        compiled=lambda p, a: [fields("k_cache", "v_cache", "cache_seqlens")(p, a)
                               for _ in a[1]])}, False),
    "13.zigzag_chunks": (triple, {}, False),
    "13.ring_forward": (pair, {"defining_cell": ret}, False),
    "13.ring_backward": (triple, {"defining_cell": ret}, False),
    "13.causal_schedule": (pair, {}, False),
    "14.descriptors": (ret, {}, False),
    "14.consumer_loop": (ret, {}, False),
}

# The cases of these only read what the grader allocated itself: output buffers a kernel
# writes in place (sized by the grader, copied back region by region), or CUDA sources that
# are compiled here and run only on a GPU.
NOTHING_RETURNED = {"00.vector_add", "00.matrix_add", "04.cuda_tiled_qk", "06.no_local_memory",
                    "07.online_update", "07.combine_splits", "08.dkdv_accumulate",
                    "10.warp_loop_cuda"}

# ----------------------------------------------------------------------------- measuring


def _rss_bytes():
    """The resident memory now (Linux); 0 elsewhere, where only ``ru_maxrss`` is measured."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


class _PeakMemory:
    """The largest growth of the resident memory while the block runs, sampled every 2 ms (and
    the growth of ``ru_maxrss``, which only grows past the process's earlier peak)."""

    def __enter__(self):
        self.base, self.peak = _rss_bytes(), 0
        self.maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, _rss_bytes() - self.base)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, _rss_bytes() - self.base)
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self.maxrss) * 1024
        self.megabytes = max(self.peak, grown) / 2**20


def _grade(ex, candidate, monkeypatch):
    """``grader.evaluate`` of every case, hidden ones too: the result, the seconds it took, the
    memory it grew by, and each case's own (status, message)."""
    statuses, run_case = {}, grader._run_case

    def recorded(case, candidate):
        statuses[case.name] = run_case(case, candidate)
        return statuses[case.name]

    monkeypatch.setattr(grader, "_run_case", recorded)
    with _PeakMemory() as memory:
        start = time.perf_counter()
        result = grader.evaluate(ex, candidate, hidden_run=True)
        seconds = time.perf_counter() - start
    monkeypatch.setattr(grader, "_run_case", run_case)
    return result, seconds, memory.megabytes, statuses


# ----------------------------------------------------------------------------- the matrix


def test_every_exercise_is_covered():
    ids = set(specs.all_exercises())
    assert set(FORMS) | NOTHING_RETURNED == ids, (ids - set(FORMS) - NOTHING_RETURNED,
                                                 set(FORMS) - ids)
    assert not set(FORMS) & NOTHING_RETURNED


@pytest.mark.parametrize("exercise_id", sorted(FORMS))
def test_adversarial_answers_score_zero_in_bounded_time_and_memory(exercise_id, monkeypatch):
    ex = specs.get(exercise_id)
    call, helpers, pair_of = FORMS[exercise_id]
    slow, fat, crashed = [], [], []
    for name, payload in PAYLOADS.items():
        candidate = forged(ex, payload, call, helpers, pair_of)
        result, seconds, megabytes, statuses = _grade(ex, candidate, monkeypatch)
        assert result.score == 0, (name, result)
        assert len(statuses) == len(ex.cases), (name, result)  # none stopped the rest
        if seconds > SECONDS:
            slow.append((name, round(seconds, 1)))
        if megabytes > MEGABYTES:
            fat.append((name, round(megabytes)))
        # every case, not only the first failing one, explains itself with a CheckFailure
        for case, (status, message) in statuses.items():
            if status != "failed" or not message:
                crashed.append((name, case, status, message[:300]))
    assert not crashed, crashed
    assert not slow, slow
    assert not fat, fat


# ----------------------------------------------------------------------------- what they say


def _message(exercise_id, payload, call=ret, helpers=None, pair_of=False):
    ex = specs.get(exercise_id)
    result = grader.evaluate(ex, forged(ex, payload, call, helpers, pair_of), hidden_run=True)
    assert result.status == "failed" and result.score == 0, result
    return result.message


def test_a_broadcast_output_is_named_before_it_is_converted():
    message = _message("01.naive_attention", _broadcast_like)
    assert "broadcast view: stride 0" in message and ".contiguous()" in message, message


def test_an_overlapping_output_is_named():
    message = _message("02.stable_softmax", _overlap_like)
    assert "overlapping strides (1, 1)" in message, message


def test_a_huge_output_of_the_wrong_shape_is_named_by_its_shape():
    message = _message("02.merge_states", PAYLOADS["huge tensor of the wrong shape"], triple)
    assert "m has shape (32768, 32768), expected (4,)" in message, message


def test_a_long_table_is_refused_by_its_length():
    message = _message("10.fragment_map_k32", PAYLOADS["list of 10**6 items"], ret,
                       {"map_table": ret})
    assert "level 0 holds 1000000 items; expected shape (32, 16, 2)" in message, message


def test_a_deep_list_is_refused_without_recursion():
    message = _message("10.swizzle_64b", PAYLOADS["list nested 10**5 deep"], ret,
                       {"offset_table": ret})
    assert "the table of your offsets" in message, message


# ----------------------------------------------------------------------------- simulators


def test_the_wait_placement_replay_is_linear():
    from course_utils.grading.specs import ch10

    n = 500_000  # 10**6 ops: the quadratic replay took hours on this
    ops = [("commit",)] * n + [("wait", 0)] * n
    start = time.perf_counter()
    why, _, _ = ch10.simulate(ops, 5, 2)
    assert time.perf_counter() - start < 10, "the replay is no longer linear"
    assert "0 of 5 tiles" in why
    ex = specs.get("10.wait_placement")
    start = time.perf_counter()
    result = grader.evaluate(ex, grader.LocalCandidate(lambda n_tiles, stages: ops),
                             hidden_run=True)
    assert time.perf_counter() - start < 2
    assert result.score == 0 and f"returned {2 * n} ops" in result.message, result.message


def test_an_absurd_size_is_not_simulated():
    ex = specs.get("03.efficient_size")
    start = time.perf_counter()
    result = grader.evaluate(ex, grader.LocalCandidate(lambda *args: 10**9), hidden_run=True)
    assert time.perf_counter() - start < 10
    assert result.score == 0 and "far from any efficient size" in result.message, result.message


def test_window_split_bounds_far_outside_the_keys_are_refused():
    ex = specs.get("09.window_split")
    helpers = {"window_split_bounds": each(lambda p, a: (0, 0, 0, 10**18))}
    result = grader.evaluate(ex, forged(ex, lambda args: None, ret, helpers), hidden_run=True)
    assert result.score == 0 and "hi = 1000000000000000000 is outside" in result.message


# ----------------------------------------------------------------------------- the helpers


def test_validated_reads_no_data():
    big = torch.zeros(1).expand(2**30)
    with pytest.raises(CheckFailure, match="broadcast view"):
        checks.validated(big, (2**30,), what="O")
    with pytest.raises(CheckFailure, match=r"O has shape \(1073741824,\) but should have shape"):
        checks.validated(big, (4, 4), what="O")
    with pytest.raises(CheckFailure, match="overlapping strides"):
        checks.validated(torch.zeros(64).as_strided((8, 8), (1, 1)), (8, 8), what="O")
    with pytest.raises(CheckFailure, match="more than the 1000 this answer can need"):
        checks.validated(torch.zeros(2000), (None,), what="t", max_elements=1000)


def test_validated_accepts_honest_layouts():
    t = torch.randn(3, 4)
    assert checks.validated(t.T, (4, 3), what="x") is not None  # a transpose
    assert checks.validated(t[:, ::2], (3, 2), what="x").shape == (3, 2)  # a strided slice
    assert checks.validated(torch.zeros(1, 5).expand(1, 5), (1, 5), what="x").shape == (1, 5)
    assert checks.validated(np.arange(10.0)[::-2], (5,), what="x").tolist() == [9, 7, 5, 3, 1]
    assert checks.validated([[1, 2], [3, 4]], (None, 2), what="x").tolist() == [[1, 2], [3, 4]]
    assert checks.validated(2.5, (), what="x").item() == 2.5
    assert checks.validated(torch.zeros(5, 0), (5, 0), what="x").numel() == 0


def test_validated_refuses_numpy_views_outside_their_memory():
    base = np.zeros(10)
    outside = np.lib.stride_tricks.as_strided(base, (100,), (8,))
    with pytest.raises(CheckFailure, match="reaches outside the 80 bytes"):
        checks.validated(outside, (100,), what="a")
    with pytest.raises(CheckFailure, match="ragged"):
        checks.validated([[1, 2], [3]], (2, 2), what="a")
    with pytest.raises(CheckFailure, match="not a tensor or array of numbers"):
        checks.validated("abc", (), what="a")


def test_brief_describes_without_reading():
    assert checks.brief((3, 4)) == "(3, 4)" and checks.brief((3,)) == "(3,)"
    assert checks.brief([1] * 10**6) == "a list of 1000000 items"
    assert checks.brief(torch.zeros(1).expand(2**30)) == "a tensor of shape (1073741824,) " \
        "(float32)"
    assert checks.brief(_deep()) == "[[[a list of 1 item]]]"
    assert len(checks.brief("x" * 10**6)) < 150
    assert checks.brief(10**5000).startswith("an int of")


def test_sequence_and_whole_number():
    with pytest.raises(CheckFailure, match="has 1000000 values; expected 2"):
        checks.sequence([0] * 10**6, 2, what="r")
    with pytest.raises(CheckFailure, match="a tensor of shape"):
        checks.sequence(torch.zeros(1).expand(2**30), 2, what="r")
    assert checks.whole_number(torch.tensor([7]), what="n") == 7
    with pytest.raises(CheckFailure, match="not a whole number"):
        checks.whole_number(2.0, what="n")
    with pytest.raises(CheckFailure, match="outside 0 .. 3"):
        checks.whole_number(9, what="n", low=0, high=3)
