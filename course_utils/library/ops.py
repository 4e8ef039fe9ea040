"""The course's attention as PyTorch operators: chapter 12 (a kernel inside a model).

Public API::

    O = flash_attention(q, k, v, causal=False, scale=None)      # differentiable, compilable
    O, LSE = torch.ops.course.flash_attn_fwd(q, k, v, causal, scale)
    dQ, dK, dV = torch.ops.course.flash_attn_bwd(dO, dLSE, q, k, v, O, LSE, causal, scale)

The contract (the same on the CPU and on a GPU, and in the fakes that ``torch.compile`` sees):

* q ``(B, Hq, Nq, d)``, k and v ``(B, Hk, Nk, d)`` with Hk dividing Hq (grouped-query attention:
  query head h reads K/V head ``h // (Hq // Hk)``), d in SUPPORTED_D, **any strides** (a model's
  ``(B, N, H, d)`` projection after ``.transpose(1, 2)``, slices of a fused QKV, K/V expanded
  over heads with stride 0). One dtype and device for all three.
* O is a **fresh contiguous** ``(B, Hq, Nq, d)`` tensor in q's dtype whatever the inputs'
  strides; LSE a fresh contiguous ``(B, Hq, Nq)`` float32 tensor, natural log (base e); dQ, dK,
  dV fresh contiguous tensors with the shapes and dtypes of q, k, v. The fakes say exactly this.
* ``causal``: a bool in the op (True: top-left, query r sees keys c <= r, as SDPA's
  ``is_causal``); :func:`flash_attention` takes ``True``/``"top_left"`` too, and
  ``"bottom_right"`` only when Nq == Nk (the same mask), else a clear NotImplementedError.
* A row that sees no key has O = 0 and LSE = -inf (with top-left causal every row sees key 0:
  this happens only when Nk = 0). Empty inputs (B, Hq or Nq = 0) return empty outputs, Nk = 0
  returns O = 0 and LSE = -inf, and their gradients are zeros.

Why operators and not chapter 09's ``torch.autograd.Function``: ``torch.compile`` traces Python
with *fake tensors* (shapes, dtypes and strides, no data). A Function whose forward launches a
kernel makes the tracer either run the launch on a fake tensor (an error) or stop the graph there
(a graph break). An operator registered with ``torch.library`` is one node of the graph: the
compiler never looks inside, it asks the op's *fake* implementation what the outputs look like,
and the op's *autograd* registration what the backward is.

The choice made here: ``torch.library.custom_op`` (opaque to the compiler), not ``triton_op`` +
``wrap_triton`` (the compiler sees the Triton launches, and its generated code calls the kernel
without going through the dispatcher). Reasons:

* one operator for both modes: ``wrap_triton`` cannot trace a kernel that runs in Triton's CPU
  interpreter (it needs the compiled kernel's metadata; on fake tensors the interpreter reads
  data pointers), so a ``triton_op`` would not compile in the course's CPU mode;
* chapter 09's kernels are wrapped in ``triton.heuristics`` and receive ``@triton.jit``
  functions as arguments (how its exercises plug in), which ``wrap_triton`` does not accept;
* inductor would not fuse anything into a whole attention kernel anyway: what ``triton_op``
  saves is the call overhead of the dispatcher, a few microseconds per call (lecture 12, part 6).

Inside the op, CUDA tensors run chapter 09's Triton kernels with *fixed* configurations (never
the autotuner inside a compiled model: see :func:`pin_configs` and :func:`tune_outside`). CPU
tensors run :func:`attention_forward_torch` / :func:`attention_backward_torch`, the same
FlashAttention-2 algorithm in PyTorch (key tiles of ``CPU_BLOCK_N``, online softmax, P recomputed
in the backward), because chapter 09's kernels in the interpreter take seconds per call: too slow
to train even a tiny model. ``use_interpreter(True)`` runs the Triton kernels themselves on CPU
tensors (CPU mode only; tiny sizes).

Chapter 09's kernels index rows as ``bh * N * d + r * d + c``: they take no strides and no
grouped K/V heads. On their path the op makes q, k, v contiguous (a copy only for a view that is
not), repeats each K/V head over its group of query heads, and sums dK, dV over the group; the
PyTorch path reads any strides and groups directly.

The LSE is in natural-log units (chapter 09 converts its base-2 running max back): a consumer
that merges partial results with ``exp(LSE_1 - LSE)`` gets the right weights.
"""

from __future__ import annotations

import math

import torch

from ..contract import BOTTOM_RIGHT, causal_alignment
from .kernels import flash_attention_triton as fat

SUPPORTED_D = fat.SUPPORTED_D
CPU_BLOCK_N = 32  # keys per tile of the CPU implementation (the kernels' Bc)
CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the PyTorch path computes in fp32

__all__ = [
    "CPU_BLOCK_N",
    "SUPPORTED_D",
    "attention_backward_torch",
    "attention_forward_torch",
    "flash_attention",
    "flash_attn_bwd",
    "flash_attn_fwd",
    "pin_configs",
    "pinned_configs",
    "poison_outputs",
    "tune_outside",
    "use_interpreter",
]

_pinned: dict = {}  # (d, dtype) -> {"forward": Config, "dkdv": Config, "dq": Config}
_interpreter = {"on": False}  # CPU tensors through chapter 09's kernels in the interpreter
_poison = {"on": False}  # kernels' outputs allocated full of NaN (tests: an unwritten row shows)


# =============================================================================================
# Checks: metadata only (shape, dtype, device), so they run on fake tensors too
# =============================================================================================


def _check_inputs(q, k, v):
    """Raise a clear error for inputs the op cannot take; return ``(B, Hq, Nq, Nk, d)``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: expected 4 dims (B, H, N, d); "
                             "a model's (B, N, H, d) projection needs .transpose(1, 2) first")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}: they must match")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v are on {q.device}, {k.device}, {v.device}: use one device")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {q.device.type!r}: the op runs on CUDA GPUs and on the CPU")
    allowed = CPU_DTYPES if q.device.type == "cpu" else fat.GPU_DTYPES
    if q.dtype not in allowed:
        raise TypeError(f"dtype {q.dtype} on {q.device.type}: use one of {allowed}")
    B, Hq, Nq, d = q.shape
    Hk = k.shape[1]
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v "
                         "must be (B, Hk, Nk, d) with the B and d of q")
    groups_fit = Hq % Hk == 0 if Hk > 0 else Hq == 0
    if not groups_fit:
        raise ValueError(f"q has {Hq} heads and k, v have {Hk}: the K/V heads must divide the "
                         "query heads (grouped-query attention: query head h reads K/V head "
                         "h // (Hq // Hk))")
    if d not in SUPPORTED_D:
        raise ValueError(f"head dim d={d}: the kernels support {SUPPORTED_D}")
    return B, Hq, Nq, k.shape[2], d


def _check_scale(scale):
    # comparisons, not math.isfinite: under torch.compile a float can be symbolic (NaN fails both)
    if not (isinstance(scale, (int, float)) and 0 < scale < math.inf):
        raise ValueError(f"scale={scale!r}: must be a finite number > 0 (default 1/sqrt(d))")


# =============================================================================================
# The CPU implementation: FlashAttention-2 in PyTorch, key tile by key tile
# =============================================================================================


def attention_forward_torch(q, k, v, causal, scale, block_n=CPU_BLOCK_N):
    """Tiled forward with the online softmax: ``(O, LSE)`` as the op returns them.

    All query rows at once, key tiles of ``block_n`` in turn (the kernel's loop over j, its
    programs over i run as one batched matmul): S_j, P_j are ``(B, Hk, G, Nq, block_n)`` (G =
    Hq // Hk query heads per K/V head), never ``(Nq, Nk)``. Any strides; float32 arithmetic,
    natural-log units; ``causal`` a bool (top-left). O contiguous ``(B, Hq, Nq, d)`` in q's
    dtype, LSE contiguous ``(B, Hq, Nq)`` float32; a row that sees no key: O = 0, LSE = -inf.
    """
    B, H, Nq, Nk, d = _check_inputs(q, k, v)
    Hk = k.shape[1]
    Q = q.float().unflatten(1, (Hk, H // Hk if Hk else 0))  # a view: splitting a dim never copies
    rows = torch.arange(Nq, device=q.device)[:, None]
    m = torch.full((*Q.shape[:-1], 1), -math.inf, device=q.device)
    l = torch.zeros(*Q.shape[:-1], 1, device=q.device)
    acc = torch.zeros(Q.shape, device=q.device)
    stop = min(Nk, Nq) if causal else Nk  # top-left causal: keys >= Nq follow every query
    for start in range(0, stop, block_n):
        K_j = k[:, :, start:start + block_n].float()[:, :, None]  # (B, Hk, 1, block_n, d)
        V_j = v[:, :, start:start + block_n].float()[:, :, None]
        S = (Q @ K_j.transpose(-1, -2)) * scale
        if causal:  # query i sees key j <= i
            cols = start + torch.arange(K_j.shape[-2], device=q.device)[None, :]
            S = S.masked_fill(cols > rows, -math.inf)
        m_new = torch.maximum(m, S.amax(-1, keepdim=True))
        alpha = torch.exp(m - m_new)  # rescales what was summed under the old max
        P = torch.exp(S - m_new)
        l = l * alpha + P.sum(-1, keepdim=True)
        acc = acc * alpha + P @ V_j
        m = m_new
    # Only l == 0 means a row with no key (Nk = 0): O = 0, LSE = -inf. A NaN l (NaN inputs)
    # stays NaN in both: read as "no key", a merge would weight it 0 and hide the NaN.
    empty = l == 0
    O = (acc / torch.where(empty, 1.0, l)).to(q.dtype)
    LSE = torch.where(empty, -math.inf, m + torch.log(torch.where(empty, 1.0, l)))
    return O.reshape(B, H, Nq, d).contiguous(), LSE.reshape(B, H, Nq).contiguous()


def attention_backward_torch(dO, dLSE, q, k, v, O, LSE, causal, scale, block_n=CPU_BLOCK_N):
    """Tiled backward: ``(dQ, dK, dV)``, contiguous, shapes and dtypes of q, k, v.

    ``D = rowsum(dO * O) - dLSE`` (a gradient that reaches the LSE output adds ``P * dLSE`` to
    dS), then per key tile j: ``P_j = exp(S_j - LSE)``, ``dV_j = P_j^T dO``,
    ``dS_j = P_j * (dO V_j^T - D)``, ``dQ += scale dS_j K_j``, ``dK_j = scale dS_j^T Q``; dK_j
    and dV_j summed over the G query heads that share a K/V head. Any strides.
    """
    B, H, Nq, Nk, d = _check_inputs(q, k, v)
    Hk = k.shape[1]
    G = H // Hk if Hk else 0

    def grouped(t):  # (B, Hq, ...) -> (B, Hk, G, ...), a view
        return t.float().unflatten(1, (Hk, G))

    Q, dOf = grouped(q), grouped(dO)
    D = (dOf * grouped(O)).sum(-1, keepdim=True) - grouped(dLSE)[..., None]
    L = grouped(LSE)[..., None]
    L = torch.where(L == -math.inf, math.inf, L)  # a row with no key: P = exp(S - inf) = 0
    rows = torch.arange(Nq, device=q.device)[:, None]
    dQ = torch.zeros(Q.shape, device=q.device)
    dK = torch.zeros(B, Hk, Nk, d, device=q.device)
    dV = torch.zeros(B, Hk, Nk, d, device=q.device)
    stop = min(Nk, Nq) if causal else Nk  # key tiles past every query get zero gradient
    for start in range(0, stop, block_n):
        end = min(start + block_n, Nk)
        K_j, V_j = k[:, :, start:end].float()[:, :, None], v[:, :, start:end].float()[:, :, None]
        S = (Q @ K_j.transpose(-1, -2)) * scale
        if causal:
            cols = start + torch.arange(end - start, device=q.device)[None, :]
            S = S.masked_fill(cols > rows, -math.inf)
        P = torch.exp(S - L)
        dV[:, :, start:end] = (P.transpose(-1, -2) @ dOf).sum(2)
        dS = P * (dOf @ V_j.transpose(-1, -2) - D)
        dQ += scale * (dS @ K_j)
        dK[:, :, start:end] = scale * (dS.transpose(-1, -2) @ Q).sum(2)
    return dQ.reshape(q.shape).to(q.dtype), dK.to(k.dtype), dV.to(v.dtype)


# =============================================================================================
# Configurations of the Triton kernels: fixed inside the op, tuned (if at all) outside
# =============================================================================================


def pin_configs(d, dtype, configs):
    """Use ``configs`` (``{"forward", "dkdv", "dq"}`` -> ``triton.Config``) for head dim d."""
    missing = {"forward", "dkdv", "dq"} - set(configs)
    if missing:
        raise ValueError(f"configs lacks {sorted(missing)}: give one triton.Config per kernel")
    _pinned[(int(d), dtype)] = dict(configs)


def pinned_configs(d, dtype):
    """The configurations the op launches at head dim d: pinned ones, else chapter 09's
    ``fixed_configs`` (the best-ranked valid configuration of each search space, untimed)."""
    return _pinned.get((int(d), dtype)) or fat.fixed_configs(d, dtype)


def tune_outside(q, k, v, causal=True):
    """Run chapter 09's autotuner once, eagerly, at this shape, and pin what it chose.

    GPU only; call it before ``torch.compile`` runs the model. Returns the pinned configs.
    """
    if not q.is_cuda:
        raise RuntimeError("tune_outside times kernels on a GPU; the CPU path has nothing to tune")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"dtype {q.dtype}: only float16 and bfloat16 are autotuned (float32 runs "
                        "the fixed FP32_GPU_CONFIGS)")
    O, LSE = fat.attention_forward(q, k, v, causal)  # config=None: the autotuner
    fat.attention_backward(q, k, v, O, LSE, torch.randn_like(O), causal)
    best = {kind: fat._autotuned(kind).best_config for kind in ("forward", "dkdv", "dq")}
    pin_configs(q.shape[-1], q.dtype, best)
    return best


class use_interpreter:  # lower case: used like a function, `with ops.use_interpreter():`
    """Context manager: CPU tensors run chapter 09's Triton kernels in the interpreter (slow).

    Only in CPU mode (``TRITON_INTERPRET=1``); the op's contract does not change, only who
    computes.
    """

    def __init__(self, on=True):
        if on and not fat.INTERPRETED:
            raise RuntimeError("the Triton interpreter is off (GPU mode): CPU tensors use the "
                               "PyTorch implementation")
        self.on, self.before = bool(on), _interpreter["on"]

    def __enter__(self):
        _interpreter["on"] = self.on
        return self

    def __exit__(self, *exc):
        _interpreter["on"] = self.before


class poison_outputs:  # lower case: used like a function, `with ops.poison_outputs():`
    """Context manager for tests: the kernels' outputs (O, LSE, dQ, dK, dV) are allocated full
    of NaN instead of uninitialised, so an element a kernel forgets to write shows in a check.
    (The PyTorch path computes its outputs, it never writes into an allocated buffer.)"""

    def __init__(self, on=True):
        self.on, self.before = bool(on), _poison["on"]

    def __enter__(self):
        _poison["on"] = self.on
        return self

    def __exit__(self, *exc):
        _poison["on"] = self.before


def _triton(t):
    return t.is_cuda or (fat.INTERPRETED and _interpreter["on"])


# =============================================================================================
# The operators
# =============================================================================================


def _new(shape, dtype, device):
    """A fresh contiguous output (NaN-filled under :class:`poison_outputs`)."""
    if _poison["on"]:
        return torch.full(shape, math.nan, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _kv_heads(t, group):
    """K or V for chapter 09's kernels: contiguous, each head repeated for its group of query
    heads (a copy only when t is a strided view or group > 1)."""
    return t.repeat_interleave(group, dim=1) if group > 1 else t.contiguous()


def _group_sum(dt, Hk, dtype):
    """dK or dV of the Hq repeated heads ``(B, Hq, Nk, d)`` summed per K/V head, float32."""
    B, Hq, Nk, d = dt.shape
    if Hq == Hk:
        return dt
    return dt.view(B, Hk, Hq // Hk, Nk, d).float().sum(2).to(dtype)


@torch.library.custom_op("course::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 forward: ``(O, LSE)``, the module's contract (any strides, GQA).

    O contiguous ``(B, Hq, Nq, d)`` in q's dtype; LSE contiguous ``(B, Hq, Nq)`` float32,
    natural log, -inf for a row with no key; ``causal``: top-left.
    """
    B, H, Nq, Nk, d = _check_inputs(q, k, v)
    _check_scale(scale)
    if not _triton(q):
        return attention_forward_torch(q, k, v, causal, scale)
    O, LSE = _new((B, H, Nq, d), q.dtype, q.device), _new((B, H, Nq), torch.float32, q.device)
    if O.numel() == 0 or Nk == 0:  # nothing to launch: empty outputs, or rows with no key
        return O.zero_(), LSE.fill_(-math.inf)
    group = H // k.shape[1]
    config = pinned_configs(d, q.dtype)["forward"]
    fat.attention_forward(q.contiguous(), _kv_heads(k, group), _kv_heads(v, group), causal,
                          scale, out=(O, LSE), config=config)
    return O, LSE


@flash_attn_fwd.register_fake
def _(q, k, v, causal, scale):
    # What the real op returns, as metadata: a fresh contiguous O (B, Hq, Nq, d) in q's dtype and
    # LSE (B, Hq, Nq) float32, whatever q's strides. Not empty_like(q): for a transposed q that
    # copies q's strides, and the real O is contiguous (opcheck: "Stride mismatch").
    B, H, Nq, _, d = _check_inputs(q, k, v)
    _check_scale(scale)
    return q.new_empty((B, H, Nq, d)), q.new_empty((B, H, Nq), dtype=torch.float32)


@torch.library.custom_op("course::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(dO: torch.Tensor, dLSE: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, O: torch.Tensor, LSE: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2 backward: ``(dQ, dK, dV)``, fresh contiguous, shapes and dtypes of q,
    k, v (dK, dV summed over each group of query heads); dLSE: the gradient reaching the LSE."""
    _check_inputs(q, k, v)
    if not _triton(q):
        return attention_backward_torch(dO, dLSE, q, k, v, O, LSE, causal, scale)
    return _backward_triton(dO, dLSE, q, k, v, O, LSE, causal, scale)


@flash_attn_bwd.register_fake
def _(dO, dLSE, q, k, v, O, LSE, causal, scale):
    _check_inputs(q, k, v)  # fresh contiguous tensors like q, k, v, whatever their strides
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _backward_triton(dO, dLSE, q, k, v, O, LSE, causal, scale):
    """Chapter 09's backward with pinned configs; dLSE enters as D = rowsum(dO * O) - dLSE."""
    (B, H, Nq, d), (Hk, Nk) = q.shape, k.shape[1:3]
    dQ, dK, dV = (_new((B, H, N, d), q.dtype, q.device) for N in (Nq, Nk, Nk))
    if dQ.numel() == 0 or dK.numel() == 0:  # no query or no key: every gradient is zero
        return dQ.zero_(), _new(k.shape, k.dtype, k.device).zero_(), \
            _new(v.shape, v.dtype, v.device).zero_()
    configs = pinned_configs(d, q.dtype)
    fat.attention_backward(q.contiguous(), _kv_heads(k, H // Hk), _kv_heads(v, H // Hk),
                           O.contiguous(), LSE.float().contiguous(), dO.contiguous(), causal,
                           scale, out=(dQ, dK, dV), dkdv_config=configs["dkdv"],
                           dq_config=configs["dq"], dlse=dLSE.float().contiguous())
    return dQ, _group_sum(dK, Hk, k.dtype), _group_sum(dV, Hk, v.dtype)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    O, LSE = output
    ctx.save_for_backward(q, k, v, O, LSE)  # O and LSE, not P: the backward recomputes P
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, dO, dLSE):
    q, k, v, O, LSE = ctx.saved_tensors
    if dLSE is None:  # the LSE output was not used
        dLSE = torch.zeros_like(LSE)
    dQ, dK, dV = flash_attn_bwd(dO, dLSE, q, k, v, O, LSE, ctx.causal, ctx.scale)
    return dQ, dK, dV, None, None  # no gradient for causal and scale


flash_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def flash_attention(q, k, v, causal=False, scale=None):
    """``O = softmax(scale * Q K^T [causal mask]) V`` through the course's operator.

    Args:
        q: ``(B, Hq, Nq, d)``; k, v: ``(B, Hk, Nk, d)`` with Hk dividing Hq (grouped-query
            attention); d in SUPPORTED_D; any strides (a model's ``(B, N, H, d)`` projection
            after ``.transpose(1, 2)`` needs no ``.contiguous()``). CUDA: float16, bfloat16
            (float32 exact and slow); CPU: float32, float16, bfloat16.
        causal: ``False``; ``True`` or ``"top_left"`` (the default alignment: query r sees keys
            c <= r, as SDPA's ``is_causal``); ``"bottom_right"`` (c <= r + Nk - Nq) only when
            Nq == Nk, where it is the same mask, else NotImplementedError.
        scale: default ``1 / sqrt(d)``; a finite number > 0.

    Returns O, a fresh contiguous ``(B, Hq, Nq, d)`` tensor in q's dtype. (The op's LSE, not
    returned here: ``(B, Hq, Nq)`` float32, natural log, -inf for a row with no key.) Empty
    inputs give an empty O; Nk = 0 gives O = 0. Differentiable in q, k, v; no graph break under
    ``torch.compile(fullgraph=True, dynamic=True)``.
    """
    _, _, Nq, Nk, d = _check_inputs(q, k, v)
    align = causal_alignment(causal, where="ops.flash_attention")
    if align == BOTTOM_RIGHT and Nq != Nk:
        raise NotImplementedError(
            f"ops.flash_attention aligns the causal mask top_left only (Nq={Nq}, Nk={Nk}, where "
            "bottom_right differs): pass causal=True / 'top_left', or use an implementation "
            "with bottom-right alignment")
    # int(d): the head dim is a constant of the kernel (a guard under dynamic shapes, not a
    # symbol), so the default scale is a plain float
    scale = 1.0 / math.sqrt(int(d)) if scale is None else scale
    _check_scale(scale)
    O, _ = flash_attn_fwd(q, k, v, align is not None, float(scale))
    return O
