"""Chapter 03's fused sigmoid-stack kernels (course_utils/library/kernels/ch03_recompute.py).

The four kernels against autograd's float64 gradient of sigmoid(sigmoid(sigmoid(x))), on a
length that is not a multiple of threads x ILP (the last block's guards), with NaN-poisoned
outputs so that an element a kernel forgets to write fails. Runs in Numba's CUDA simulator on a
CPU (the repository's conftest chose the mode before Numba was imported), natively on a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

import course_utils as cu
from course_utils import checks

THREADS = 8


@pytest.fixture(scope="module")
def kernels():
    from course_utils.library.kernels.ch03_recompute import make_sigmoid_kernels

    return {ILP: make_sigmoid_kernels(ILP) for ILP in (1, 3)}


@pytest.mark.parametrize("ILP", [1, 3])
@pytest.mark.parametrize("n", [1, 37])
def test_saved_and_recompute_match_autograd(kernels, ILP, n):
    saved_fwd, saved_bwd, recompute_fwd, recompute_bwd = kernels[ILP]
    dev = cu.device()
    torch.manual_seed(n)
    x, dout = torch.randn(n, device=dev), torch.randn(n, device=dev)
    x64 = x.double().requires_grad_()
    out64 = torch.sigmoid(torch.sigmoid(torch.sigmoid(x64)))
    (dx64,) = torch.autograd.grad(out64, x64, dout.double())
    grid = (math.ceil(n / (THREADS * ILP)), THREADS)
    a = cu.kernel_array
    for version in ("saved", "recompute"):
        out, dx = checks.poison_like(x), checks.poison_like(x)
        s1, s2 = checks.poison_like(x), checks.poison_like(x)
        if version == "saved":
            saved_fwd[grid](a(x), a(s1), a(s2), a(out))
            saved_bwd[grid](a(dout), a(s1), a(s2), a(dx))
        else:
            recompute_fwd[grid](a(x), a(out))
            recompute_bwd[grid](a(dout), a(x), a(dx))
        cu.synchronize()
        case = f"{version}, ILP = {ILP}, n = {n}"
        checks.compare("out", out, out64.detach(), case=case, atol=1e-6, rtol=1e-5, poisoned=True)
        checks.compare("dx", dx, dx64, case=case, atol=1e-6, rtol=1e-5, poisoned=True)


def test_a_wrong_gradient_fails(kernels):
    """The check above can fail: backward fed s1 where s2 belongs gives a wrong dx."""
    saved_fwd, saved_bwd, _, _ = kernels[1]
    dev = cu.device()
    n = 37
    x, dout = torch.randn(n, device=dev), torch.randn(n, device=dev)
    x64 = x.double().requires_grad_()
    (dx64,) = torch.autograd.grad(torch.sigmoid(torch.sigmoid(torch.sigmoid(x64))), x64,
                                  dout.double())
    out, dx, s1, s2 = (checks.poison_like(x) for _ in range(4))
    a = cu.kernel_array
    grid = (math.ceil(n / THREADS), THREADS)
    saved_fwd[grid](a(x), a(s1), a(s2), a(out))
    saved_bwd[grid](a(dout), a(s1), a(s1), a(dx))  # s1 twice: the wrong input
    cu.synchronize()
    with pytest.raises(checks.CheckFailure):
        checks.compare("dx", dx, dx64, case="wrong input", atol=1e-6, rtol=1e-5, poisoned=True)
