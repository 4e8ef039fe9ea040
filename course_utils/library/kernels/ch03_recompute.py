"""Chapter 03's fused sigmoid-stack kernels (Numba): forward and backward of
``out = sigmoid(sigmoid(sigmoid(x)))``, once saving ``s1, s2`` and once recomputing them.

Import after ``course_utils.setup()`` (Numba must know whether to use the CUDA simulator)::

    from course_utils.library.kernels import ch03_recompute
    saved_fwd, saved_bwd, recompute_fwd, recompute_bwd = ch03_recompute.make_sigmoid_kernels(4)

Every array is 1D float32 of the same length n (``cu.kernel_array`` of a torch tensor). Each
thread handles ``ILP`` elements, ``blockDim.x`` apart so that each load stays coalesced: a
launch needs ``ceil(n / (threads * ILP))`` blocks. The HBM accesses per element::

    saved_forward(x, s1, s2, out)     reads x               writes s1, s2, out
    saved_backward(dout, s1, s2, dx)  reads dout, s1, s2    writes dx
    recompute_forward(x, out)         reads x               writes out
    recompute_backward(dout, x, dx)   reads dout, x         writes dx   (s1, s2 recomputed)
"""

import math

from numba import cuda, float32

ONE = float32(1.0)  # a float32 constant: 1.0 alone would make every expression float64


@cuda.jit(device=True)
def sigmoid(z):
    return ONE / (ONE + math.exp(-z))


@cuda.jit(device=True)
def sigmoid_stack_grad(g, a, b, o):  # dL/dx from dL/dout = g and s1 = a, s2 = b, out = o
    return g * o * (ONE - o) * b * (ONE - b) * a * (ONE - a)


def make_sigmoid_kernels(ILP):
    """The fused forward and backward kernels of both versions, ILP elements per thread.

    Returns ``(saved_forward, saved_backward, recompute_forward, recompute_backward)``. Numba
    compiles the closure's ``ILP`` as a constant, so the loops unroll and the small local
    arrays live in registers. Every thread first issues all its loads, then computes and stores.
    """

    @cuda.jit
    def saved_forward(x, s1, s2, out):  # 1 read, 3 writes per element
        first, step = cuda.blockIdx.x * cuda.blockDim.x * ILP + cuda.threadIdx.x, cuda.blockDim.x
        xs = cuda.local.array(ILP, float32)
        for r in range(ILP):  # every load issued before any math
            j = first + r * step
            xs[r] = x[j] if j < x.size else ONE
        for r in range(ILP):
            j = first + r * step
            if j < x.size:
                a = sigmoid(xs[r])
                b = sigmoid(a)
                s1[j], s2[j], out[j] = a, b, sigmoid(b)

    @cuda.jit
    def saved_backward(dout, s1, s2, dx):  # 3 reads, 1 write
        first, step = cuda.blockIdx.x * cuda.blockDim.x * ILP + cuda.threadIdx.x, cuda.blockDim.x
        gs = cuda.local.array(ILP, float32)
        as_ = cuda.local.array(ILP, float32)
        bs = cuda.local.array(ILP, float32)
        for r in range(ILP):
            j = first + r * step
            if j < dx.size:
                gs[r], as_[r], bs[r] = dout[j], s1[j], s2[j]
        for r in range(ILP):
            j = first + r * step
            if j < dx.size:
                dx[j] = sigmoid_stack_grad(gs[r], as_[r], bs[r], sigmoid(bs[r]))

    @cuda.jit
    def recompute_forward(x, out):  # 1 read, 1 write
        first, step = cuda.blockIdx.x * cuda.blockDim.x * ILP + cuda.threadIdx.x, cuda.blockDim.x
        xs = cuda.local.array(ILP, float32)
        for r in range(ILP):
            j = first + r * step
            xs[r] = x[j] if j < x.size else ONE
        for r in range(ILP):
            j = first + r * step
            if j < x.size:
                out[j] = sigmoid(sigmoid(sigmoid(xs[r])))

    @cuda.jit
    def recompute_backward(dout, x, dx):  # 2 reads, 1 write; the sigmoids recomputed
        first, step = cuda.blockIdx.x * cuda.blockDim.x * ILP + cuda.threadIdx.x, cuda.blockDim.x
        gs = cuda.local.array(ILP, float32)
        xs = cuda.local.array(ILP, float32)
        for r in range(ILP):
            j = first + r * step
            if j < dx.size:
                gs[r], xs[r] = dout[j], x[j]
        for r in range(ILP):
            j = first + r * step
            if j < dx.size:
                a = sigmoid(xs[r])
                b = sigmoid(a)
                dx[j] = sigmoid_stack_grad(gs[r], a, b, sigmoid(b))

    return saved_forward, saved_backward, recompute_forward, recompute_backward
