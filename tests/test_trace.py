"""The memory tracer measures what the coalescing chapter teaches: sectors and bank conflicts."""

import numpy as np
import pytest
import torch
from numba import cuda, float32

from course_utils import runtime, trace

TILE = 32

simulator_only = pytest.mark.skipif(runtime.on_gpu(), reason="tracing needs the CUDA simulator")


@cuda.jit
def strided_read(src, dst, stride):
    i = cuda.threadIdx.x
    dst[i] = src[i * stride]


@cuda.jit
def column_read(A, out):
    i = cuda.threadIdx.x
    out[i] = A[i, 0]  # lane i reads row i: one row (128 bytes) apart


@cuda.jit
def shared_column_read(A, out, padded):
    tile = cuda.shared.array((TILE, TILE), float32)
    tile_p = cuda.shared.array((TILE, TILE + 1), float32)
    i = cuda.threadIdx.x
    for r in range(TILE):
        tile[r, i] = A[r, i]
        tile_p[r, i] = A[r, i]
    cuda.syncthreads()
    if padded:
        out[i] = tile_p[i, 0]
    else:
        out[i] = tile[i, 0]


def _run(kernel, *args, names):
    return trace.launch(kernel, 1, 32, *args, names=names)


@simulator_only
def test_contiguous_float32_is_4_sectors_full_efficiency():
    src, dst = torch.arange(64, dtype=torch.float32), torch.zeros(32)
    t = _run(strided_read, src, dst, 1, names=("src", "dst"))
    assert torch.equal(dst, src[:32])  # writes go through to the tensor
    assert t.sectors_per_request("src", "load") == 4
    assert t.efficiency("src", "load") == 1.0
    assert len(t.select("src", "load")) == 1 and t.requests[0].lanes == tuple(range(32))


@simulator_only
def test_stride_2_is_8_sectors_half_efficiency():
    src, dst = torch.arange(64, dtype=torch.float32), torch.zeros(32)
    t = _run(strided_read, src, dst, 2, names=("src", "dst"))
    assert t.sectors_per_request("src", "load") == 8
    assert t.efficiency("src", "load") == 0.5
    assert t.sectors_per_request("dst", "store") == 4


@simulator_only
def test_misaligned_view_costs_one_more_sector():
    buf, dst = torch.arange(64, dtype=torch.float32), torch.zeros(32)
    t = _run(strided_read, buf[1:], dst, 1, names=("src", "dst"))
    assert t.sectors_per_request("src", "load") == 5


@simulator_only
def test_column_of_32x32_float32_is_32_sectors():
    A, out = torch.randn(32, 32), torch.zeros(32)
    t = _run(column_read, A, out, names=("A", "out"))
    assert t.sectors_per_request("A", "load") == 32
    assert t.efficiency("A", "load") == 1 / 8
    lanes, steps = t.lane_map("A", "load")
    assert (lanes[:, 0] == np.arange(32)).all() and (lanes[:, 1:] == -1).all()


@simulator_only
def test_shared_column_read_conflicts_and_padding():
    A = torch.randn(TILE, TILE)
    for padded, degree in ((0, 32), (1, 1)):
        out = torch.zeros(TILE)
        t = _run(shared_column_read, A, out, padded, names=("A", "out"))
        assert torch.equal(out, A[:, 0])
        name = "tile_p" if padded else "tile"
        assert t.bank_conflicts(name, "load") == degree
        assert t.bank_conflicts(name, "store") == 1  # row writes: 32 consecutive words
        # every loop iteration is its own request
        assert len(t.select(name, "store")) == TILE


def test_bank_conflict_model():
    assert trace.bank_conflict_degree([4 * i for i in range(32)]) == 1
    assert trace.bank_conflict_degree([0] * 32) == 1  # broadcast
    assert trace.bank_conflict_degree([128 * i for i in range(32)]) == 32
    assert trace.bank_conflict_degree([8 * i for i in range(32)]) == 2
    assert trace.sectors_of([0, 4, 28, 32], 4) == {0, 1}
    assert trace.sectors_of([30], 4) == {0, 1}  # an element straddling two sectors


@simulator_only
def test_summary_and_draw_are_deterministic():
    import matplotlib

    matplotlib.use("Agg")
    A, out = torch.randn(32, 32), torch.zeros(32)
    s1 = _run(column_read, A, out, names=("A", "out")).summary()
    t = _run(column_read, A, out, names=("A", "out"))
    assert s1 == t.summary() and "32.0 sectors" in s1 and "line" in s1
    ax = t.draw("A", "load")
    assert ax.get_title().startswith("A load")


@simulator_only
def test_names_and_errors():
    src, dst = torch.arange(64, dtype=torch.float32), torch.zeros(32)
    with pytest.raises(ValueError, match="names has 1"):
        trace.launch(strided_read, 1, 32, src, dst, 1, names=("src",))
    t = trace.launch(strided_read, 1, 32, src, dst, 1)
    assert {r.array for r in t.requests} == {"arg0", "arg1"}
    with pytest.raises(ValueError, match="no load of 'zzz'"):
        t.sectors_per_request("zzz", "load")


def test_gpu_mode_raises_a_clear_error(monkeypatch):
    monkeypatch.setattr(runtime, "on_gpu", lambda: True)
    with pytest.raises(trace.TracingUnavailable, match="COURSE_DEVICE=cpu"):
        trace.launch(strided_read, 1, 32, np.zeros(32), np.zeros(32), 1)
