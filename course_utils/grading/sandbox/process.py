"""Process control and limits: the worker's process tree, its memory and its files on disk.

The grader's side finds every process below a worker (:func:`descendants`), measures their
memory together (PSS), kills the whole tree (:func:`kill_tree`) and adopts orphans
(:func:`set_subreaper`); :class:`Limits` says how long and how much one notebook may take. The
worker's side sets its own rlimits and volunteers for the OOM killer. Its own room: plain Linux
process bookkeeping that knows nothing of messages, notebooks or Landlock (the ranks of
:mod:`course_utils.grading.ranks` use it too).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from dataclasses import dataclass


def _proc_children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc)."""
    if not os.path.isdir("/proc"):
        return []
    children, found, todo = _proc_children(), [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def _rss_bytes(pids) -> int:
    """The memory of ``pids`` together, each shared page counted once (Linux PSS).

    Resident sizes would count a page shared by a forked child twice: twenty sleeping children
    of a worker that holds torch would "use" 4 GiB. The proportional set size splits each shared
    page between its users, so the sum is what the processes really hold; ``statm``'s resident
    size is the fallback where ``smaps_rollup`` is missing (Linux < 4.14).
    """
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                for line in f:
                    if line.startswith(b"Pss:"):
                        total += int(line.split()[1]) << 10
                        break
            continue
        except (OSError, ValueError, IndexError):
            pass
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            pass
    return total


def set_subreaper() -> bool:
    """Make this process adopt the orphans of its descendants (Linux), so none escape."""
    if sys.platform != "linux":
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0


def kill_tree(root_pid: int, keep=frozenset()) -> None:
    """SIGKILL ``root_pid``'s process group and every descendant of this process not in
    ``keep``, then reap those that are ours."""
    try:
        os.killpg(root_pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for _ in range(20):
        victims = [p for p in descendants(os.getpid()) if p not in keep]
        if not victims:
            break
        for p in victims:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in victims:
            try:
                os.waitpid(p, 0)
            except ChildProcessError:
                pass
        time.sleep(0.01)


def _exit_reason(code) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class Limits:
    """How long and how much one notebook may take."""

    cell_seconds: float = 600.0
    exercise_seconds: float = 600.0  # the exercise's checks: the worker's time and the grader's
    notebook_seconds: float = 3600.0
    memory_mb: int = 8192
    file_mb: int = 1024
    scratch_mb: int = 4096  # what the worker's files may take on disk, all together
    message_mb: int = 256  # data one answer of the notebook may send back
    restarts: int = 4


SCRATCH_ENTRIES = 50_000  # files and folders a worker may make: more is refused as abuse


def _tree_usage(root: str, cap: int) -> tuple[int, int]:
    """(bytes on disk, entries) below ``root``, counting at most ``cap`` entries."""
    total, entries, todo = 0, 0, [root]
    while todo and entries <= cap:
        try:
            with os.scandir(todo.pop()) as it:
                for entry in it:
                    entries += 1
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += st.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        todo.append(entry.path)
        except OSError:
            continue
    return total, entries


def _apply_rlimits(limits: dict) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    fsize = limits.get("file_bytes")
    if fsize:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))


def _volunteer_for_oom_killer() -> None:
    """Ask the kernel to kill this worker, not the grader, when the machine runs out of memory.

    A container's memory limit is enforced by the OOM killer, which picks the process with the
    highest score; at 1000 that is always a worker (its children inherit the score).
    """
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
