"""Writing new keys and values into a paged KV cache: a *mutating* custom op (chapter 12).

Public API::

    kv_cache_write(k_cache, v_cache, k, v, slot_mapping)       # returns None, writes the caches
    torch.ops.course.kv_cache_write(k_cache, v_cache, k, v, slot_mapping)

What vLLM's ``reshape_and_cache`` does: token t of a step (prefill or decode, any sequences
flattened into one list of T tokens) goes to **slot** ``slot_mapping[t]`` of the paged cache,
row ``slot % page_size`` of page ``slot // page_size``; the engine computes the slots from each
sequence's block table (``slot = block_table[b, pos // page_size] * page_size + pos %
page_size``). A slot of ``-1`` means "skip this token" (padding in a batch of fixed size, as
under CUDA graphs). Shapes, as chapter 11's paged cache:

* ``k_cache, v_cache``: ``(num_pages, page_size, Hkv, d)``, one dtype and device, any strides;
* ``k, v``: ``(T, Hkv, d)`` in the caches' dtype, any strides;
* ``slot_mapping``: ``(T,)`` int64 or int32, each -1 or in ``[0, num_pages * page_size)``.

**Why ``mutates_args``.** The op returns nothing: its whole effect is on ``k_cache`` and
``v_cache``. ``torch.library.custom_op(..., mutates_args=("k_cache", "v_cache"))`` writes that
into the schema (``Tensor(a0!) k_cache``). The compiler then knows (1) that the call must not be
dropped although nothing uses its result, (2) that a read of the cache after it depends on it,
and (3) how to functionalise it: AOTAutograd captures ``auto_functionalized(course.
kv_cache_write, ...)`` (a pure node that returns new caches) followed by copies back into the
caches, and Inductor's re-inplacing pass turns it back into an in-place call on the caches
themselves when nothing else reads the old values, so the compiled code copies no cache.
Declare nothing and the compiler believes the op is pure and returns nothing: it may drop the
call, and ``torch.library.opcheck`` reports the undeclared mutation.

Implementations: on a GPU, one Triton program per token (a masked load of the token's ``Hkv *
d`` values, a masked store into its slot; a skipped token stores nothing); on the CPU, indexing
in PyTorch. Neither allocates or synchronises, so the op can be captured in a CUDA graph. The
range of the slots is checked on the data (a clear ``ValueError``) except while a CUDA graph is
being captured, where reading them would synchronise: there the kernel skips any slot outside
the cache instead of writing out of bounds.
"""

from __future__ import annotations

import torch

__all__ = ["SLOT_DTYPES", "kv_cache_write", "kv_cache_write_reference"]

SLOT_DTYPES = (torch.int64, torch.int32)


def _check(k_cache, v_cache, k, v, slot_mapping):
    """Metadata checks (shape, dtype, device): they run on fake tensors too, so a bad call
    fails while compiling. Returns ``(num_pages, page_size, Hkv, d, T)``."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                    ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}: both "
                         "must be (num_pages, page_size, Hkv, d), the same shape")
    P, S, H, d = k_cache.shape
    if k.dim() != 3 or k.shape != v.shape or tuple(k.shape[1:]) != (H, d):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)}: both must be (T, Hkv, d) = "
                         f"(T, {H}, {d}), the cache's heads and head dim")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}: expected "
                         f"({k.shape[0]},), one slot per token")
    if slot_mapping.dtype not in SLOT_DTYPES:
        raise TypeError(f"slot_mapping has dtype {slot_mapping.dtype}: use int64 or int32 "
                        "(slot = page * page_size + row, -1 to skip a token)")
    if not k_cache.dtype == v_cache.dtype == k.dtype == v.dtype:
        raise TypeError(f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}, k {k.dtype}, "
                        f"v {v.dtype}: the new keys and values must have the caches' dtype "
                        "(cast them first: the op never converts silently)")
    devices = {t.device for t in (k_cache, v_cache, k, v, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"the tensors are on {sorted(map(str, devices))}: use one device")
    return P, S, H, d, k.shape[0]


def _check_slots(slot_mapping, capacity):
    """The slots' values: each -1 or in [0, capacity). Skipped while a CUDA graph is captured
    (reading them would synchronise; the kernel then skips a slot out of range)."""
    if slot_mapping.numel() == 0:
        return
    if slot_mapping.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    bad = (slot_mapping < -1) | (slot_mapping >= capacity)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise ValueError(f"slot_mapping[{t}] = {int(slot_mapping[t])}: a slot must be -1 (skip) "
                         f"or in [0, {capacity}) = [0, num_pages * page_size)")


def kv_cache_write_reference(k_cache, v_cache, k, v, slot_mapping):
    """The same write in PyTorch, out of place: returns new ``(k_cache, v_cache)``."""
    P, S, H, d, _ = _check(k_cache, v_cache, k, v, slot_mapping)
    _check_slots(slot_mapping, P * S)
    kc, vc = k_cache.clone(), v_cache.clone()
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    kc[slots // S, slots % S] = k[keep]
    vc[slots // S, slots % S] = v[keep]
    return kc, vc


@torch.library.custom_op("course::kv_cache_write", mutates_args=("k_cache", "v_cache"))
def kv_cache_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write token t's ``k[t], v[t]`` to slot ``slot_mapping[t]`` of the caches (in place);
    slot -1: skip the token. See the module docstring for the shapes."""
    P, S, H, d, T = _check(k_cache, v_cache, k, v, slot_mapping)
    _check_slots(slot_mapping, P * S)
    if T == 0 or k_cache.numel() == 0:
        return
    if k_cache.is_cuda:
        _write_triton(k_cache, v_cache, k, v, slot_mapping)
        return
    keep = slot_mapping >= 0  # CPU: a boolean mask reads the data, which costs nothing here
    slots = slot_mapping[keep].long()
    k_cache[slots // S, slots % S] = k[keep]
    v_cache[slots // S, slots % S] = v[keep]


@kv_cache_write.register_fake
def _(k_cache, v_cache, k, v, slot_mapping):
    # A mutating op that returns nothing: the fake checks the metadata and returns None. (The
    # compiler learns about the writes from the schema, not from the fake.)
    _check(k_cache, v_cache, k, v, slot_mapping)


# =============================================================================================
# The GPU kernel: one program per token
# =============================================================================================

_kernel = None


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kv_cache_write_kernel(KC, VC, K, V, SLOT, capacity, page_size,
                              s_cp, s_cr, s_ch, s_cd, s_vp, s_vr, s_vh, s_vd,
                              s_kt, s_kh, s_kd, s_vt, s_vh2, s_vd2,
                              H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(SLOT + t).to(tl.int64)
        page, row = slot // page_size, slot % page_size
        i = tl.arange(0, BLOCK)
        h, c = i // D, i % D
        m = (i < H * D) & (slot >= 0) & (slot < capacity)  # -1 (or out of range): no store
        key = tl.load(K + t * s_kt + h * s_kh + c * s_kd, mask=m)
        val = tl.load(V + t * s_vt + h * s_vh2 + c * s_vd2, mask=m)
        tl.store(KC + page * s_cp + row * s_cr + h * s_ch + c * s_cd, key, mask=m)
        tl.store(VC + page * s_vp + row * s_vr + h * s_vh + c * s_vd, val, mask=m)

    return kv_cache_write_kernel


def _write_triton(k_cache, v_cache, k, v, slot_mapping):
    global _kernel
    import triton

    if _kernel is None:
        _kernel = _build_kernel()
    P, S, H, d = k_cache.shape
    _kernel[(k.shape[0],)](k_cache, v_cache, k, v, slot_mapping, P * S, S,
                           *k_cache.stride(), *v_cache.stride(), *k.stride(), *v.stride(),
                           H=H, D=d, BLOCK=triton.next_power_of_2(H * d))
