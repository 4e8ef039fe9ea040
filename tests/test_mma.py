"""The CPU model of mma.sync.m16n8k16 and ldmatrix (course_utils/library/mma.py).

The layouts are checked against facts that do not depend on the model's own formulas: every
element is held by exactly one (lane, value), a row of C lives in the 4 lanes of one group,
ldmatrix.x4 of the four 8 x 8 quarters gives exactly the A fragment, K's rows give the B
fragment of K^T, V's rows with .trans give the B fragment of V, and two C fragments are one A
fragment lane by lane.
"""

from __future__ import annotations

import numpy as np
import pytest

from course_utils import mma

rng = np.random.default_rng(0)


@pytest.mark.parametrize("which", ["A", "B", "C"])
def test_each_element_has_exactly_one_owner(which):
    element, count, shape = mma._ELEMENT[which]
    owners = {}
    for lane in range(32):
        for i in range(count):
            rc = element(lane, i)
            assert rc not in owners, f"{which}{rc} held by {owners[rc]} and {(lane, i)}"
            owners[rc] = (lane, i)
    assert len(owners) == shape[0] * shape[1]


def test_a_row_of_c_lives_in_one_group_of_four_lanes():
    for row in range(16):
        lanes = {lane for lane in range(32) for i in range(4) if mma.c_element(lane, i)[0] == row}
        assert len(lanes) == 4 and len({lane // 4 for lane in lanes}) == 1


def test_fragments_and_gather_are_inverse():
    for which, shape in (("A", (16, 16)), ("B", (16, 8)), ("C", (16, 8))):
        X = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(mma.gather(mma.fragments(X, which), which), X)


def test_mma_is_a_matrix_product_with_bf16_inputs():
    A, B, C = (rng.standard_normal(s).astype(np.float32) for s in ((16, 16), (16, 8), (16, 8)))
    D = mma.gather(mma.mma_m16n8k16(mma.fragments(A, "A"), mma.fragments(B, "B"),
                                    mma.fragments(C, "C")), "C")
    ref = mma.to_bf16(A).astype(np.float64) @ mma.to_bf16(B).astype(np.float64) + C
    np.testing.assert_allclose(D, ref, rtol=1e-5, atol=1e-5)
    assert np.abs(D - (A.astype(np.float64) @ B + C)).max() > 1e-4  # bf16 rounding is visible


def test_to_bf16_rounds_to_nearest_even():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, np.inf, np.nan], dtype=np.float32)
    y = mma.to_bf16(x)
    np.testing.assert_array_equal(y[:5], [1.0, 1.0, 1.0 + 2**-6, -2.5, np.inf])
    assert np.isnan(y[5])


def test_ldmatrix_x4_of_the_four_quarters_is_the_a_fragment():
    A = rng.standard_normal((16, 16)).astype(np.float32)
    regs = mma.ldmatrix_x4([A[:8, :8], A[8:, :8], A[:8, 8:], A[8:, 8:]])
    np.testing.assert_array_equal(regs.reshape(32, 8), mma.fragments(A, "A"))


def test_ldmatrix_of_k_rows_gives_k_transposed_and_trans_of_v_rows_gives_v():
    Kt = rng.standard_normal((8, 16)).astype(np.float32)  # 8 keys x 16 of d: K as stored
    regs = mma.ldmatrix_x4([Kt[:, :8], Kt[:, 8:], Kt[:, :8], Kt[:, 8:]])
    np.testing.assert_array_equal(regs[:, :2].reshape(32, 4), mma.fragments(Kt.T, "B"))
    V = rng.standard_normal((16, 8)).astype(np.float32)  # 16 keys x 8 of d: V as stored
    regs = mma.ldmatrix_x4([V[:8], V[8:], V[:8], V[8:]], trans=True)
    np.testing.assert_array_equal(regs[:, :2].reshape(32, 4), mma.fragments(V, "B"))


def test_two_c_fragments_are_one_a_fragment():
    P = rng.standard_normal((16, 16)).astype(np.float32)
    left, right = mma.fragments(P[:, :8], "C"), mma.fragments(P[:, 8:], "C")
    np.testing.assert_array_equal(mma.c_to_a(left, right), mma.fragments(P, "A"))


def test_quad_allreduce_gives_each_row_its_max():
    C = rng.standard_normal((16, 8)).astype(np.float32)
    frag = mma.fragments(C, "C")
    top = mma.quad_allreduce(np.maximum(frag[:, 0], frag[:, 1]))  # rows g
    for lane in range(32):
        assert top[lane] == C[lane // 4].max()


def test_lane_map_and_bad_input():
    text = mma.lane_map("C")
    assert "0:0" in text and "31:3" in text and len(text.splitlines()) == 18
    with pytest.raises(ValueError, match="lane must be an int in 0..31"):
        mma.a_element(32, 0)
    with pytest.raises(ValueError, match="i must be an int in 0..3"):
        mma.c_element(0, 4)
    with pytest.raises(ValueError, match="which must be 'A', 'B' or 'C'"):
        mma.fragments(np.zeros((16, 8)), "D")
    with pytest.raises(ValueError, match="B must be 16 x 8"):
        mma.fragments(np.zeros((8, 16)), "B")


# ---------------------------------------------------------------- the model against the hardware
# One warp loads A (16 x 16) and K (8 x 16, so that B = K^T) with ldmatrix, multiplies them with
# one mma.sync.m16n8k16 and writes each lane's A registers and D registers out, in register order.
PROBE = r'''
#include <torch/types.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <vector>

__global__ void mma_probe_kernel(const __nv_bfloat16* A, const __nv_bfloat16* Kt, float* a_out,
                                 float* d_out) {
    __shared__ __align__(16) __nv_bfloat16 As[16][16];
    __shared__ __align__(16) __nv_bfloat16 Ks[8][16];
    const int lane = threadIdx.x;
    for (int e = lane; e < 256; e += 32) As[e / 16][e % 16] = A[e];
    for (int e = lane; e < 128; e += 32) Ks[e / 16][e % 16] = Kt[e];
    __syncwarp();
    // ldmatrix.x4: lanes 8j .. 8j+7 point at the rows of quarter j of A, in the order
    // A[0:8, 0:8], A[8:16, 0:8], A[0:8, 8:16], A[8:16, 8:16]
    const int j = lane / 8, r = lane % 8;
    unsigned a[4], b[2];
    const __nv_bfloat16* row_a = &As[(j % 2) * 8 + r][(j / 2) * 8];
    const unsigned pa = static_cast<unsigned>(__cvta_generic_to_shared(row_a));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(pa));
    // ldmatrix.x2 of K's rows: K[0:8, 0:8] and K[0:8, 8:16] (lanes 0..15 give the addresses)
    const unsigned pb = static_cast<unsigned>(__cvta_generic_to_shared(&Ks[r][(j % 2) * 8]));
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(b[0]), "=r"(b[1]) : "r"(pb));
    float d[4];
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.0f));
    for (int k = 0; k < 4; ++k) {
        const __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&a[k]);
        a_out[lane * 8 + 2 * k] = __low2float(h);       // the lower half is the lower index
        a_out[lane * 8 + 2 * k + 1] = __high2float(h);
        d_out[lane * 4 + k] = d[k];
    }
}

std::vector<torch::Tensor> mma_probe(torch::Tensor A, torch::Tensor Kt) {
    TORCH_CHECK(A.is_cuda() && A.scalar_type() == torch::kBFloat16 && A.numel() == 256 &&
                A.is_contiguous(), "A: a contiguous 16 x 16 bf16 CUDA tensor");
    TORCH_CHECK(Kt.is_cuda() && Kt.scalar_type() == torch::kBFloat16 && Kt.numel() == 128 &&
                Kt.is_contiguous(), "Kt: a contiguous 8 x 16 bf16 CUDA tensor");
    auto opts = A.options().dtype(torch::kFloat32);
    auto a_out = torch::empty({32, 8}, opts), d_out = torch::empty({32, 4}, opts);
    mma_probe_kernel<<<1, 32, 0, c10::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const __nv_bfloat16*>(A.data_ptr()),
        reinterpret_cast<const __nv_bfloat16*>(Kt.data_ptr()), a_out.data_ptr<float>(),
        d_out.data_ptr<float>());
    return {a_out, d_out};
}
'''


def test_the_probe_compiles_for_sm90():
    from course_utils import cuda as C

    if C.nvcc_path() is None:
        pytest.skip("nvcc not found")
    report = C.resource_usage(PROBE)
    assert [r.name for r in report] == ["mma_probe_kernel"] and report[0].spills == 0


def test_the_model_matches_the_hardware():
    import torch

    from course_utils import runtime
    from course_utils.toolbox.cuda import load_cuda

    if not runtime.on_gpu():
        pytest.skip("needs a CUDA GPU (sm_80 or newer)")
    probe = load_cuda(PROBE, ["mma_probe"], name="mma_probe")
    A = torch.randn(16, 16, device="cuda").bfloat16()
    Kt = torch.randn(8, 16, device="cuda").bfloat16()
    a_regs, d_regs = (x.cpu().numpy() for x in probe.mma_probe(A, Kt))
    A_, K_ = A.float().cpu().numpy(), Kt.float().cpu().numpy()
    np.testing.assert_array_equal(a_regs, mma.fragments(A_, "A"))
    expected = mma.mma_m16n8k16(mma.fragments(A_, "A"), mma.fragments(K_.T, "B"),
                                np.zeros((32, 4), np.float32))
    np.testing.assert_allclose(d_regs, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("D", [64, 128])
def test_swizzle_removes_the_ldmatrix_bank_conflict(D):
    # one ldmatrix phase: 8 consecutive rows, the same 16-byte chunk c of each
    for c in range(D // 8):
        plain = [(r * D + c * 8) * 2 for r in range(8)]
        swizzled = [mma.swizzled_offset(r, c * 8, D) for r in range(8)]
        assert mma.shared_wavefronts(plain) == 8  # rows of 128 or 256 bytes: one bank group
        assert mma.shared_wavefronts(swizzled) == 1
    # the swizzle is a permutation of each row's chunks: nothing lands on top of anything
    offsets = {mma.swizzled_offset(r, col, D) for r in range(16) for col in range(D)}
    assert len(offsets) == 16 * D


def test_shared_wavefronts_counts_distinct_words():
    assert mma.shared_wavefronts([0, 0, 0]) == 1        # a broadcast is one pass
    assert mma.shared_wavefronts([0, 128], width=4) == 2  # same bank, two words
    with pytest.raises(ValueError, match="not aligned"):
        mma.shared_wavefronts([8])


@pytest.mark.parametrize("Nq, d, causal, k0", [(40, 32, False, 0), (1, 16, False, 0),
                                               (70, 64, True, 16), (33, 32, True, 30)])
def test_warp_attention_backward_kv_matches_autograd(Nq, d, causal, k0):
    import torch

    Nk = k0 + 16
    Q, K, V, dO = (rng.standard_normal(s).astype(np.float32)
                   for s in ((Nq, d), (Nk, d), (Nk, d), (Nq, d)))
    Q, K, V, dO = (mma.to_bf16(x) for x in (Q, K, V, dO))  # the operands the GPU would see
    q, k, v = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (Q, K, V))
    S = q @ k.T / np.sqrt(d)
    if causal:
        S = S.masked_fill(torch.arange(Nk)[None] > torch.arange(Nq)[:, None], float("-inf"))
    lse = torch.logsumexp(S, dim=1)
    P = torch.exp(S - torch.where(torch.isinf(lse), 0, lse)[:, None])
    O = P @ v
    O.backward(torch.tensor(dO, dtype=torch.float64))
    delta = (O.detach().numpy() * dO).sum(axis=1)
    dK, dV = mma.warp_attention_backward_kv(Q, K[k0:], V[k0:], dO, lse.detach().numpy(), delta,
                                            causal=causal, k0=k0)
    np.testing.assert_allclose(dV, v.grad.numpy()[k0:], atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(dK, k.grad.numpy()[k0:], atol=3e-2, rtol=3e-2)
