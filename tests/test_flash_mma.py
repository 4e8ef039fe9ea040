"""Chapter 10's tensor-core FlashAttention (course_utils/library/kernels/flash_attention_mma.cu).

On a CPU: the source compiles for sm_90 and sm_80 with nvcc and with NVRTC, without spills. On a
GPU: the forward and the backward against the float64 reference (autograd for the gradients) on
edge cases (N = 1, lengths that are not a multiple of the tiles, Nq != Nk, causal, large logits,
D = 64, 96 and 128, several heads), with the allocator's memory filled with NaN first so that an
unwritten element shows, and its errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spec_helpers import forward_matches_float64, poison_free_cuda_memory

from course_utils import cuda as C
from course_utils import runtime
from course_utils.toolbox import portability

SOURCE = (Path(__file__).resolve().parents[1] / "course_utils" / "library" / "kernels"
          / "flash_attention_mma.cu")
needs_gpu = pytest.mark.skipif(not runtime.on_gpu(), reason="needs a CUDA GPU (sm_80 or newer)")


@pytest.mark.skipif(C.nvcc_path() is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_compiles_within_the_register_file(arch):
    # sm_90 compiles the whole source, host functions included (as lecture 10 does: one build
    # for both); sm_80 only the kernels, as the compile matrix builds them (one build for both)
    flags = () if arch == "sm_90" else portability.KERNEL_ONLY_FLAGS
    report = C.resource_usage(SOURCE, arch=arch, extra_flags=flags)
    assert sorted(r.name for r in report) == [
        "fa_mma::convert_dq", "fa_mma::delta_kernel", "fa_mma::dkdv_kernel<128>",
        "fa_mma::dkdv_kernel<64>", "fa_mma::dkdv_kernel<96>", "fa_mma::dkdvdq_kernel<128>",
        "fa_mma::dkdvdq_kernel<64>", "fa_mma::dq_kernel<128>", "fa_mma::dq_kernel<64>",
        "fa_mma::dq_kernel<96>", "fa_mma::flash_attention_mma_kernel<128>",
        "fa_mma::flash_attention_mma_kernel<64>", "fa_mma::flash_attention_mma_kernel<96>"]
    # every kernel fits the register file: a spill is a regression (the backward keeps P^T in
    # bf16 for exactly this reason)
    spilled = [f"{r.name}: {r.registers} registers, {r.spills} B spilled" for r in report
               if r.registers > 255 or r.spills > 0]
    assert not spilled, "; ".join(spilled)


_module = None


def _load():
    global _module
    if _module is None:
        _module = C.load_cuda(SOURCE, ["flash_attention_mma", "flash_attention_mma_backward",
                                       "flash_attention_mma_backward_atomic"],
                              name="flash_attention_mma")
    return _module



@needs_gpu
@pytest.mark.parametrize("B, H, Nq, Nk, D, causal, big", [
    (1, 1, 1, 1, 64, False, 1.0), (2, 3, 100, 77, 64, False, 1.0), (1, 2, 130, 130, 128, True, 1.0),
    (1, 1, 64, 200, 128, False, 1.0), (1, 1, 300, 300, 64, True, 1.0),
    (1, 2, 129, 65, 128, False, 20.0), (2, 1, 513, 513, 128, True, 1.0),
    (1, 1, 1, 1, 96, False, 1.0), (2, 3, 100, 77, 96, True, 1.0), (1, 2, 129, 300, 96, False, 20.0),
    (1, 1, 300, 64, 96, True, 1.0)])
def test_matches_float64(B, H, Nq, Nk, D, causal, big):
    forward_matches_float64(lambda Q, K, V: _load().flash_attention_mma(Q, K, V, causal),
                            B, H, Nq, Nk, D, causal, big)


@needs_gpu
def test_bad_input_says_what_is_wrong():
    f = _load().flash_attention_mma
    Q = torch.randn(1, 1, 8, 64, device="cuda").bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16"):
        f(Q.float(), Q.float(), Q.float(), False)
    with pytest.raises(RuntimeError, match="head dim D must be 64, 96 or 128, got 32"):
        q = Q[..., :32].contiguous()
        f(q, q, q, False)
    with pytest.raises(RuntimeError, match="contiguous"):
        f(Q.transpose(2, 3), Q, Q, False)
    with pytest.raises(RuntimeError, match="agree in B, H and D"):
        K = torch.randn(1, 2, 8, 64, device="cuda").bfloat16()
        f(Q, K, K, False)


def _grads64(Q, K, V, dO, causal):
    """dQ, dK, dV of softmax(Q K^T / sqrt(d)) V by float64 autograd (every row sees a key)."""
    q, k, v = (x.double().requires_grad_() for x in (Q, K, V))
    S = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        keep = torch.ones(S.shape[-2:], dtype=torch.bool, device=S.device).tril()
        S = S.masked_fill(~keep, float("-inf"))
    (torch.softmax(S, dim=-1) @ v).backward(dO.double())
    return q.grad, k.grad, v.grad


BACKWARDS = ("flash_attention_mma_backward", "flash_attention_mma_backward_atomic")


@needs_gpu
@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("B, H, Nq, Nk, D, causal, big", [
    (1, 1, 1, 1, 64, False, 1.0), (2, 3, 100, 77, 64, False, 1.0), (1, 2, 130, 130, 128, True, 1.0),
    (1, 1, 64, 200, 128, False, 1.0), (1, 1, 300, 300, 64, True, 1.0),
    (1, 2, 129, 65, 128, False, 8.0), (1, 1, 65, 129, 64, True, 1.0),
    (2, 1, 257, 257, 128, True, 1.0), (1, 1, 333, 129, 128, False, 20.0),
    (1, 2, 1000, 1000, 128, True, 1.0), (1, 1, 1, 1, 96, False, 1.0),
    (2, 3, 100, 77, 96, True, 1.0), (1, 2, 129, 300, 96, False, 8.0),
    (1, 1, 300, 64, 96, True, 1.0)])
def test_backward_matches_float64(B, H, Nq, Nk, D, causal, big, backward):
    # the atomic kernel's blocks own 128 keys: 200, 257 and 1000 keys cross several blocks, 129
    # and 333 end inside one; 1000 queries add into each dQ row from 8 blocks. D = 96 (padded
    # shared rows): the deterministic kernels only, the atomic one refuses it (below)
    if D == 96 and backward.endswith("atomic"):
        pytest.skip("the atomic backward is built for D = 64 and 128")
    f = _load()
    Q = (torch.randn(B, H, Nq, D, device="cuda") * big).bfloat16()
    K = torch.randn(B, H, Nk, D, device="cuda").bfloat16()
    V = torch.randn(B, H, Nk, D, device="cuda").bfloat16()
    dO = torch.randn(B, H, Nq, D, device="cuda").bfloat16()
    O, lse = f.flash_attention_mma(Q, K, V, causal)
    poison_free_cuda_memory()
    dQ, dK, dV = getattr(f, backward)(Q, K, V, O, dO, lse, causal)
    dQ_ref, dK_ref, dV_ref = _grads64(Q, K, V, dO, causal)
    for name, got, want in (("dQ", dQ, dQ_ref), ("dK", dK, dK_ref), ("dV", dV, dV_ref)):
        assert torch.isfinite(got).all(), f"{name}: an element was never written (NaN poison)"
        # bf16 operands, bf16 P and dS: errors scale with the gradient's size
        tol = 3e-2 * max(1.0, want.abs().max().item())
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=5e-2, msg=name)


@needs_gpu
def test_backward_is_deterministic():
    f = _load()
    Q, K, V, dO = (torch.randn(2, 4, 333, 128, device="cuda").bfloat16() for _ in range(4))
    O, lse = f.flash_attention_mma(Q, K, V, True)
    first = f.flash_attention_mma_backward(Q, K, V, O, dO, lse, True)
    again = f.flash_attention_mma_backward(Q, K, V, O, dO, lse, True)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


@needs_gpu
def test_atomic_backward_changes_only_the_last_bits_of_dq():
    # dK and dV are written by one thread each, as in the deterministic kernel; dQ is a sum of
    # atomic adds in no fixed order: two runs agree to float32 rounding, not bit for bit
    f = _load()
    Q, K, V, dO = (torch.randn(2, 4, 333, 128, device="cuda").bfloat16() for _ in range(4))
    O, lse = f.flash_attention_mma(Q, K, V, True)
    first = f.flash_attention_mma_backward_atomic(Q, K, V, O, dO, lse, True)
    again = f.flash_attention_mma_backward_atomic(Q, K, V, O, dO, lse, True)
    assert torch.equal(first[1], again[1]) and torch.equal(first[2], again[2])
    torch.testing.assert_close(first[0].float(), again[0].float(), atol=2e-2, rtol=1e-2)


@needs_gpu
@pytest.mark.parametrize("backward", BACKWARDS)
def test_backward_bad_input_says_what_is_wrong(backward):
    f = _load()
    bwd = getattr(f, backward)
    Q = torch.randn(1, 1, 8, 64, device="cuda").bfloat16()
    O, lse = f.flash_attention_mma(Q, Q, Q, False)
    with pytest.raises(RuntimeError, match="LSE must have shape"):
        bwd(Q, Q, Q, O, O, lse[..., :4].contiguous(), False)
    with pytest.raises(RuntimeError, match="O and dO must have Q's shape"):
        bwd(Q, Q, Q, O, O[:, :, :4].contiguous(), lse, False)
    with pytest.raises(RuntimeError, match="float32 LSE"):
        bwd(Q, Q, Q, O, O, lse.double(), False)
    with pytest.raises(RuntimeError, match=f"{backward}: head dim D must be 64, 96 or 128"):
        q = Q[..., :32].contiguous()
        bwd(q, q, q, q, q, lse, False)
    if backward.endswith("atomic"):
        q = torch.randn(1, 1, 8, 96, device="cuda").bfloat16()
        o, lse96 = f.flash_attention_mma(q, q, q, False)
        with pytest.raises(RuntimeError, match="built for D = 64 and 128.*at D = 96 use"):
            bwd(q, q, q, o, o, lse96, False)
