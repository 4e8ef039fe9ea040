"""Warm starts (course_utils.grading.sandbox.zygote): a forked worker is the process a cold
start would have made: the grader's child, alone in its session, holding only its own
descriptors, with its own environment and random streams, locked in and verified; and the
zygote is never killed with a worker, ends with the grader, and can be switched off."""

import os
import signal
import subprocess
import sys
import time

import pytest

from course_utils.grading import sandbox
from course_utils.grading.sandbox import zygote

pytestmark = pytest.mark.skipif(not zygote.enabled(), reason="zygotes need Linux")

PRINT_STATE = ("import os, torch, numpy\n"
               "print('STATE', os.environ['HOME'], torch.rand(1).item(), numpy.random.rand(),"
               " torch.get_num_threads())")


def _run(tmp_path, cells, protected=None):
    """Start a worker for ``cells``, run them, return (worker, its log)."""
    keep = frozenset(sandbox.descendants(os.getpid()))
    worker = sandbox.start_worker(tmp_path, {"cells": cells}, sandbox.Limits(), keep, protected)
    try:
        worker.send({"op": "go"})
        worker.deadline = time.monotonic() + 120
        while not worker.recv()[0].get("done"):
            pass
        log = (worker.scratch / "worker.log").read_text()
    except BaseException:
        worker.stop()
        raise
    return worker, log


def _stat(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rfind(b")") + 2:].split()
    return {"ppid": int(fields[1]), "pgrp": int(fields[2]), "session": int(fields[3])}


def test_a_forked_worker_is_the_graders_own_child_in_its_own_session(tmp_path):
    keep = frozenset(sandbox.descendants(os.getpid()))
    worker = sandbox.start_worker(tmp_path, {"cells": []}, sandbox.Limits(), keep, None)
    try:  # locked in, waiting for "go"
        assert isinstance(worker.proc, zygote.ForkedProcess), "the zygote did not serve"
        stat = _stat(worker.proc.pid)
        assert stat["ppid"] == os.getpid(), "adopted by the grader (a subreaper)"
        assert stat["session"] == stat["pgrp"] == worker.proc.pid
        fds = sorted(int(fd) for fd in os.listdir(f"/proc/{worker.proc.pid}/fd"))
        assert fds == [0, 1, 2, 3, 4], f"inherited descriptors: {fds}"
        assert worker.proc.poll() is None
    finally:
        worker.stop()
    assert worker.proc.poll() is not None
    assert all(z.alive() for z in zygote._ZYGOTES.values()), "a zygote died with a worker"


def test_each_worker_has_its_own_environment_and_random_streams(tmp_path):
    states = []
    for _ in range(2):
        worker, log = _run(tmp_path, [PRINT_STATE])
        worker.stop()
        line = next(line for line in log.splitlines() if line.startswith("STATE"))
        home, torch_draw, numpy_draw, threads = line.split()[1:]
        assert home == str(worker.scratch / "home")
        assert threads == "1", "the zygote's single thread is what a worker computes on"
        states.append((torch_draw, numpy_draw))
    assert states[0][0] != states[1][0] and states[0][1] != states[1][1], states


@pytest.mark.skipif(sandbox.landlock_abi() < 1, reason="no Landlock here")
def test_a_forked_worker_is_locked_and_verified(tmp_path):
    keep = frozenset(sandbox.descendants(os.getpid()))
    worker = sandbox.start_worker(tmp_path, {"cells": []}, sandbox.Limits(), keep,
                                  [str(sandbox.PACKAGE.parent)])
    try:
        assert isinstance(worker.proc, zygote.ForkedProcess)
        assert worker.verified, worker.isolation
    finally:
        worker.stop()


def test_a_dead_zygote_is_replaced_and_can_be_switched_off(tmp_path, monkeypatch):
    worker, _ = _run(tmp_path, ["x = 1"])
    worker.stop()
    first = zygote._ZYGOTES["worker"]
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait(timeout=10)
    worker, _ = _run(tmp_path, ["x = 1"])
    worker.stop()
    assert isinstance(worker.proc, zygote.ForkedProcess)
    assert zygote._ZYGOTES["worker"] is not first
    monkeypatch.setenv("COURSE_ZYGOTE", "0")
    worker, _ = _run(tmp_path, ["x = 1"])
    worker.stop()
    assert isinstance(worker.proc, subprocess.Popen), "COURSE_ZYGOTE=0 starts from nothing"


def test_the_zygote_ends_with_its_grader(tmp_path):
    code = ("import os, sys, time\n"
            "from course_utils.grading.sandbox import zygote\n"
            "z = zygote.get('worker', lambda: zygote.Zygote(['json'], [], dict(os.environ)))\n"
            "print(z.proc.pid, flush=True)\n"
            "time.sleep(600)\n")
    grader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(grader.stdout.readline())
        assert _stat(pid)["ppid"] == grader.pid
    finally:
        grader.kill()
        grader.wait()
    for _ in range(200):  # the zygote reads the socket's end and exits
        try:
            os.kill(pid, 0)
            if open(f"/proc/{pid}/stat").read().split(") ")[1].startswith("Z"):
                break
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the zygote outlived its grader")
    try:  # adopted by this process where it is a subreaper: reap it
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
