"""Per-sequence splits for a ragged batch (FlashInfer's plan/run): :class:`DecodePlan`, the
work list the split kernel runs on, :func:`decode_plan` (balanced, about one wave) and
:func:`make_plan` (any valid work list, checked).

Its own room: host-side arithmetic on the lengths alone, no tensor on the GPU and no launch.
"""

from __future__ import annotations

import torch

from .flash_decoding_common import MIN_SPLIT_BLOCKS
from .flash_decoding_host import _options, _sm_count, decode_config, decode_programs_per_sm

# =============================================================================================
# Per-sequence splits: the plan (FlashInfer's plan/run)
# =============================================================================================


class DecodePlan:
    """Which keys each program of the split kernel streams: a work list made on the host.

    ``work``: ``[(b, start, end), ...]``, key range ``start .. end - 1`` of sequence b, sorted by
    sequence, each range whole ``block_n`` blocks (``end`` may be the sequence's length), the
    ranges of a sequence covering its visible keys exactly once, in order. ``splits[b]``: how
    many work items sequence b has (an idle slot, length 0, gets one empty item whose program
    writes O = 0, LSE = -inf); ``parts``: a sequence with one split
    is written by the split kernel directly, the others' splits take workspace slots
    ``offsets[b] .. offsets[b] + splits[b] - 1`` and the merge kernel combines them.
    Made by :func:`decode_plan` (balanced) or :func:`make_plan` (any valid work list: checked).
    """

    def __init__(self, lengths, kv_heads, work, *, block_n, new_tokens=1, window_left=-1):
        self.lengths = tuple(int(n) for n in lengths)
        self.kv_heads, self.block_n = int(kv_heads), int(block_n)
        self.new_tokens, self.window_left = int(new_tokens), int(window_left)
        items = [tuple(int(x) for x in item) for item in work]
        # an idle slot (no item) gets one empty item: its program writes O = 0, LSE = -inf
        has = {b for b, _, _ in items}
        items += [(b, 0, 0) for b in range(len(self.lengths)) if b not in has]
        self.work = sorted(items, key=lambda item: (item[0], item[1]))
        self.splits = [0] * len(self.lengths)
        for b, _, _ in self.work:
            self.splits[b] += 1
        self.offsets, self.num_parts = [], 0
        for s in self.splits:
            self.offsets.append(self.num_parts)
            self.num_parts += s if s > 1 else 0
        self.max_splits = max(self.splits, default=0)
        self._tensors = {}

    def __repr__(self):
        return (f"DecodePlan(B={len(self.lengths)}, Hkv={self.kv_heads}, "
                f"block_n={self.block_n}, Lq={self.new_tokens}, splits={self.splits}, "
                f"{len(self.work)} work items)")

    def programs(self):
        """Programs of the split kernel: work items x K/V heads."""
        return len(self.work) * self.kv_heads

    def tensors(self, device):
        """``(work (W, 4), splits (B,), offsets (B,))`` int32 on ``device`` (made once)."""
        key = str(device)
        if key not in self._tensors:
            rows, seen = [], [0] * len(self.lengths)
            for b, start, end in self.work:  # the parts of sequence b: offsets[b], + 1, ...
                part = -1 if self.splits[b] == 1 else self.offsets[b] + seen[b]
                seen[b] += 1
                rows.append((b, start, end, part))
            work = torch.tensor(rows or [(0, 0, 0, -1)], dtype=torch.int32).reshape(-1, 4)
            self._tensors[key] = tuple(
                t.to(device) for t in (work, torch.tensor(self.splits, dtype=torch.int32),
                                       torch.tensor(self.offsets, dtype=torch.int32)))
        return self._tensors[key]

    def check(self, B, kv_heads, new_tokens, window_left, cache_seqlens=None):
        """A ValueError if the plan was made for another shape (or, given the lengths tensor,
        other lengths): a plan's key ranges are only right for the lengths it was made for."""
        made = (len(self.lengths), self.kv_heads, self.new_tokens, self.window_left)
        if made != (B, kv_heads, new_tokens, window_left):
            raise ValueError(f"the plan was made for B={made[0]}, Hkv={made[1]}, Lq={made[2]}, "
                             f"window_left={made[3]}, this call has B={B}, Hkv={kv_heads}, "
                             f"Lq={new_tokens}, window_left={window_left}: make a plan for it "
                             "(fd.decode_plan)")
        if cache_seqlens is not None:
            lengths = tuple(cache_seqlens.tolist())
            if lengths != self.lengths:
                bad = next(b for b, (x, y) in enumerate(zip(lengths, self.lengths, strict=True))
                           if x != y)
                raise ValueError(f"the plan was made for other lengths: cache_seqlens[{bad}] = "
                                 f"{lengths[bad]}, the plan's {self.lengths[bad]}; make a new "
                                 "plan whenever the lengths change (every decoding step)")


def _visible_range(n, new_tokens, window_left, block_n):
    """Sequence of length n: ``(lo, n)``, its visible keys from ``lo`` (the first visible key
    of its first new token, rounded down to a block) to its end."""
    if n == 0:
        return 0, 0
    first = max(n - new_tokens - window_left, 0) if window_left >= 0 else 0
    return (first // block_n) * block_n, n


def make_plan(lengths, kv_heads, work, *, block_n=None, new_tokens=1, window=(-1, -1)):
    """A :class:`DecodePlan` from a work list ``[(b, start, end), ...]`` (key ranges), checked:
    sorted by sequence, each range non-empty, starting on a block boundary, ranges of a
    sequence contiguous and covering its visible keys (from the first visible key's block to
    its length) exactly once. A ValueError names the first item that breaks a rule."""
    lengths = _lengths_list(lengths)
    block_n = decode_config(torch.float16)[0] if block_n is None else int(block_n)
    left = _options(window, 0.0, None, 16)[0]
    items = [tuple(int(x) for x in item) for item in work]
    covered = {}
    for i, item in enumerate(items):
        if len(item) != 3:
            raise ValueError(f"work[{i}] = {item}: expected (b, start, end)")
        b, start, end = item
        if not 0 <= b < len(lengths):
            raise ValueError(f"work[{i}] = {item}: sequence {b} is not in 0 .. {len(lengths) - 1}")
        if i and b < items[i - 1][0]:
            raise ValueError(f"work[{i}] = {item}: the work list must be sorted by sequence")
        lo, n = _visible_range(lengths[b], new_tokens, left, block_n)
        want_start = covered.get(b, lo)
        if start != want_start or start % block_n:
            raise ValueError(f"work[{i}] = {item}: sequence {b}'s next range must start at key "
                             f"{want_start} (ranges contiguous, in order, from the first "
                             f"visible key's block {lo}, on {block_n}-key blocks)")
        if not start < end <= n or (end != n and end % block_n):
            raise ValueError(f"work[{i}] = {item}: a range ends after its start, on a block "
                             f"boundary or at the sequence's end ({n}), never past it")
        covered[b] = end
    for b, n in enumerate(lengths):
        lo, n = _visible_range(n, new_tokens, left, block_n)
        if covered.get(b, lo) != n:
            raise ValueError(f"sequence {b} (length {n}): the work list covers its keys up to "
                             f"{covered.get(b, lo)}, not up to {n}")
    return DecodePlan(lengths, kv_heads, items, block_n=block_n, new_tokens=new_tokens,
                      window_left=left)


def _lengths_list(lengths):
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype.is_floating_point or lengths.dim() != 1:
            raise TypeError(f"lengths: a 1-dim integer tensor or a list, got {lengths.dtype} "
                            f"{tuple(lengths.shape)}")
        lengths = lengths.tolist()
    out = [int(n) for n in lengths]
    if any(n < 0 for n in out):
        raise ValueError(f"lengths {out}: each >= 0")
    return out


def decode_plan(cache_seqlens, kv_heads, *, new_tokens=1, window=(-1, -1), block_n=None,
                num_sms=None, programs_per_sm=None):
    """Per-sequence split counts for a ragged batch: the plan of FlashInfer's plan/run.

    Computed on the host from the lengths (a list, or a tensor: one device-to-host copy if it
    is on the GPU; a server has them on the host anyway). Sequence b has ``blocks_b`` key
    blocks (of ``block_n`` keys; with a window only its visible ones). The split kernel runs
    ``work items x Hkv`` programs, and one wave holds ``slots = num_sms * programs_per_sm``;
    so the plan aims at ``W = max(1, slots // Hkv)`` work items of about equal size:

    * chunk = the smallest number of blocks per work item such that
      ``sum_b ceil(blocks_b / chunk) <= max(W, sequences)``, starting at
      ``ceil(sum_b blocks_b / W)`` (the ideal: every item equal) and never below
      ``MIN_SPLIT_BLOCKS`` (4) unless a sequence is shorter;
    * sequence b gets ``splits_b = ceil(blocks_b / chunk)`` items, its blocks dealt out evenly
      (item sizes differ by at most one block), so no item holds more than ``chunk`` blocks.

    A length-0 sequence (idle slot) gets one empty item. ``programs_per_sm``: default
    :func:`decode_programs_per_sm` (1; ``COURSE_DECODE_PROGRAMS_PER_SM`` overrides it);
    ``num_sms``: default this GPU's (132, an H100's, in the interpreter); ``block_n``: the
    kernel's (:func:`decode_config`).
    """
    lengths = _lengths_list(cache_seqlens)
    block_n = decode_config(torch.float16)[0] if block_n is None else int(block_n)
    left = _options(window, 0.0, None, 16)[0]
    sms = _sm_count() if num_sms is None else int(num_sms)
    per_sm = decode_programs_per_sm() if programs_per_sm is None else int(programs_per_sm)
    if kv_heads < 1 or sms < 1 or per_sm < 1 or block_n < 1:
        raise ValueError(f"kv_heads={kv_heads}, num_sms={sms}, programs_per_sm={per_sm}, "
                         f"block_n={block_n}: each >= 1")
    ranges = [_visible_range(n, new_tokens, left, block_n) for n in lengths]
    blocks = [-(-(n - lo) // block_n) for lo, n in ranges]
    target = max(1, (sms * per_sm) // kv_heads, sum(x > 0 for x in blocks))
    total = sum(blocks)
    def items(chunk):
        return sum(-(-x // chunk) for x in blocks)

    # the smallest chunk whose items fit the target, from the ideal ceil(total / target) up
    lo_chunk = max(1, -(-total // target), min(MIN_SPLIT_BLOCKS, max(blocks, default=1)))
    hi_chunk = max(lo_chunk, max(blocks, default=1))  # one item per sequence: always fits
    while lo_chunk < hi_chunk:
        mid = (lo_chunk + hi_chunk) // 2
        lo_chunk, hi_chunk = (lo_chunk, mid) if items(mid) <= target else (mid + 1, hi_chunk)
    chunk = lo_chunk
    work = []
    for b, ((lo, n), x) in enumerate(zip(ranges, blocks, strict=True)):
        s = -(-x // chunk)
        for i in range(s):  # item i: blocks floor(i x / s) .. floor((i + 1) x / s) - 1
            start = lo + (i * x // s) * block_n
            end = min(lo + ((i + 1) * x // s) * block_n, n)
            work.append((b, start, end))
    return DecodePlan(lengths, kv_heads, work, block_n=block_n, new_tokens=new_tokens,
                      window_left=left)
