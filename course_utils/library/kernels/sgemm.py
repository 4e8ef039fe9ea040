"""Chapter 04's ladder of float32 matmul kernels in CUDA C++ (``sgemm.cu``), from Python.

Each step of the ladder changes one thing about the kernel before it (the top of ``sgemm.cu``
lists them). All take float32, contiguous, 2D CUDA tensors of any sizes::

    from course_utils.library.kernels import sgemm
    C = sgemm.run(A, B, step="pipeline")      # A (M, K), B (K, N) -> C (M, N), float32
    sgemm.blocks_per_sm("pipeline")           # how many of its blocks fit on one SM
    print(sgemm.source("reg2d"))              # the CUDA C++ of one step

Building needs a GPU and nvcc (``load_cuda``, about a minute the first time, cached after).
Without a GPU, ``source`` still works and ``resources()`` gives ptxas's register report.
"""

from __future__ import annotations

from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "sgemm.cu"

# step name -> (index in sgemm.cu, kernel function, block tile (BM, BN), threads per block)
STEPS = {
    "naive": (0, "sgemm_naive", (16, 16), 256),
    "smem": (1, "sgemm_smem", (32, 32), 1024),
    "reg1d": (2, "sgemm_reg1d", (64, 64), 512),
    "reg2d": (3, "sgemm_reg2d", (128, 128), 256),
    "vec4": (4, "sgemm_vec4<false>", (128, 128), 256),
    "conflict_free": (5, "sgemm_vec4<true>", (128, 128), 256),
    "prefetch": (6, "sgemm_prefetch", (128, 128), 256),
    "pipeline": (7, "sgemm_pipeline", (128, 128), 256),
}
TILE = {name: tile for name, (_, _, tile, _) in STEPS.items()}
WAVY_STEP = "prefetch"  # one fixed 128 x 128 tile, 2 blocks per SM: chapter 03 sweeps it

_module = None


def _index(step: str) -> int:
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}; the steps are {', '.join(STEPS)}")
    return STEPS[step][0]


def load(verbose: bool = False):
    """The built extension: ``sgemm(A, B, i)``, ``sgemm_into(A, B, C, i)``,
    ``sgemm_blocks_per_sm(i)``, with ``i`` a step's index (``STEPS[name][0]``)."""
    global _module
    if _module is None:
        from course_utils.toolbox.cuda import load_cuda

        _module = load_cuda(SOURCE, ["sgemm", "sgemm_into", "sgemm_blocks_per_sm"], name="sgemm",
                            verbose=verbose)
    return _module


def run(A, B, step: str = "pipeline", out=None):
    """C = A @ B with the kernel of ``step``: A (M, K), B (K, N) float32 CUDA -> C (M, N).

    ``out``: a float32 (M, N) CUDA tensor to write C into (e.g. one filled with NaN, so that a
    check sees any element the kernel did not write); by default a new tensor.
    """
    index = _index(step)
    return load().sgemm(A, B, index) if out is None else load().sgemm_into(A, B, out, index)


def blocks_per_sm(step: str = "pipeline") -> int:
    """Resident blocks of ``step``'s kernel per SM, from the CUDA occupancy API (GPU only)."""
    return int(load().sgemm_blocks_per_sm(_index(step)))


def source(step: str) -> str:
    """The CUDA C++ of one step's kernel, from its comment block to its closing brace."""
    from course_utils.toolbox.cuda import _function_definitions, _matching

    _index(step)
    text = SOURCE.read_text(encoding="utf-8")
    name = STEPS[step][1].split("<")[0]
    kernel = next(f for f in _function_definitions(text) if f.is_kernel and f.name == name)
    lines = text.split("\n")
    first = kernel.line - 1  # the line of the name; walk up over its declaration and comments
    while first > 0 and lines[first - 1].startswith(("template", "__global__", "//")):
        first -= 1
    start = sum(len(line) + 1 for line in lines[:first])
    body = text.index("{", sum(len(line) + 1 for line in lines[:kernel.line - 1]))
    return text[start:_matching(text, body, "{", "}") + 1]


def resources(extra_flags=()):
    """ptxas's report (registers, spills, shared memory) for every kernel, compiled for sm_90."""
    from course_utils.toolbox.cuda import resource_usage

    return resource_usage(SOURCE.read_text(encoding="utf-8"), extra_flags=tuple(extra_flags))
