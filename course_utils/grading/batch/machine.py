"""What this machine lends a class's grading: its CPU cores, its memory, its GPUs.

Read without starting anything heavy (no torch, no CUDA): the class's driver sizes ``--jobs``
from them, and the local pool gives each of its processes its own cores and GPU slot.
"""

from __future__ import annotations

import os
import shutil
import subprocess


def cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def core_sets(jobs: int) -> list[list[int]]:
    """The CPU cores of each of a pool's ``jobs`` processes: this process's cores cut into
    ``jobs`` runs of neighbours, or none (every process on every core) where there are fewer
    cores than jobs, or with ``COURSE_GRADE_PIN=0``. A notebook's worker and its grading process
    take turns: pinned to one core they keep it 99% busy, but two such pairs left to the
    scheduler left 2 cores idle a fifth of the time (``--jobs 2`` took 0.78x the time of one at
    a time on 60 notebooks, 0.53x with each on its own core; docs/instructors.md)."""
    try:
        mine = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return []
    if os.environ.get("COURSE_GRADE_PIN", "1") == "0" or not 1 < jobs <= len(mine):
        return []
    size, extra = divmod(len(mine), jobs)
    starts = [i * size + min(i, extra) for i in range(jobs + 1)]
    return [mine[starts[i]:starts[i + 1]] for i in range(jobs)]


def memory_bytes() -> int | None:
    """The memory this process's notebooks may take together: the smaller of the machine's
    available memory and its cgroup's limit (a container's); None where neither is known."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        with open("/proc/self/cgroup") as f:
            groups = [line.strip().split(":", 2) for line in f]
    except OSError:
        groups = []
    for _, controllers, path in groups:
        candidates = []
        if controllers == "":  # cgroup v2
            candidates.append(f"/sys/fs/cgroup{path}/memory.max")
        elif "memory" in controllers.split(","):
            candidates.append(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
        for c in candidates:
            try:
                with open(c) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < 1 << 60:
                found.append(int(text))
    return min(found) if found else None


def gpu_slots() -> list[str]:
    """The GPUs a class's grading may use, as ``CUDA_VISIBLE_DEVICES`` values: every MIG slice
    where a GPU is partitioned, else every GPU; ``COURSE_GRADE_GPUS="0,1"`` chooses them by
    hand, ``COURSE_GRADE_GPUS=""`` uses none. Read from ``nvidia-smi -L`` so that this process
    never starts CUDA itself (its pool's processes choose their device before they do)."""
    chosen = os.environ.get("COURSE_GRADE_GPUS")
    if chosen is not None:
        return [s.strip() for s in chosen.split(",") if s.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus, migs = [], []
    for line in listing.splitlines():
        line = line.strip()
        uuid = line.rsplit("UUID: ", 1)[-1].rstrip(")") if "UUID: " in line else ""
        if line.startswith("GPU ") and uuid:
            gpus.append(uuid)
        elif line.startswith("MIG ") and uuid:
            migs.append(uuid)
    return migs or gpus
