"""The course's attention as PyTorch operators: chapter 12 (a kernel inside a model).

Public API (inputs ``(B, H, N, d)``, any strides; output ``(B, H, Nq, d)`` like q)::

    O = flash_attention(q, k, v, causal=False, scale=None)      # differentiable, compilable
    O, LSE = torch.ops.course.flash_attn_fwd(q, k, v, causal, scale)    # LSE: natural log
    dQ, dK, dV = torch.ops.course.flash_attn_bwd(dO, dLSE, q, k, v, O, LSE, causal, scale)

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

The LSE is in natural-log units (chapter 09 converts its base-2 running max back): a consumer
that merges partial results with ``exp(LSE_1 - LSE)`` gets the right weights.
"""

from __future__ import annotations

import math

import torch

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
    "tune_outside",
    "use_interpreter",
]

_pinned: dict = {}  # (d, dtype) -> {"forward": Config, "dkdv": Config, "dq": Config}
_interpreter = {"on": False}  # CPU tensors through chapter 09's kernels in the interpreter


# =============================================================================================
# Checks: metadata only (shape, dtype, device), so they run on fake tensors too
# =============================================================================================


def _check_inputs(q, k, v):
    """Raise a clear error for inputs the op cannot take; return ``(B, H, Nq, Nk, d)``."""
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
    B, H, Nq, d = q.shape
    if k.shape != v.shape or k.shape[:2] != (B, H) or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v "
                         "must be (B, H, Nk, d) with the B, H and d of q")
    if d not in SUPPORTED_D:
        raise ValueError(f"head dim d={d}: the kernels support {SUPPORTED_D}")
    Nk = k.shape[2]
    if Nq < 1 or Nk < 1:
        raise ValueError(f"Nq={Nq}, Nk={Nk}: attention needs at least one query and one key")
    return B, H, Nq, Nk, d


def _check_scale(scale):
    # comparisons, not math.isfinite: under torch.compile a float can be symbolic (NaN fails both)
    if not (isinstance(scale, (int, float)) and 0 < scale < math.inf):
        raise ValueError(f"scale={scale!r}: must be a finite number > 0 (default 1/sqrt(d))")


# =============================================================================================
# The CPU implementation: FlashAttention-2 in PyTorch, key tile by key tile
# =============================================================================================


def attention_forward_torch(q, k, v, causal, scale, block_n=CPU_BLOCK_N):
    """Tiled forward with the online softmax: ``(O, LSE)``, O like q, LSE ``(B, H, Nq)`` fp32.

    All query rows at once, key tiles of ``block_n`` in turn (the kernel's loop over j, its
    programs over i run as one batched matmul): S_j, P_j are ``(B, H, Nq, block_n)``, never
    ``(Nq, Nk)``. Float32 arithmetic, natural-log units.
    """
    B, H, Nq, Nk, d = _check_inputs(q, k, v)
    Q = q.float()
    rows = torch.arange(Nq, device=q.device)[:, None]
    m = torch.full((B, H, Nq, 1), -math.inf, device=q.device)
    l = torch.zeros(B, H, Nq, 1, device=q.device)
    acc = torch.zeros(B, H, Nq, d, device=q.device)
    stop = min(Nk, Nq) if causal else Nk  # top-left causal: keys >= Nq follow every query
    for start in range(0, stop, block_n):
        K_j, V_j = k[:, :, start:start + block_n].float(), v[:, :, start:start + block_n].float()
        S = (Q @ K_j.transpose(-1, -2)) * scale
        if causal:  # query i sees key j <= i
            cols = start + torch.arange(K_j.shape[2], device=q.device)[None, :]
            S = S.masked_fill(cols > rows, -math.inf)
        m_new = torch.maximum(m, S.amax(-1, keepdim=True))
        alpha = torch.exp(m - m_new)  # rescales what was summed under the old max
        P = torch.exp(S - m_new)
        l = l * alpha + P.sum(-1, keepdim=True)
        acc = acc * alpha + P @ V_j
        m = m_new
    O = (acc / l).to(q.dtype)
    LSE = (m + torch.log(l)).squeeze(-1)  # natural log: every query sees key 0, so l > 0
    return O.contiguous(), LSE.contiguous()


def attention_backward_torch(dO, dLSE, q, k, v, O, LSE, causal, scale, block_n=CPU_BLOCK_N):
    """Tiled backward: ``(dQ, dK, dV)`` like q, k, v; P recomputed per key tile from the LSE.

    ``D = rowsum(dO * O) - dLSE`` (a gradient that reaches the LSE output adds ``P * dLSE`` to
    dS), then per key tile j: ``P_j = exp(S_j - LSE)``, ``dV_j = P_j^T dO``,
    ``dS_j = P_j * (dO V_j^T - D)``, ``dQ += scale dS_j K_j``, ``dK_j = scale dS_j^T Q``.
    """
    B, H, Nq, Nk, d = _check_inputs(q, k, v)
    Q, dOf = q.float(), dO.float()
    D = (dOf * O.float()).sum(-1, keepdim=True) - dLSE.float()[..., None]
    L = LSE[..., None]
    rows = torch.arange(Nq, device=q.device)[:, None]
    dQ = torch.zeros(B, H, Nq, d, device=q.device)
    dK = torch.zeros(B, H, Nk, d, device=q.device)
    dV = torch.zeros(B, H, Nk, d, device=q.device)
    stop = min(Nk, Nq) if causal else Nk  # key tiles past every query get zero gradient
    for start in range(0, stop, block_n):
        end = min(start + block_n, Nk)
        K_j, V_j = k[:, :, start:end].float(), v[:, :, start:end].float()
        S = (Q @ K_j.transpose(-1, -2)) * scale
        if causal:
            cols = start + torch.arange(end - start, device=q.device)[None, :]
            S = S.masked_fill(cols > rows, -math.inf)
        P = torch.exp(S - L)
        dV[:, :, start:end] = P.transpose(-1, -2) @ dOf
        dS = P * (dOf @ V_j.transpose(-1, -2) - D)
        dQ += scale * (dS @ K_j)
        dK[:, :, start:end] = scale * (dS.transpose(-1, -2) @ Q)
    return dQ.to(q.dtype), dK.to(k.dtype), dV.to(v.dtype)


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


def _triton(t):
    return t.is_cuda or (fat.INTERPRETED and _interpreter["on"])


# =============================================================================================
# The operators
# =============================================================================================


@torch.library.custom_op("course::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 forward: ``(O, LSE)``; q, k, v contiguous ``(B, H, N, d)``."""
    _check_inputs(q, k, v)
    _check_scale(scale)
    if not _triton(q):
        return attention_forward_torch(q, k, v, causal, scale)
    config = pinned_configs(q.shape[-1], q.dtype)["forward"]
    return fat.attention_forward(q, k, v, causal, scale, config=config)


@flash_attn_fwd.register_fake
def _(q, k, v, causal, scale):
    # What the real op returns, as metadata: O = empty_like(q) (q is contiguous, so O is),
    # LSE a fresh contiguous (B, H, Nq) float32. The strides must match the real outputs.
    B, H, Nq, _, _ = _check_inputs(q, k, v)
    _check_scale(scale)
    return torch.empty_like(q), q.new_empty((B, H, Nq), dtype=torch.float32)


@torch.library.custom_op("course::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(dO: torch.Tensor, dLSE: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, O: torch.Tensor, LSE: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2 backward: ``(dQ, dK, dV)``; dLSE is the gradient reaching the LSE."""
    _check_inputs(q, k, v)
    dO, dLSE = dO.contiguous(), dLSE.contiguous()
    if not _triton(q):
        return attention_backward_torch(dO, dLSE, q, k, v, O, LSE, causal, scale)
    return _backward_triton(dO, dLSE, q, k, v, O, LSE, causal, scale)


@flash_attn_bwd.register_fake
def _(dO, dLSE, q, k, v, O, LSE, causal, scale):
    _check_inputs(q, k, v)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _backward_triton(dO, dLSE, q, k, v, O, LSE, causal, scale):
    """Chapter 09's backward with pinned configs; dLSE enters as D = rowsum(dO * O) - dLSE."""
    configs = pinned_configs(q.shape[-1], q.dtype)
    return fat.attention_backward(q, k, v, O, LSE, dO, causal, scale, dkdv_config=configs["dkdv"],
                                  dq_config=configs["dq"], dlse=dLSE.float())


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
    """``O = softmax(scale * Q K^T [causal, top-left]) V`` through the course's operator.

    q ``(B, H, Nq, d)``, k, v ``(B, H, Nk, d)``, d in SUPPORTED_D; any strides (made contiguous
    here, e.g. after splitting a model's qkv projection into heads). CUDA: float16, bfloat16
    (float32 exact and slow); CPU: float32, float16, bfloat16. Differentiable in q, k, v; no
    graph break under ``torch.compile(fullgraph=True)``.
    """
    _check_inputs(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal={causal!r}: pass True or False")
    # int(d): the head dim is a constant of the kernel (a guard under dynamic shapes, not a
    # symbol), so the default scale is a plain float
    scale = 1.0 / math.sqrt(int(q.shape[-1])) if scale is None else scale
    _check_scale(scale)
    O, _ = flash_attn_fwd(q.contiguous(), k.contiguous(), v.contiguous(), causal, float(scale))
    return O
