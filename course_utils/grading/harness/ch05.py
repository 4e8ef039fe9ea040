"""Chapter 05 (memory coalescing): the constants its notebooks import, and the student-side
traced launch of the transpose exercise.

Nothing here knows an expected value: the grader (``course_utils.grading.specs.ch05``) compares the
transposed matrix with its own, and judges the traffic figures this module measures.
"""

from __future__ import annotations

import math

TILE = 32  # 05.swizzled_transpose: a TILE x TILE tile per block
BLOCK_ROWS = 8  # ... moved by TILE x BLOCK_ROWS threads, each handling TILE / BLOCK_ROWS rows

__all__ = ["BLOCK_ROWS", "TILE", "traced_transpose"]


def traced_transpose(kernel, src):
    """Run ``kernel[grid, (TILE, BLOCK_ROWS)](src, dst)`` under the memory tracer (simulator).

    ``src``: an M x N float32 CPU tensor. Returns a dict of data: ``dst`` (N x M, NaN where
    nothing was written), the worst sectors per warp request of the ``src`` loads and ``dst``
    stores, the shared-memory requests' count and worst bank-conflict degree (with the line
    and source of the worst one), the bytes of each shared array, and the tracer's summary.
    """
    import torch

    from ...toolbox import trace

    M, N = src.shape
    dst = torch.full((N, M), math.nan)
    grid = (math.ceil(N / TILE), math.ceil(M / TILE))
    t = trace.launch(kernel, grid, (TILE, BLOCK_ROWS), src, dst, names=("src", "dst"))
    shared = [r for r in t.requests if r.space == "shared"]
    worst = max(shared, key=lambda r: r.conflict_degree) if shared else None
    itemsize = {r.array: r.itemsize for r in shared}
    return {
        "dst": dst,
        "src_load_sectors": int(t.max_sectors_per_request("src", "load")),
        "dst_store_sectors": int(t.max_sectors_per_request("dst", "store")),
        "shared_requests": len(shared),
        "worst_conflict": worst.conflict_degree if worst else 0,
        "worst_line": worst.line if worst else 0,
        "worst_source": worst.source if worst else "",
        "shared_bytes": {
            name: int(math.prod(t.shapes[name])) * size for name, size in sorted(itemsize.items())
        },
        "summary": t.summary(),
    }
