"""course_utils.simulator: Numba's CUDA simulator with a block scheduler that waits at a barrier
instead of polling. A kernel must see what it saw with Numba's own loop: barriers that hold
every live thread, early returns that do not hang the others, a thread's exception raised
from the launch with its index, and syncthreads_count/_and/_or."""

import threading
import time

import numpy as np
import pytest

from course_utils import runtime

pytestmark = pytest.mark.skipif(runtime.on_gpu(), reason="the simulator runs in CPU mode")

import course_utils as cu  # noqa: E402

cu.setup(verbose=False)
from numba import cuda, float32, int32  # noqa: E402
from numba.cuda.simulator import kernel as simulator  # noqa: E402

N = 64


@cuda.jit
def reverse_through_shared(x, out):
    """Each thread stores one element, a barrier, then reads its mirror: a missing barrier shows."""
    buf = cuda.shared.array(N, float32)
    t = cuda.threadIdx.x
    buf[t] = x[t]
    cuda.syncthreads()
    out[t] = buf[N - 1 - t]


@cuda.jit
def tree_sum(x, out):
    """A shared-memory tree reduction: log2(N) barriers in a loop."""
    buf = cuda.shared.array(N, float32)
    t = cuda.threadIdx.x
    buf[t] = x[cuda.blockIdx.x * N + t]
    cuda.syncthreads()
    step = N // 2
    while step > 0:
        if t < step:
            buf[t] += buf[t + step]
        cuda.syncthreads()
        step //= 2
    if t == 0:
        out[cuda.blockIdx.x] = buf[0]


@cuda.jit
def early_return(out):
    t = cuda.threadIdx.x
    if t % 2:
        return  # these threads never reach the barrier: the others must not wait for them
    out[t] = 1
    cuda.syncthreads()
    out[t] += 1


@cuda.jit
def counts(x, out):
    t = cuda.threadIdx.x
    out[0] = cuda.syncthreads_count(x[t] > 0)
    out[1] = cuda.syncthreads_and(x[t] > 0)
    out[2] = cuda.syncthreads_or(x[t] > 5)


@cuda.jit
def raises_in_one_thread(out):
    t = cuda.threadIdx.x
    cuda.syncthreads()
    if t == 5:
        out[1000] = 1  # out of bounds: IndexError in thread 5
    cuda.syncthreads()
    out[t] = t


def test_the_waiting_scheduler_is_installed():
    assert getattr(simulator, "_course_fast_scheduler", False)


def test_a_barrier_holds_every_thread():
    x = np.arange(N, dtype=np.float32)
    out = np.full(N, np.nan, dtype=np.float32)
    reverse_through_shared[1, N](x, out)
    assert np.array_equal(out, x[::-1])


def test_barriers_in_a_loop_over_several_blocks():
    rng = np.random.default_rng()
    x = rng.standard_normal(3 * N).astype(np.float32)
    out = np.full(3, np.nan, dtype=np.float32)
    tree_sum[3, N](x, out)
    np.testing.assert_allclose(out, x.reshape(3, N).sum(axis=1), rtol=1e-5, atol=1e-5)


def test_threads_that_return_early_do_not_hang_the_barrier():
    out = np.zeros(N, dtype=np.int32)
    done = []
    launch = threading.Thread(target=lambda: (early_return[1, N](out), done.append(True)),
                              daemon=True)
    launch.start()
    launch.join(timeout=30)
    assert done, "the launch hung at a barrier that ended threads never reach"
    assert out[::2].tolist() == [2] * (N // 2) and not out[1::2].any()


def test_syncthreads_count_and_or():
    x = np.zeros(N, dtype=np.int32)
    x[:10] = np.arange(1, 11)
    out = np.full(3, -1, dtype=np.int32)
    counts[1, N](x, out)
    assert out.tolist() == [10, 0, 1]
    x[:] = 1
    counts[1, N](x, out)
    assert out.tolist() == [N, 1, 0]


def test_an_exception_in_one_thread_is_raised_with_its_index():
    out = np.zeros(N, dtype=np.int32)
    start = time.monotonic()
    with pytest.raises(IndexError, match=r"tid=\[5, 0, 0\]"):
        raises_in_one_thread[1, N](out)
    assert time.monotonic() - start < 30
    out2 = np.zeros(N, dtype=np.int32)  # the simulator is usable again afterwards
    early_return[1, N](out2)
    assert out2[0] == 2


def test_the_results_match_numbas_own_loop(monkeypatch):
    """The same launches with Numba's polling loop (saved before the patch): equal outputs."""
    x = np.random.default_rng().standard_normal(2 * N).astype(np.float32)
    ours = np.zeros(2, dtype=np.float32)
    tree_sum[2, N](x, ours)
    theirs = np.zeros(2, dtype=np.float32)
    monkeypatch.setattr(simulator.BlockManager, "run", simulator._course_numba_run)
    monkeypatch.setattr(simulator.BlockThread, "syncthreads", simulator._course_numba_sync)
    tree_sum[2, N](x, theirs)
    assert np.array_equal(ours, theirs)


def test_int32_shared_arrays_still_work():
    @cuda.jit
    def histogram(x, out):
        h = cuda.shared.array(4, int32)
        t = cuda.threadIdx.x
        if t < 4:
            h[t] = 0
        cuda.syncthreads()
        cuda.atomic.add(h, x[t] % 4, 1)
        cuda.syncthreads()
        if t < 4:
            out[t] = h[t]

    x = np.arange(N, dtype=np.int32)
    out = np.zeros(4, dtype=np.int32)
    histogram[1, N](x, out)
    assert out.tolist() == [N // 4] * 4
