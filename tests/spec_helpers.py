"""Shared by the spec tests from chapter 10 on: a slip must fail in a visible case, saying why."""

from course_utils import grader


def fails_visibly(exercise_id, candidate, *words):
    """Grade ``candidate``; it must fail in a visible case whose message holds every word."""
    r = grader.check(exercise_id, candidate)
    assert r.status == "failed", (r.status, r.message)
    assert not r.message.startswith("(hidden case)"), r.message
    for word in words:
        assert word in r.message, (word, r.message)
    return r


def stub(*args):
    """The exercise notebook's starting point."""
    raise NotImplementedError("replace this line with your code")
