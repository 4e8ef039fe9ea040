"""The chapter list and the README's chapter table: what each chapter builds, and its headline.

:data:`CHAPTERS` pairs each chapter with its build text and its headline function (from
:mod:`.headlines_kernels` and :mod:`.headlines_systems`); :func:`headlines` runs them on the
recordings and :func:`chapter_table` draws the README's table. ``docs/results.md`` walks the same
list (:func:`.renderers.render_results`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .common import ROOT, Headline, Recordings
from .headlines_kernels import _h00, _h01, _h02, _h03, _h04, _h05, _h06, _h07, _h08, _h09, _h10
from .headlines_systems import _h11, _h12, _h13, _h14

# (number, what you build, headline or None): the build text holds no measured number.
CHAPTERS: list[tuple[str, str, Callable[[Recordings], Headline] | None]] = [
    ("00", "SMs, warps, blocks and grids; the `i < n` guard; vector add in Numba, Triton and "
           "CUDA C++; warp divergence measured; tensor cores named once", _h00),
    ("01", "attention from a classifier's last layer; scale, heads, masks, the memory wall",
     _h01),
    ("02", "stable and online softmax, the (m, l, acc) merge, a Numba softmax kernel", _h02),
    ("03", "roofline, fusion, bytes in flight, recomputation; tile and wave quantization; sizes "
           "by divisibility, GPT-2's vocabulary padding", _h03),
    ("04", "naive, shared-memory and register-tiled matmul; a ladder of eight CUDA C++ SGEMMs "
           "explained by ptxas and Nsight Compute", _h04),
    ("05", "sectors per request and bank conflicts, traced in the simulator; copy and "
           "transposes measured", _h05),
    ("06", "occupancy, compiler resource reports, local memory and spills, FlashAttention "
           "budgets", _h06),
    ("07", "FlashAttention-2 forward in PyTorch, Numba, CUDA C++ and NVRTC", _h07),
    ("08", "the backward: derivations, recomputation, atomic vs deterministic dQ; PyTorch, "
           "Numba, CUDA C++", _h08),
    ("09", "FlashAttention-2 forward and backward in Triton (bf16/fp16, autotuned, any N)", _h09),
    ("10", "FlashAttention-2 on tensor cores in CUDA C++: `mma.sync` fragments (modelled on "
           "the CPU), `ldmatrix`, swizzles, `cp.async`, a deterministic and an atomic-dQ backward",
           _h10),
    ("11", "serving: split-KV decoding of 1-8 new tokens per sequence, per-sequence split "
           "plans, GQA, a paged KV cache, varlen with `cu_seqlens`, windows, softcap", _h11),
    ("12", "the kernel as a `torch.library` custom op under `torch.compile(fullgraph=True)` "
           "and CUDA graphs; a tiny GPT trained and checked with it; a KV-cache write as a "
           "mutating op", _h12),
    ("13", "ring attention over ranks: double-buffered K/V, the (O, LSE) merge, zig-zag load "
           "balance, the backward; all-gather context parallel for GQA; DeepSpeed-Ulysses",
     _h13),
    ("14", "Hopper: TMA, mbarriers, `wgmma`, warp specialization, ping-pong, FP8; `wgmma` "
           "descriptors modelled byte by byte", _h14),
]


def notebook(number: str, root: Path = ROOT) -> str:
    (path,) = sorted((root / "notebooks").glob(f"{number}_*.ipynb"))
    return path.stem


def headlines(rec: Recordings | None = None) -> dict[str, Headline | None]:
    rec = rec or Recordings()
    return {n: (fn(rec) if fn else None) for n, _, fn in CHAPTERS}


def chapter_table(rec: Recordings | None = None, root: Path = ROOT) -> str:
    """The README's chapter table: one line per chapter, headlines from the recordings."""
    heads = headlines(rec)
    lines = ["| # | notebook | what you build | headline (measured; device, runs, date, "
             "recording) |", "|---|---|---|---|"]
    for n, build, _ in CHAPTERS:
        h = heads[n]
        lines.append(f"| {n} | `{notebook(n, root)}` | {build} | {h.cell() if h else '-'} |")
    return "\n".join(lines)
