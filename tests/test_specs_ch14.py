"""Chapter 14's graded cases catch the mistakes of a TMA ring, with advice that names the fix."""

import pytest

from course_utils import grader

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)


def right(j, stages):
    return j % stages, (j // stages) % 2, 1 - (j // stages) % 2


def same_parity_for_producer(j, stages):  # forgets that a fresh barrier passes parity 1
    return j % stages, (j // stages) % 2, (j // stages) % 2


def parity_per_tile(j, stages):  # flips every tile instead of every pass
    return j % stages, j % 2, 1 - j % 2


def two_buffers_always(j, stages):
    return j % 2, (j // stages) % 2, 1 - (j // stages) % 2


def parities_swapped(j, stages):
    return j % stages, 1 - (j // stages) % 2, (j // stages) % 2


def not_a_tuple(j, stages):
    return j % stages


def test_right_answer_passes():
    r = grader.check("14.ring_parity", right)
    assert r.status == "passed" and r.hidden_run and r.passed == r.total


def test_producer_waiting_for_parity_0_deadlocks_at_once():
    r = grader.check("14.ring_parity", same_parity_for_producer)
    assert r.status == "failed" and r.passed == 0
    assert "deadlock" in r.message and "producer at tile 0 waits for parity 0" in r.message
    assert "fresh mbarrier" in r.message


def test_parity_per_tile_reads_a_buffer_before_it_is_filled():
    r = grader.check("14.ring_parity", parity_per_tile)
    assert r.status == "failed" and "every `stages` tiles" in r.message
    assert "deadlock" in r.message or "held" in r.message


def test_wrong_buffer_is_caught_with_three_stages():
    r = grader.check("14.ring_parity", two_buffers_always)
    assert r.status == "failed" and "j % stages" in r.message
    assert r.passed == 3  # the three 2-stage cases cannot tell; 1, 3 and 4 stages can


def test_swapped_parities_read_nothing():
    r = grader.check("14.ring_parity", parities_swapped)
    assert r.status == "failed" and "held nothing yet" in r.message


def test_malformed_answer_says_what_was_expected():
    r = grader.check("14.ring_parity", not_a_tuple)
    assert r.status == "failed"
    assert "expected a tuple (buffer, full_parity, empty_parity)" in r.message
