"""Chapter 11's student-side helpers: the tile sizes its exercise notebook imports, the counter of
prefix reads, and the launcher of the paged-prefill kernel.

The exercises of chapter 11 are variants of what the lecture serves (split-KV decoding, GQA, a
paged KV cache read by the decode kernel, varlen packing, bottom-right causal masks), so that
their answers are nowhere in the package:

- ``11.shared_prefix``: cascade attention (a prefix shared by every sequence, merged by LSE with
  each sequence's own suffix). :func:`prefix_reads` runs the student's function and counts how
  many elements of the shared prefix its operators read, so that the grader can tell "the prefix
  read once for all queries" from "the prefix read once per sequence".
- ``11.chunked_mask`` and ``11.num_splits``: plain calls, nothing to run here.
- ``11.paged_prefill``: :func:`run_paged_prefill` launches the student's Triton kernel.

The grader's cases (``course_utils.grading.specs.ch11``) call these through ``grader.invoke``: they
run where the candidate lives (the sandboxed worker while grading), take and return data only, and
never see an expected value.
"""

from __future__ import annotations

import torch
import triton

from ...runtime import pick

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2 e)

# The paged-prefill kernel's tiles while grading (BLOCK_M = Br query rows, BLOCK_N = Bc keys) and
# the head dimension of its cases. Pages hold PAGE_SIZE keys: BLOCK_N or a multiple of it, so that
# one key tile never straddles two pages.
PREFILL_BLOCK_M = pick(gpu=64, cpu=16)
PREFILL_BLOCK_N = pick(gpu=32, cpu=16)
PREFILL_D = pick(gpu=64, cpu=16)
PREFILL_WARPS = 4


# ----------------------------------------------------------------------------- 11.shared_prefix


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def prefix_reads(fn, q, K_prefix, V_prefix, *rest):
    """Run ``fn(q, K_prefix, V_prefix, *rest)``; return ``(result, reads_K, reads_V)``.

    ``reads_K`` counts the elements of ``K_prefix`` that the executed ATen operators read, in
    operations that combine them with other data (a product with the queries, a concatenation
    with a suffix): one batched product over all queries reads it once (``P * Hkv * d``
    elements), a loop over the B sequences reads it B times. Copies of the prefix alone
    (``.contiguous()``, ``.to()``, ``repeat_interleave``, ``expand(...).reshape``) are followed:
    a later read of such a copy counts its elements, so a prefix copied B times is read B times.
    Recorded by a ``TorchDispatchMode``; the grader judges the numbers.
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.origin = {_storage(K_prefix): "K", _storage(V_prefix): "V"}
            self.alive = []  # copies of the prefix, kept so that their memory is not reused
            self.reads = {"K": 0, "V": 0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if getattr(func, "is_view", False):
                return out  # a view shares its base's storage: it is followed already
            inputs = [t for t in tree_flatten((args, kwargs or {}))[0]
                      if isinstance(t, torch.Tensor) and t.numel() > 0]
            tags = [self.origin.get(_storage(t)) for t in inputs]
            if not any(tags):
                return out
            if all(tags) and len(set(tags)) == 1:  # a copy of one prefix tensor alone
                results = out if isinstance(out, (tuple, list)) else (out,)
                for r in results:
                    if isinstance(r, torch.Tensor) and r.numel() > 0:
                        self.origin[_storage(r)] = tags[0]
                        self.alive.append(r)
                return out
            for t, tag in zip(inputs, tags, strict=True):
                if tag:
                    self.reads[tag] += t.numel()
            return out

    spy = Reads()
    with spy:
        result = fn(q, K_prefix, V_prefix, *rest)
    return result, spy.reads["K"], spy.reads["V"]


# ----------------------------------------------------------------------------- 11.paged_prefill


def run_paged_prefill(kernel, q, K_cache, V_cache, block_table, cu_seqlens_q, seqlens_k, scale,
                      O, LSE):
    """Launch the student's paged-prefill ``kernel``; writes and returns ``(O, LSE)``.

    q, O ``(Tq, Hq, d)`` (the B sequences' new query tokens, packed); ``cu_seqlens_q`` ``(B + 1,)``
    int32; K_cache, V_cache ``(num_pages, PAGE_SIZE, Hkv, d)``; ``block_table`` ``(B,
    max_pages)`` int32 (logical page -> physical page); ``seqlens_k`` ``(B,)`` int32 (keys in the
    cache, the new tokens' included); LSE ``(Hq, Tq)`` float32. Grid ``(cdiv(max nq, BLOCK_M),
    Hq, B)`` (the lecture's varlen grid) and the arguments::

        kernel[grid](Q, K_cache, V_cache, BLOCK_TABLE, CU_SEQLENS_Q, SEQLENS_K, O, LSE,
                     qk_scale, max_pages, Hq, Hkv, GROUP=..., HEAD_DIM=..., PAGE_SIZE=...,
                     BLOCK_M=..., BLOCK_N=...)
    """
    Tq, Hq, d = q.shape
    page_size, Hkv = K_cache.shape[1], K_cache.shape[2]
    B = seqlens_k.shape[0]
    lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    max_nq = max(lengths, default=0)
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads cannot share {Hkv} K/V heads evenly")
    if page_size % PREFILL_BLOCK_N:
        raise ValueError(f"PAGE_SIZE={page_size} is not a multiple of BLOCK_N={PREFILL_BLOCK_N}")
    grid = (max(triton.cdiv(max_nq, PREFILL_BLOCK_M), 1), Hq, B)
    kernel[grid](q, K_cache, V_cache, block_table, cu_seqlens_q, seqlens_k, O, LSE,
                 scale * LOG2E, block_table.shape[1], Hq, Hkv, GROUP=Hq // Hkv, HEAD_DIM=d,
                 PAGE_SIZE=page_size, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N,
                 num_warps=PREFILL_WARPS)
    return O, LSE


__all__ = [
    "LOG2E",
    "PREFILL_BLOCK_M",
    "PREFILL_BLOCK_N",
    "PREFILL_D",
    "PREFILL_WARPS",
    "prefix_reads",
    "run_paged_prefill",
]
