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


# The short names of the lectures (``from course_utils import grader``, ``cu.attention``): each
# module lives in the package of its role (docs/ARCHITECTURE.md) and is imported on first use,
# by name, so that importing the package stays light (no kernels, no Triton) and a grading
# worker's copy holds only the modules it imports.
SHORT_NAMES = {
    # toolbox: GPU tools that know no chapter
    "bench": "toolbox.bench", "cuda": "toolbox.cuda", "cuda_cpu": "toolbox.cuda_cpu",
    "doctor": "toolbox.doctor", "hardware": "toolbox.hardware",
    "occupancy": "toolbox.occupancy", "portability": "toolbox.portability",
    "trace": "toolbox.trace",
    # library: what the chapters build
    "attention": "library.attention", "headlines": "library.headlines",
    "hopper": "library.hopper", "hopper_pipeline": "library.hopper_pipeline",
    "kernels": "library.kernels", "kv_cache": "library.kv_cache", "mma": "library.mma",
    "ops": "library.ops", "ring": "library.ring", "serving": "library.serving",
    "tinygpt": "library.tinygpt", "ulysses": "library.ulysses",
    # grading: exercises, checks, the grader and its sandbox
    "assign": "grading.assign", "checks": "grading.checks", "grader": "grading.grader",
    "harness": "grading.harness", "ranks": "grading.ranks", "sandbox": "grading.sandbox",
    "seccomp": "grading.seccomp", "specs": "grading.specs", "watch": "grading.watch",
    "worker_package": "grading.worker_package",
    # publishing: what turns recordings and notebooks into pages
    "colab": "publishing.colab", "plots": "publishing.plots", "results": "publishing.results",
    "show": "publishing.show", "site": "publishing.site", "text": "publishing.text",
}  # fmt: skip


def __getattr__(name):
    """``course_utils.<short name>``: the module of :data:`SHORT_NAMES`, imported on first use."""
    where = SHORT_NAMES.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module = importlib.import_module(f".{where}", __name__)
    globals()[name] = module
    return module
