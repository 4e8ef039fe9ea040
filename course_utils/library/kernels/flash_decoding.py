"""Attention as it is served, in Triton: split-KV decoding and packed variable lengths (chapter 11).

Public API (import after ``course_utils.setup()``, as chapter 09's kernels)::

    O, LSE = decode_attention(q, k_cache, v_cache, cache_seqlens, block_table=None,
                              num_splits=None, window=(-1, -1), softcap=0.0, scale=None,
                              plan=None, merge=None)
    plan = decode_plan(cache_seqlens, kv_heads, new_tokens=1, window=(-1, -1))  # host side
    plan = make_plan(lengths, kv_heads, [(b, start, end), ...])  # any valid work list
    O, LSE = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal=False, window=(-1, -1), softcap=0.0, scale=None)
                              # causal: False, True (= "bottom_right"), or "top_left"
    S = default_num_splits(batch, kv_heads, seqlen_k)

Shapes, masks and the float64 references are those of :mod:`course_utils.library.serving`; the names
are those of chapters 07-09 (Q, K, V, S, P, O, m, l, LSE; ``BLOCK_M`` = Br, ``BLOCK_N`` = Bc;
``G = Hq // Hkv`` query heads per K/V head).

**Decoding (flash-decoding).** One new query per sequence: ``q (B, Hq, d)`` against a cache of
up to 128k keys; or ``q (B, Lq, Hq, d)``, Lq = 1..8 new tokens per sequence (speculative
decoding, multi-token prediction), the last Lq keys of the cache, causal among themselves
(bottom-right: token t at position ``seqlen - Lq + t``), LSE ``(B, Hq, Lq)``.
One program per (sequence, K/V head) would launch ``B * Hkv`` programs, 4 at
batch 1 with Hkv = 4, while the H100 has 132 SMs: the keys are therefore cut into
``num_splits`` ranges, and the split kernel runs on the grid ``(num_splits, Hkv, B)``:

* program ``(s, h, b)`` streams split s of sequence b's keys of K/V head h, reading each K/V row
  **once** for the G query heads that share it and the Lq new tokens: the ``G * Lq`` query rows
  (row ``t * G + g``, padded with masked rows to ``BLOCK_M >= 16``, the smallest M of
  ``tl.dot``) are the M dimension of ``S = Q K^T``; its blocks go in three stages, masked on the
  window's left edge, unmasked inside, masked on the right (the end, the new tokens' diagonal);
* it writes a normalised partial ``O_s`` and its ``LSE_s`` (float32) to a workspace;
* the merge kernel (grid ``(Hq, B)``) combines the splits with the LSE merge
  (:func:`serving.merge_partials`): ``LSE = log sum_s exp(LSE_s)``,
  ``O = sum_s exp(LSE_s - LSE) O_s``.

Decoding is memory-bound (a key row is read for G query rows: 2G flops per element loaded), so
the kernel is written for the bytes: a key row is ``d`` contiguous elements in both cache
layouts, loaded as a ``(BLOCK_N, d)`` tile of whole rows; every tile carries the (per-row) key
mask, which costs nothing next to the loads. Splits cut the *visible* keys (with a window, only
the last ``left + 1``) into equal runs of whole ``BLOCK_N`` blocks; when a sequence has fewer
blocks than splits, the last splits are empty and write ``LSE = -inf``.

**Plans (per-sequence splits, FlashInfer's plan/run).** One split count serves a uniform batch;
a ragged one (128k, 1k, 1k, 1k) wants many splits for its long sequence and one for the short
ones. :func:`decode_plan` computes on the host, from the lengths, a work list of (sequence,
key range) items of about equal size that fills about one wave; with ``plan=`` the split kernel
runs on the grid ``(work items, Hkv)``, a sequence with one item writes O and LSE itself, and
the merge reads each sequence's split count and workspace offset. The plan is checked against
the call (shapes; with ``check_values`` the lengths). ``merge="fused"`` drops the merge kernel:
the last split of each (sequence, K/V head) to finish merges, after one atomic per program.
On Hopper both kernels are launched with programmatic dependent launch (:func:`decode_pdl`):
each is scheduled while the kernel before it still runs and waits on ``griddepcontrol.wait``
before its first load, which takes its launch off the critical path: the merge's behind the
split kernel, and the split kernel's behind the previous step's merge (about half a microsecond
each).

**The paged cache.** ``k_cache, v_cache (num_pages, page_size, Hkv, d)`` and ``block_table
(B, max_pages)`` int32: key j of sequence b is row ``j % page_size`` of physical page
``block_table[b, j // page_size]``. When a page holds whole ``BLOCK_N`` blocks (page_size >=
BLOCK_N) a tile reads one table entry; smaller pages (a block spans several) are looked up per
key (a cached int32 load, the same address for the keys of one page), so any power-of-two page
size >= 16 works with any ``BLOCK_N``. Table entries past a sequence's last page, and with a
window those before the page of its first visible key, are never read: they may hold anything
(:func:`serving.paginate` writes -1 past the end; vLLM leaves -1 behind a sliding window).

**Number of splits** (:func:`default_num_splits`): the most whose grid fits in one wave of one
program per SM, ``splits = floor(SMs / (B * Hkv))`` (1 when ``B * Hkv`` fills the SMs alone),
at most one split per ``BLOCK_N`` block of the (visible) cache and at most ``MAX_SPLITS``; a
paged cache takes twice that (a second program per SM hides the block-table load). H100,
Hq = 32, Hkv = 4: batch 1 -> 33 splits (132 programs), 4 -> 8, 16 -> 2, 64 -> 1. With one split
the split kernel writes O and LSE itself (no merge). Its bandwidth against HBM and its time
against SDPA's backends are in ``recorded/11_decode_benchmark.json`` (device and date inside),
which chapter 11, section 7, prints.

**Variable lengths.** ``q (Tq, Hq, d)``, ``k, v (Tk, Hkv, d)`` packed, sequence b at rows
``cu_seqlens[b] .. cu_seqlens[b + 1] - 1``; grid ``(cdiv(max_seqlen_q, BLOCK_M), Hq, batch)``,
program ``(i, h, b)`` owns query tile i of sequence b, head h (tiles past the sequence's end do
nothing). Query row r sits at key position ``p = r + nk - nq`` (bottom-right, ``causal=True``
or ``"bottom_right"``; ``causal="top_left"`` puts it at ``p = r``, SDPA's alignment) and sees keys
``p - left <= j <= p + right`` (causal: right = 0). A tile visits only the key tiles that meet
its band, in three stages: masked tiles on the left edge, unmasked tiles inside every row's band,
masked tiles on the right edge (the diagonal, the sequence end). O is ``(Tq, Hq, d)`` like q; LSE
is ``(Hq, Tq)``, heads first like the dense ``(B, H, N)`` and FlashAttention's varlen API. A row
that sees no key gives O = 0, LSE = -inf (FlashAttention's non-split path stores +inf there; see
chapter 11, section 6). Empty inputs give empty outputs: ``decode_attention`` with B = 0 returns
O ``(0, Hq, d)`` and LSE ``(0, Hq)``; ``varlen_attention`` with no token (or ``cu_seqlens = [0]``)
returns O ``(0, Hq, d)`` and LSE ``(Hq, 0)``.

Scores are kept in base 2 as in chapter 09: ``scale * log2(e)`` is folded into one multiply and
every exponential is ``exp2``. With a softcap c, ``S = c * tanh(scale * q.k / c)``, with
``tanh(x) = 2 sigmoid(2x) - 1`` (``tl.sigmoid`` runs in the interpreter and compiles), then
times ``log2(e)``.

Configurations are fixed (no autotuning; measured on an H100, see :func:`varlen_config`):
decode ``BLOCK_N = 64``, 4 warps, 3 stages (``config=``, or the environment's
``COURSE_DECODE_CONFIG``, ``COURSE_DECODE_PROGRAMS_PER_SM``, ``COURSE_DECODE_MERGE``,
``COURSE_DECODE_MERGE_WARPS`` for a sweep); varlen ``BLOCK_M = 128``, ``BLOCK_N = 64``, 3 stages,
4 warps at d <= 64 and 8 at d = 128; float32 (exact products, for checking) smaller; in the
interpreter 16 x 16 blocks. Both functions pass ``config=`` to override them.

Timing: a call costs ~100 us of Python on the host (checks, two Triton launches), more than the
GPU needs for a short cache. Time decoding inside a CUDA graph
(``triton.testing.do_bench_cudagraph``, with ``check_values=False``), as servers run it.

This module is the front door and holds the decoding step's launch (:func:`decode_attention`,
with the checks of the lengths and the block table that need their values); the rest lives in
sibling modules whose names it re-exports::

    flash_decoding_common   the constants, INTERPRETED, the jit pieces both kernels share
    flash_decoding_kernels  the split kernel and the merge kernels (@triton.jit)
    flash_decoding_host     configurations, the split count, the checks of inputs and options
    flash_decoding_plans    DecodePlan, decode_plan, make_plan
    flash_decoding_varlen   the varlen kernel, varlen_config, varlen_attention
"""

from __future__ import annotations

import os

import torch
import triton

from .flash_decoding_common import (
    DECODE_BLOCK_N,
    H100_SMS,
    INTERPRETED,
    MAX_GRID_YZ,
    MAX_NEW_TOKENS,
    MAX_SPLITS,
    MERGE_BLOCK_S,
    MERGE_WARPS,
    MIN_DOT_M,
    MIN_SPLIT_BLOCKS,
    PAGED_PROGRAMS_PER_SM,
    TARGET_WAVES,
)
from .flash_decoding_host import (
    _check_float_inputs,
    _check_heads,
    _check_index,
    _config,
    _env_ints,
    _is_tensor,
    _options,
    _outputs,
    _pdl_possible,
    _strided,
    decode_config,
    decode_pdl,
    decode_programs_per_sm,
    default_num_splits,
)
from .flash_decoding_kernels import _decode_merge_kernel, _decode_split_kernel
from .flash_decoding_kernels import _decode_tiles as _decode_tiles
from .flash_decoding_plans import DecodePlan, decode_plan, make_plan
from .flash_decoding_varlen import _varlen_kernel as _varlen_kernel
from .flash_decoding_varlen import varlen_attention, varlen_config

__all__ = [
    "DECODE_BLOCK_N",
    "DecodePlan",
    "H100_SMS",
    "INTERPRETED",
    "MAX_GRID_YZ",
    "MAX_NEW_TOKENS",
    "MAX_SPLITS",
    "MERGE_BLOCK_S",
    "MERGE_WARPS",
    "MIN_DOT_M",
    "MIN_SPLIT_BLOCKS",
    "PAGED_PROGRAMS_PER_SM",
    "TARGET_WAVES",
    "decode_attention",
    "decode_config",
    "decode_pdl",
    "decode_plan",
    "decode_programs_per_sm",
    "default_num_splits",
    "make_plan",
    "varlen_attention",
    "varlen_config",
]


def decode_attention(q, k_cache, v_cache, cache_seqlens, *, block_table=None, num_splits=None,
                     window=(-1, -1), softcap=0.0, scale=None, return_partials=False, out=None,
                     workspace=None, check_values=True, config=None, plan=None, merge=None,
                     pdl=None):
    """One decoding step with split-KV (flash-decoding): ``(O, LSE)``.

    Args:
        q: ``(B, Hq, d)``, the new query of each sequence, or ``(B, Lq, Hq, d)``: ``Lq`` new
            tokens per sequence (1 .. ``MAX_NEW_TOKENS`` = 8: speculative decoding and
            multi-token prediction verify several drafted tokens in one step). float16 /
            bfloat16 on a GPU (float32 exact and slow), float32 / float16 in the interpreter.
        k_cache, v_cache: dense ``(B, Nmax, Hkv, d)``, or with ``block_table`` paged
            ``(num_pages, page_size, Hkv, d)`` (page_size a power of two >= 16); q's dtype.
            Any strides (the head dim is copied contiguous if it is not; v with k's strides).
        cache_seqlens: ``(B,)`` int32 on q's device: sequence b has keys
            ``0 .. cache_seqlens[b] - 1``, and its Lq new tokens are the **last Lq** of them
            (their K and V already written). Causal alignment **bottom-right**
            (``"bottom_right"`` of docs/contract.md): new token t (0-based) sits at key position
            ``cache_seqlens[b] - Lq + t`` and sees keys ``0 ..`` that position (one new token:
            all of them). 0 is an idle slot: O = 0, LSE = -inf. A length from 1 to Lq - 1 is a
            ValueError (the sequence must hold its Lq new tokens; with ``check_values=False``
            its first tokens would see no key: O = 0, LSE = -inf).
        block_table: ``(B, max_pages)`` int32: physical page of logical page p of sequence b.
        num_splits: splits of every sequence's keys; default :func:`default_num_splits` of the
            cache size. Not with ``plan``.
        plan: a :class:`DecodePlan` from :func:`decode_plan` (or :func:`make_plan`): each
            sequence gets its own split count (FlashInfer's plan/run), computed on the host from
            the lengths. It is checked against this call's shapes (B, Hkv, Lq, window, BLOCK_N)
            and, with ``check_values``, against the lengths in ``cache_seqlens``.
        window: ``(left, right)``: each new token sees only the ``left + 1`` keys up to its
            own position (-1: all); ``right`` changes nothing (no key comes after the last
            token, and the new tokens are causal among themselves).
        softcap: ``S -> softcap * tanh(S / softcap)``, 0 = off. scale: default ``1/sqrt(d)``.
        return_partials: also return the splits' ``O_parts (S, B, Hq, d)`` and
            ``LSE_parts (S, B, Hq)``, float32 (views of the workspace); with ``Lq`` tokens
            ``(S, B, Lq, Hq, d)`` and ``(S, B, Lq, Hq)``. Not with ``plan``.
        out: optional ``(O, LSE)`` to write into; workspace: optional ``(O_parts, LSE_parts)``
            float32 buffers ``(B, Hq, S, d)``, ``(B, Hq, S)`` (``(B, Lq, Hq, S, d)`` and
            ``(B, Lq, Hq, S)`` for a 4-dim q; with a plan ``(P, Lq, Hq, d)`` and ``(P, Lq, Hq)``,
            ``P = plan.num_parts``) (the tests pass NaN-filled ones).
        check_values: check cache_seqlens and the used block-table entries against the cache
            size (one device-to-host copy; pass False when timing a decoding loop).
        config: ``(BLOCK_N, num_warps, num_stages)`` instead of :func:`decode_config`'s (or
            the environment's ``COURSE_DECODE_CONFIG``, e.g. ``"64,4,3"``).
        merge: how the splits are combined: ``"kernel"`` (the default: a second kernel, grid
            ``(Hq, Lq, B)``) or ``"fused"`` (no second launch: the last split of each
            (sequence, K/V head) to finish merges them, counted by an atomic per pair in a
            buffer kept per device: one fused call at a time per device, never two at once on
            two streams); default ``COURSE_DECODE_MERGE`` or ``"kernel"``.
        pdl: launch the split kernel and the merge kernel with programmatic dependent launch
            (Hopper and later; ignored elsewhere); default :func:`decode_pdl`.

    Returns:
        O like q (``(B, Hq, d)`` or ``(B, Lq, Hq, d)``) in q's dtype; LSE float32, natural log,
        ``(B, Hq)``, or ``(B, Hq, Lq)`` for a 4-dim q (heads before tokens, as the contract's
        ``(B, H, N)`` and FlashAttention's ``flash_attn_with_kvcache``); -inf for an idle slot
        (length 0), whose O is 0. With ``return_partials`` also ``O_parts, LSE_parts``.
        B = 0: empty O and LSE, no launch.
    """
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        one_token = False
    else:
        one_token = True
    _check_float_inputs(("q", "k_cache", "v_cache"), (q, k_cache, v_cache),
                        (3 if one_token else 4, 4, 4), {
        "q": "(B, Hq, d): one query per sequence, or (B, Lq, Hq, d): Lq new tokens",
        "k_cache": "(B, Nmax, Hkv, d), or (num_pages, page_size, Hkv, d) with block_table",
        "v_cache": "(B, Nmax, Hkv, d), or (num_pages, page_size, Hkv, d) with block_table"})
    q4 = q[:, None] if one_token else q  # (B, Lq, Hq, d), a view
    B, Lq, Hq, d = q4.shape
    if not 1 <= Lq <= MAX_NEW_TOKENS:
        raise ValueError(f"q has Lq={Lq} new tokens per sequence: decode_attention takes 1 .. "
                         f"{MAX_NEW_TOKENS} (a longer chunk is a prefill: varlen_attention)")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         "must have the same shape: one value row per key")
    Hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"q has head dim d={d} but the caches have {k_cache.shape[3]}")
    _check_heads(Hq, Hkv, d)
    q4, k_cache, v_cache = _strided(q4, k_cache, v_cache)
    if B > MAX_GRID_YZ or Hkv > MAX_GRID_YZ:
        raise ValueError(f"B={B}, Hkv={Hkv}: the grid is (splits, Hkv, B), and y and z must be "
                         f"1 .. {MAX_GRID_YZ}: split the batch into chunks")
    _check_index("cache_seqlens", cache_seqlens, (B,), q.device, "one length per sequence")
    paged = block_table is not None
    if paged:
        page_size = k_cache.shape[1]
        if page_size < 16 or page_size & (page_size - 1):
            raise ValueError(f"page_size={page_size} (k_cache.shape[1]): use a power of two "
                             ">= 16, so every page is whole 16-key blocks of contiguous rows")
        _is_tensor("block_table", block_table)
        if block_table.dim() != 2:
            raise ValueError(f"block_table has shape {tuple(block_table.shape)}: expected "
                             f"(B={B}, max_pages)")
        _check_index("block_table", block_table, (B, block_table.shape[1]), q.device,
                     "the physical page of each logical page")
        capacity = block_table.shape[1] * page_size
    else:
        page_size = 1
        if k_cache.shape[0] != B:
            raise ValueError(f"k_cache has {k_cache.shape[0]} sequences but q has B={B}; a "
                             "paged cache needs block_table=")
        capacity = k_cache.shape[1]
    left, _, softcap, score_scale, softcap_log2e = _options(window, softcap, scale, d)
    if plan is not None:
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan must be a DecodePlan (fd.decode_plan(...)), got "
                            f"{type(plan).__name__}")
        if num_splits is not None or return_partials:
            raise ValueError("plan= fixes each sequence's splits: pass neither num_splits= nor "
                             "return_partials=True with it")
    merge = os.environ.get("COURSE_DECODE_MERGE", "kernel") if merge is None else merge
    if merge not in ("kernel", "fused"):
        raise ValueError(f"merge={merge!r}: \"kernel\" (a merge kernel) or \"fused\" (the last "
                         "split merges)")
    lse_shape = (B, Hq) if one_token else (B, Hq, Lq)
    if B == 0:  # an empty batch: empty outputs, no launch (a grid of 0 programs is an error)
        return _empty_decode(q, lse_shape, num_splits, return_partials, out)
    if check_values:
        _check_decode_values(cache_seqlens, block_table, capacity, page_size, k_cache.shape[0],
                             left, Lq)

    if plan is not None:
        block_n = plan.block_n
        warps, stages = _config("config", config, 3)[1:] if config else decode_config(
            q.dtype, 1 if paged else B * Hkv)[1:]
        if config and config[0] != block_n:
            raise ValueError(f"config={tuple(config)} has BLOCK_N={config[0]} but the plan "
                             f"cuts keys into blocks of {block_n}: make the plan with "
                             f"block_n={config[0]}")
        plan.check(B, Hkv, Lq, left, cache_seqlens if check_values else None)
    else:
        block_n, warps, stages = (_config("config", config, 3) if config
                                  else decode_config(q.dtype, 1 if paged else B * Hkv))
    visible_keys = capacity if left < 0 else min(capacity, left + Lq)
    if plan is None and num_splits is None:
        num_splits = default_num_splits(B, Hkv, visible_keys, block_n=block_n, paged=paged)
    if plan is None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                         or num_splits < 1):
        raise ValueError(f"num_splits={num_splits!r}: a whole number >= 1 (or None to choose)")

    O, LSE = _outputs(out, ("O", "LSE"), (q.shape, lse_shape), (q.dtype, torch.float32),
                      q.device)
    O4 = O[:, None] if one_token else O
    LSE3 = LSE[:, :, None] if one_token else LSE  # (B, Hq, Lq)
    G = Hq // Hkv
    table = block_table if paged else cache_seqlens  # never read when not paged
    if plan is not None:
        work, splits, offsets = plan.tensors(q.device)
        direct = all(s == 1 for s in plan.splits)  # no merge (idle slots need one: O = 0)
        O_part, LSE_part = (LSE, LSE) if plan.num_parts == 0 else _outputs(
            workspace, ("O_parts", "LSE_parts"),
            ((plan.num_parts, Lq, Hq, d), (plan.num_parts, Lq, Hq)),
            (torch.float32, torch.float32), q.device)
        grid = (len(plan.work), Hkv)
    else:
        # One split and no partials asked for: the split kernel writes O and LSE itself.
        direct = num_splits == 1 and not return_partials and workspace is None
        if direct:
            O_part = LSE_part = LSE  # never touched
        else:
            shapes = (((B, Hq, num_splits, d), (B, Hq, num_splits)) if one_token else
                      ((B, Lq, Hq, num_splits, d), (B, Lq, Hq, num_splits)))
            O_part, LSE_part = _outputs(workspace, ("O_parts", "LSE_parts"), shapes,
                                        (torch.float32, torch.float32), q.device)
        work = splits = offsets = cache_seqlens  # never read without a plan
        grid = (num_splits, Hkv, B)
    fused = not direct and merge == "fused"
    # PDL: both kernels launched early, each waiting (griddepcontrol.wait) for the grid before
    # it; the split kernel waits for the last kernel of the stream (the previous step's merge
    # in a decoding loop), the merge for the split kernel.
    pdl = decode_pdl(q.device) if pdl is None else bool(pdl) and _pdl_possible(q.device)
    locks = _locks(q.device, B * Hkv) if fused else cache_seqlens  # never read unless fused
    _decode_split_kernel[grid](
        q4, k_cache, v_cache, cache_seqlens, table, work, splits, offsets, locks, O_part,
        LSE_part, O4, LSE3,
        score_scale, softcap_log2e, left if left >= 0 else capacity,
        q4.stride(0), q4.stride(1), q4.stride(2), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), table.stride(0), O4.stride(0), O4.stride(1), O4.stride(2),
        LSE3.stride(0), LSE3.stride(1), LSE3.stride(2),
        G=G, LQ=Lq, BLOCK_M=max(MIN_DOT_M, triton.next_power_of_2(G * Lq)), HEAD_DIM=d,
        BLOCK_N=block_n, PAGE_SIZE=page_size, PAGED=paged, SOFTCAP=softcap > 0, DIRECT=direct,
        PLAN=plan is not None, FUSED=fused, PDL=pdl, num_warps=warps,
        num_stages=stages, **({"launch_pdl": True} if pdl else {}))
    if not direct and not fused:
        most = plan.max_splits if plan is not None else num_splits
        _decode_merge_kernel[(Hq, Lq, B)](
            O_part, LSE_part, O4, LSE3, splits, offsets, most, O4.stride(0), O4.stride(1),
            O4.stride(2), LSE3.stride(0), LSE3.stride(1), LSE3.stride(2), HEAD_DIM=d,
            BLOCK_S=min(MERGE_BLOCK_S, triton.next_power_of_2(max(most, 1))),
            PLAN=plan is not None, PDL=pdl,
            num_warps=(_env_ints("COURSE_DECODE_MERGE_WARPS", 1) or (MERGE_WARPS,))[0],
            **({"launch_pdl": True} if pdl else {}))
    if return_partials:
        if one_token:
            return O, LSE, O_part.permute(2, 0, 1, 3), LSE_part.permute(2, 0, 1)
        return O, LSE, O_part.permute(3, 0, 1, 2, 4), LSE_part.permute(3, 0, 1, 2)
    return O, LSE


_LOCKS = {}


def _locks(device, n):
    """The fused merge's counters: int32 zeros, one per (sequence, K/V head), kept per device
    (each call leaves them at 0: the last split resets its counter)."""
    key = str(device)
    if key not in _LOCKS or _LOCKS[key].numel() < n:
        _LOCKS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return _LOCKS[key]


def _empty_decode(q, lse_shape, num_splits, return_partials, out):
    """B = 0: empty O like q and LSE (the caller's ``out`` if given), and empty parts."""
    O, LSE = _outputs(out, ("O", "LSE"), (q.shape, lse_shape), (q.dtype, torch.float32),
                      q.device)
    if not return_partials:
        return O, LSE
    S = 1 if num_splits is None else num_splits
    inner = tuple(q.shape[1:-1])
    return (O, LSE, torch.empty(S, 0, *inner, q.shape[-1], device=q.device),
            torch.empty(S, 0, *inner, device=q.device))


def _check_decode_values(cache_seqlens, block_table, capacity, page_size, num_pages, left=-1,
                         new_tokens=1):
    """One device-to-host copy: lengths in 0 .. capacity, none from 1 to Lq - 1 (a sequence
    holds its Lq new tokens), the table entries the kernel reads are pages. It reads the pages
    of the visible keys only: with a window (``left`` >= 0), the pages wholly before key
    ``seqlen - Lq - left`` may hold anything (vLLM leaves -1 there)."""
    n = cache_seqlens.long()
    short = ((n > 0) & (n < new_tokens)).any().long()
    stats = [n.min(), n.max(), short]
    if block_table is not None:
        logical = torch.arange(block_table.shape[1], device=n.device)[None, :]
        first = ((n - new_tokens - left).clamp(min=0) if left >= 0 else torch.zeros_like(n))
        used = ((logical < ((n + page_size - 1) // page_size)[:, None])
                & (logical >= (first // page_size)[:, None]))
        bad = used & ((block_table < 0) | (block_table >= num_pages))
        stats.append(bad.any().long())
    values = torch.stack(stats).tolist()
    if values[0] < 0 or values[1] > capacity:
        where = ("max_pages * page_size" if block_table is not None else "Nmax")
        raise ValueError(f"cache_seqlens go from {values[0]} to {values[1]}: each must be in "
                         f"0 .. {capacity} (the cache holds {where} = {capacity} keys)")
    if values[2]:
        raise ValueError(f"a sequence holds fewer keys than its Lq={new_tokens} new tokens: "
                         "the new tokens' K and V are the last Lq keys of the cache, so every "
                         f"length must be 0 (an idle slot) or >= {new_tokens}")
    if block_table is not None and values[3]:
        raise ValueError(f"block_table names a page outside 0 .. {num_pages - 1} (or -1) among "
                         "the pages the kernel reads: every logical page from the window's "
                         "first key's page (page 0 without a window) to "
                         "ceil(cache_seqlens[b] / page_size) - 1 must map to a physical page")
