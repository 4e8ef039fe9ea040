"""Shared by the spec tests from chapter 10 on: a slip must fail in a visible case, saying why."""

import json
import re
from pathlib import Path

from course_utils import grader

_MARKERS = re.compile(r"(?m)^[ \t]*### (BEGIN|END) SOLUTION[ \t]*\n")


def fails_visibly(exercise_id, candidate, *words, every_case=False):
    """Grade ``candidate``; it must fail in a visible case whose message holds every word.

    The message is the first failure's and the names of the other failing cases. The cases
    first run only up to the first failure (:func:`first_failure_names`); where that already
    holds every word, so does the whole message, and the rest of the cases is skipped. Else,
    and with ``every_case`` (the returned result then counts every case), all cases run.
    """
    if not every_case:
        try:
            first_failure_names(exercise_id, candidate, *words)
            return None
        except AssertionError:
            pass  # a word may name a later failing case: the whole check decides
    r = grader.check(exercise_id, candidate)
    assert r.status == "failed", (r.status, r.message)
    assert not r.message.startswith("(hidden case)"), r.message
    for word in words:
        assert word in r.message, (word, r.message)
    return r


def first_failure_names(exercise_id, candidate, *words):
    """What ``fails_visibly`` asserts of a slip, sooner: the cases run in the grader's order
    until the first that does not pass, which must be a visible case that fails with every
    word in its message. (The cases after it would only add names to "also failing", which a
    slip's test does not read; ``fails_visibly`` runs them all where a test counts them.)"""
    from course_utils.grading.specs import get

    ex = get(exercise_id)
    hidden_run = grader.grading()
    candidate = grader.as_candidate(candidate, ex)
    for case in ex.cases:
        if case.hidden and not hidden_run:
            continue
        status, message = grader._run_case(case, candidate)
        if status == "passed":
            continue
        assert status == "failed", (case.name, status, message)
        assert not case.hidden, f"the first failing case is hidden: {case.name}: {message}"
        for word in words:
            assert word in message, (word, message)
        return case.name, message
    raise AssertionError(f"{exercise_id}: this slip passes every case")


def stub(*args):
    """The exercise notebook's starting point."""
    raise NotImplementedError("replace this line with your code")


def module_builder(folder, base, stem):
    """``make(*edits)``: import ``base`` (a solution's code) with ``(old, new)`` edits applied,
    as a fresh module under ``folder``. Each ``old`` must occur, so that a slip test cannot
    silently test the right answer."""
    import importlib.util

    count = [0]

    def make(*edits):
        text = base
        for old, new in edits:
            assert old in text, f"the solution no longer contains {old!r}"
            text = text.replace(old, new)
        count[0] += 1
        path = folder / f"{stem}_variant_{count[0]}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return make


def solution_source(path, keep) -> str:
    """The code cells of the solution notebook at ``path`` for which ``keep(source)`` holds,
    joined, with the solution markers removed: the module that ``module_builder`` edits."""
    cells = json.loads(Path(path).read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    return _MARKERS.sub("", "\n\n".join(s for s in sources if keep(s)))


def solution_kernel(path, name) -> str:
    """The CUDA source (markers kept: they are comments) of the solution notebook's cell at
    ``path`` that defines ``__global__ void name``."""
    for cell in json.loads(Path(path).read_text())["cells"]:
        text = "".join(cell["source"])
        if f"void {name}(" in text and "BEGIN SOLUTION" in text:
            quote = "r'''" if "r'''" in text else 'r"""'
            return text.split(quote, 1)[1].split(quote[1:], 1)[0]
    raise LookupError(f"no solution cell of {path} defines {name}")


def poison_free_cuda_memory(nbytes=1 << 26):
    """Fill a block of the CUDA caching allocator with NaN and hand it back: the next tensors
    a kernel allocates itself start as NaN, so an element it forgets to write shows."""
    import torch

    junk = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del junk


def forward_matches_float64(forward, B, H, Nq, Nk, D, causal, big):
    """A bf16 forward ``forward(Q, K, V) -> (O, LSE)`` (top-left causal as given) on fresh random
    inputs, Q scaled by ``big`` (large logits), against the float64 reference, with the
    allocator's free memory poisoned first: O every element written and close, LSE close where a
    row sees a key and -inf where it sees none."""
    import torch

    from course_utils import reference

    Q = (torch.randn(B, H, Nq, D, device="cuda") * big).bfloat16()
    K = torch.randn(B, H, Nk, D, device="cuda").bfloat16()
    V = torch.randn(B, H, Nk, D, device="cuda").bfloat16()
    poison_free_cuda_memory()
    O, lse = forward(Q, K, V)
    O_ref, lse_ref = reference.attention(Q, K, V, causal=causal)
    seen = torch.isfinite(lse_ref)
    assert torch.isfinite(O).all(), "an element of O was never written (NaN from the poison)"
    torch.testing.assert_close(O.double(), O_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double()[seen], lse_ref[seen], atol=1e-2 * big, rtol=1e-3)
    assert torch.isneginf(lse[~seen]).all()


# ----------------------------------------------------------------------------- named mistakes
# Chapters 00-09 list the slips students make as ``NAMED_MISTAKES`` in their spec tests; each
# one must fail a *visible* case with a hint that names it (tests/test_named_mistakes.py counts
# at least three per exercise).


class Slip:
    """A wrong answer a student writes: ``make()`` builds it (a function, kernel, source or
    value, as the exercise's check takes it); grading it must fail in a visible case whose
    message holds every one of ``words`` (the mistake's name from the hint, usually)."""

    def __init__(self, exercise_id, name, make, *words):
        self.exercise_id, self.name, self.make, self.words = exercise_id, name, make, words

    def __repr__(self):
        return f"{self.exercise_id}: {self.name}"

    def fails(self):
        return first_failure_names(self.exercise_id, self.make(), *self.words)


def source_has(text, lines, update="this test's mirror"):
    """Each of ``lines`` is in ``text``, a kernel's source that a test mirrors or models in
    Python: a line that moved or changed fails here, naming what to ``update``, rather than
    leaving the test checking a kernel that no longer exists."""
    for line in lines:
        assert line in text, f"the .cu no longer has {line!r}: update {update}"
