"""The ring's wire: process-group lookups, the point-to-point exchange of one step (one tag per
stream), the knobs that change how a step posts and sends (environment variables), and the
per-step clock of the timeline plot.

Its own room: what the forward, the backward and the workers share about *moving* blocks, apart
from what they compute; it imports nothing else of ``ring``.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

TAG_KV, TAG_DKV = 0, 1  # gloo matches a send to a recv by (peer, tag): one tag per stream
KNOBS = {"DKV_WIRE": ("float32", "working"), "POST": ("before", "after")}


def knob(name):
    """The value of ``COURSE_RING_<name>`` (the first of :data:`KNOBS`' choices when unset);
    any other value is a ValueError."""
    choices = KNOBS[name]
    value = os.environ.get(f"COURSE_RING_{name}", "").strip() or choices[0]
    if value not in choices:
        raise ValueError(f"COURSE_RING_{name}={value!r}: use one of {choices}")
    return value


def _group_info(group):
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: run inside ring.launch(...) or "
                           "after dist.init_process_group")
    return dist.get_rank(group), dist.get_world_size(group)


def _peer(group, rank):
    """The global rank of ``rank`` in ``group`` (P2P ops take global ranks)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _exchange(sends, recvs, group, next_rank, prev_rank):
    """Post sends to the next rank and receives from the previous one: a list of works."""
    ops = [dist.P2POp(dist.isend, t, next_rank, group, tag) for t, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, prev_rank, group, tag) for t, tag in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


class _Clock:
    """Per-step events ``{"step", "what", "start", "end"}`` (seconds) for the timeline plot.

    Only when a list is passed: then it synchronises the current CUDA stream around each event,
    so that a timed compute is the kernels', not their launch. Only that stream: NCCL's
    transfers run on their own, and a device-wide synchronise would add them to the compute.
    """

    def __init__(self, events, device):
        self.events, self.cuda = events, device.type == "cuda"

    def __call__(self, step, what):
        return _Event(self, step, what)


class _Event:
    def __init__(self, clock, step, what):
        self.clock, self.step, self.what = clock, step, what

    def __enter__(self):
        if self.clock.events is not None:
            if self.clock.cuda:
                torch.cuda.current_stream().synchronize()
            self.start = time.perf_counter()

    def __exit__(self, *exc):
        if self.clock.events is not None:
            if self.clock.cuda:
                torch.cuda.current_stream().synchronize()
            self.clock.events.append({"step": self.step, "what": self.what,
                                      "start": self.start, "end": time.perf_counter()})
