"""course_utils: the support package of the FlashAttention course.

Start every notebook with::

    import course_utils as cu
    cu.setup()          # GPU if there is one, else the CPU simulator/interpreter

Modules (import them as ``from course_utils import grader`` etc.):

- ``runtime``   mode switch: ``setup``, ``on_gpu``, ``pick``, ``device``, ``kernel_array``
- ``reference`` float64 attention and softmax: the ground truth of every check
- ``checks``    compare a candidate with the reference on fresh inputs and edge cases
- ``grader``    ``check(exercise_id, fn)``, and grading whole notebooks
- ``cuda``      CUDA C++: ``load_cuda`` (load_inline), ``compile_kernel`` (NVRTC),
                ``resource_usage`` (registers, shared memory, spills)
- ``bench``     ``time_fn``, ``attention_flops``, result tables
- ``plots``     small drawing helpers (tile maps, thread maps)
- ``recorded``  results measured on a GPU, shipped as JSON for CPU readers
- ``trace``     memory-access tracer (simulator): sectors per request, bank conflicts
- ``occupancy`` occupancy calculator for five GPU generations (and the driver's, on a GPU);
  FlashAttention budgets
- ``portability`` the compile matrix: will a kernel compile and launch on sm_75 .. sm_90?
- ``hardware``  device facts, the FP32 FMA peak, kernel names, Nsight Compute counters
- ``mma``       CPU model of the tensor-core instruction mma.sync.m16n8k16 and of ldmatrix:
                which lane holds which element, and what one instruction computes
- ``serving``   attention as it is served (chapter 11): float64 references for decoding and
                packed variable lengths, bottom-right masks, paged caches, the LSE merge
- ``ops``       the course's attention as a ``torch.library`` operator (chapter 12)
- ``tinygpt``   a small GPT with pluggable attention, trained on generated sums (chapter 12)
- ``ring``      ring attention over ranks of torch.distributed, gloo or NCCL (chapter 13)
- ``ulysses``   DeepSpeed-Ulysses: all-to-alls trade sequence shards for head shards (chapter 13)
- ``attention`` the front door, callable: ``cu.attention(q, k, v, causal=..., impl="triton" |
                "mma" | "hopper" | "cuda" | "torch" | "reference", layout="bhnd" | "bnhd" |
                "bnd")`` with autograd; ``cu.attention.available(q)`` lists the impls that run
                here (docs/contract.md: the contract every attention function keeps)

Command line: ``python -m course_utils doctor | grade | record | assign | strip``.
"""

from .runtime import (
    Mode,
    capability,
    device,
    half_dtype,
    kernel_array,
    mode,
    needs_gpu,
    on_gpu,
    pick,
    setup,
    synchronize,
)

__all__ = [
    "Mode",
    "capability",
    "device",
    "half_dtype",
    "kernel_array",
    "mode",
    "needs_gpu",
    "on_gpu",
    "pick",
    "setup",
    "synchronize",
]


def __getattr__(name):
    """``course_utils.attention`` (the front door) imported on first use: importing the package
    stays as light as before (no kernels, no Triton)."""
    if name == "attention":
        import importlib

        return importlib.import_module(".attention", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
