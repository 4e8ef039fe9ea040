// FP8 (e4m3) FlashAttention forward for Hopper (sm_90a): chapter 14's bf16 kernel (variant 3:
// warp specialization, ping-pong, overlap) with e4m3 operands. Chapter 14, section 8.
//
// Inputs, all made by the producers of flash_attention_tma_parts/fp8.py (quantize_fused), one
// float32 scale per block of rows (the kernel's tiles):
//   Q8 (B, H, Nq, D) e4m3 (D = 128 or 256), with q_scale (B, H, ceil(Nq / 128));
//   K8 (B, H, Nk, D) e4m3, with k_scale (B, H, ceil(Nk / 128));
//   Vt8 (B, H, D, Nk_pad) e4m3: V transposed (an FP8 wgmma reads both shared operands K-major,
//     and in O += P V the reduction runs over the keys), Nk_pad a multiple of 32, and the keys
//     of every group of 32 stored in the order key_order (below); v_scale (B, H, ceil(Nk / 128)),
//     and v_max (B, H): the largest of a head's v_scale.
// Out: O (B, H, Nq, D) bf16, LSE (B, H, Nq) float32 (natural log), causal top-left aligned
// (key c is masked for query r when c > r), as the bf16 kernel.
//
// What changes from the bf16 kernel, and why:
//   * A row of a tile is 128 e4m3 = 128 bytes, one 128-byte-swizzled panel: Q, K and V^T tiles
//     are single panels, and a k-step of 32 e4m3 moves a descriptor by 32 bytes (the bf16
//     kernel's k-step of 16 moves it by the same 32 bytes).
//   * The scores of key tile j are S_j = sq sk_j Q8 K8_j^T: the softmax multiplies by
//     scale sq sk_j log2(e), a per-tile factor, so the running maximum m is kept in log2 units
//     (already multiplied) instead of raw scores.
//   * P is the A operand of O += P V from registers, as e4m3. The accumulator of S gives a lane
//     the keys 2t, 2t + 1, 8 + 2t, 9 + 2t (and + 16) of each 32, an e4m3 A fragment wants the
//     keys 4t .. 4t + 3 (and + 16). No shuffle moves them: the producer stores V^T's keys of
//     each group of 32 in the order the registers already have (key_order), and the sum over the
//     keys does not care about their order.
//   * V's per-tile scales are folded into P: P'_j = 2^P_SHIFT (sv_j / sv_max) P_j, by adding
//     P_SHIFT + log2(sv_j / sv_max) to the exponent: no multiplication. O then accumulates in
//     the wgmma accumulator across all key tiles, and the epilogue multiplies by
//     sv_max / 2^P_SHIFT / l. The row sums l add up the unrounded P (a per-row, per-tile
//     correction by 2^-(P_SHIFT + log2(sv_j / sv_max))).
//   * The running maximum moves only when a row's new maximum passes it by more than TAU (log2
//     units), a decision a warp takes together: between moves O is not rescaled (64 multiplies
//     a tile saved), and P = 2^(s - m) stays below 2^TAU, so P' <= 2^(P_SHIFT + TAU) = 2^8.5,
//     inside e4m3's 448.
#if !defined(__CUDACC_RTC__) && !defined(FA_KERNEL_ONLY)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
namespace torch { using namespace at; }
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cudaTypedefs.h>
#include <string>
#include <vector>
#endif
#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace fa_hopper_fp8 {

constexpr int CONS = 2;                // consumer warpgroups, 64 query rows each
constexpr int BLOCK_M = 64 * CONS;     // query rows a block (and Q's scale blocks)
constexpr int BLOCK_N = 128;           // keys a tile (and K's and V's scale blocks)
constexpr float P_SHIFT = 6.f;         // P' = 2^P_SHIFT P: P' >= 2^-6 (e4m3's normals) for P >= 2^-12
constexpr float P_FACTOR = 64.f;       // 2^P_SHIFT
constexpr float TAU = 2.5f;            // a stale maximum is kept while the new one is within TAU
// K and V^T tiles in flight: d = 128, 16 KB of Q + 3 x 32 KB; d = 256 (two 128-byte panels a
// row of Q and K), 32 KB + 2 x 64 KB
template <int D>
constexpr int STAGES = D == 128 ? 3 : 2;

#include "hopper_common.cuh"

// V^T's order of the keys (fp8.py's key_order, which its producer writes): key k (0..31) of a
// group of 32 sits in slot (k & 16) | ((k & 6) << 1) | ((k & 8) >> 2) | (k & 1), the slot of the
// A fragment where the pack_e4m3 lines below put P of key k (tests/test_flash_tma.py checks the
// two against the register models of course_utils.library.hopper).

// Four floats as four e4m3 in one register, x0 in the lowest byte (round to nearest even,
// saturating at 448).
__device__ __forceinline__ uint32_t pack_e4m3(float x0, float x1, float x2, float x3) {
    uint32_t out;
    asm("{\n.reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
        "mov.b32 %0, {lo, hi};\n}\n"
        : "=r"(out) : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
    return out;
}

// D[64 x 128] (+)= A[64 x 32] B[32 x 128], e4m3, both in shared memory K-major (no transpose
// flags exist for 8-bit inputs).
__device__ __forceinline__ void wgmma_ss_e4m3(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(accumulate));
}

// D[64 x 128] += A[64 x 32] B[32 x 128], A in registers (4 x 4 e4m3), B in shared memory K-major.
__device__ __forceinline__ void wgmma_rs_e4m3_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, 1, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// D[64 x 256] += A[64 x 32] B[32 x 256], A in registers, B in shared memory K-major (d = 256).
__device__ __forceinline__ void wgmma_rs_e4m3_n256(float (&d)[128], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, 1, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// O += P V(j) by the head dim: N = D columns of O.
template <int D>
__device__ __forceinline__ void wgmma_rs_e4m3(float (&d)[D / 2], const uint32_t (&a)[4], uint64_t b) {
    if constexpr (D == 128) wgmma_rs_e4m3_n128(d, a, b);
    else wgmma_rs_e4m3_n256(d, a, b);
}

template <int D>
struct Tiles {  // rows of D bytes: D / 128 panels of 128 bytes, each tile on a 1024-byte boundary
    uint8_t Q[BLOCK_M * D];
    uint8_t K[STAGES<D>][BLOCK_N * D];
    uint8_t Vt[STAGES<D>][D * BLOCK_N];  // D rows of 128 keys: one panel
    uint64_t q_full[CONS];
    uint64_t k_full[STAGES<D>], v_full[STAGES<D>], k_empty[STAGES<D>], v_empty[STAGES<D>];
};

template <int D>
__global__ void __launch_bounds__(128 * (CONS + 1), 1)
flash_attention_fp8_kernel(const __grid_constant__ CUtensorMap q_map,
                           const __grid_constant__ CUtensorMap k_map,
                           const __grid_constant__ CUtensorMap vt_map,
                           const float* __restrict__ q_scale, const float* __restrict__ k_scale,
                           const float* __restrict__ v_scale, const float* __restrict__ v_max,
                           __nv_bfloat16* __restrict__ O, float* __restrict__ LSE, int H, int Nq,
                           int Nk, float scale, int causal) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int S_REGS = BLOCK_N / 2, O_REGS = D / 2, P_REGS = BLOCK_N / 8;  // P: 4 e4m3 a register
    constexpr int PANELS = D / 128;  // 128-byte panels of a row of Q and K
    constexpr int STAGES = fa_hopper_fp8::STAGES<D>;
    constexpr int CONSUMER_REGS = 240;
    static_assert(sizeof(Tiles<D>) + 1024 <= 227 * 1024, "the tiles must fit 227 KB: fewer stages");
    Tiles<D>& sm = shared_tiles<Tiles<D>>();

    const int q_blocks = (Nq + BLOCK_M - 1) / BLOCK_M;
    const int qb = causal ? q_blocks - 1 - blockIdx.x : blockIdx.x;  // longest rows first
    const int bh = blockIdx.z * H + blockIdx.y;
    const int q0 = qb * BLOCK_M;
    const int Tc = (Nk + BLOCK_N - 1) / BLOCK_N;
    const int key_end = causal ? min(Nk, q0 + BLOCK_M) : Nk;
    const int n_blocks = (key_end + BLOCK_N - 1) / BLOCK_N;
    const int wg = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);  // uniform: see chapter 14's bf16 kernel

    if (threadIdx.x == 0) {
        for (int c = 0; c < CONS; ++c) mbar_init(&sm.q_full[c], 1);  // one tile a block: no q_empty
        mbar_init_ring(sm.k_full, sm.k_empty, STAGES, 128 * CONS);
        mbar_init_ring(sm.v_full, sm.v_empty, STAGES, 128 * CONS);
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 0) {  // ------------------------------------------------ the producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (threadIdx.x == 0) {
            for (int c = 0; c < CONS; ++c) {  // panel p of consumer c's 64 rows
                mbar_expect_bytes(&sm.q_full[c], 64 * D);
                for (int p = 0; p < PANELS; ++p)
                    tma_load(sm.Q + p * BLOCK_M * 128 + c * 64 * 128, &q_map, &sm.q_full[c], 128 * p,
                             q0 + 64 * c, bh);
            }
            for (int j = 0; j < n_blocks; ++j) {
                const int s = j % STAGES, phase = (j / STAGES) & 1;
                mbar_wait(&sm.k_empty[s], phase ^ 1);  // WAR: both consumers' S of the last use is done
                mbar_expect_bytes(&sm.k_full[s], BLOCK_N * D);
                for (int p = 0; p < PANELS; ++p)
                    tma_load(sm.K[s] + p * BLOCK_N * 128, &k_map, &sm.k_full[s], 128 * p, j * BLOCK_N, bh);
                mbar_wait(&sm.v_empty[s], phase ^ 1);  // WAR: both consumers' P V of the last use is done
                mbar_expect_bytes(&sm.v_full[s], D * BLOCK_N);
                tma_load(sm.Vt[s], &vt_map, &sm.v_full[s], j * BLOCK_N, 0, bh);
            }
        }
        return;
    }

    // -------------------------------------------------------------- the consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
    const int w = wg - 1;
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int row0 = q0 + 64 * w + 16 * warp + g;   // this lane's rows: row0 and row0 + 8
    auto stage = [&](int j) { return j % STAGES; };
    auto parity = [&](int j) { return (j / STAGES) & 1; };
    // The per-tile factors: scores to log2 units (scale sq sk_j log2 e) and V's share of the
    // exponent (log2 (sv_j / sv_max)); sq and sv_max once.
    const float sq_log2 = scale * LOG2E * q_scale[(size_t)bh * q_blocks + qb];
    const float sv_max = v_max[bh], log2_sv_max = __log2f(sv_max);
    const float* ks = k_scale + (size_t)bh * Tc;
    const float* vs = v_scale + (size_t)bh * Tc;

    // descriptors: a k-step of 32 e4m3 = 32 bytes inside a 128-byte panel, 4 steps a panel
    // (desc_plus counts 2-byte elements: 16 a step, a panel of R rows R x 64)
    const uint64_t q_start = smem_desc(sm.Q + w * 64 * 128, 16, 1024);
    auto q_desc = [&](int k) { return desc_plus(q_start, (k / 4) * BLOCK_M * 64 + (k % 4) * 16); };
    auto k_desc = [&](int s, int k) {
        return desc_plus(smem_desc(sm.K[s], 16, 1024), (k / 4) * BLOCK_N * 64 + (k % 4) * 16);
    };
    auto v_desc = [&](int s, int k) { return desc_plus(smem_desc(sm.Vt[s], 16, 1024), 16 * k); };
    auto turn_begin = [&]() { named_sync(1 + w); };
    auto turn_end = [&](bool last) {
        if (!(w == CONS - 1 && last)) named_arrive(1 + (w + 1) % CONS);
    };

    float o[O_REGS], s_acc[S_REGS];
    uint32_t p[P_REGS];
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};  // m in log2 units
    #pragma unroll
    for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;

    // RAW waits (K(j), V(j)^T have landed) are taken before the turn, so that their latency
    // hides behind the wait for the other consumer's issue
    auto wait_k = [&](int j) { mbar_wait(&sm.k_full[stage(j)], parity(j)); };
    auto wait_v = [&](int j) { mbar_wait(&sm.v_full[stage(j)], parity(j)); };
    auto issue_s = [&](int j) {
        wgmma_fence();
        #pragma unroll
        for (int k = 0; k < D / 32; ++k) wgmma_ss_e4m3(s_acc, q_desc(k), k_desc(stage(j), k), k > 0);
        wgmma_commit();
    };
    auto issue_pv = [&](int j) {
        wgmma_fence();
        #pragma unroll
        for (int k = 0; k < BLOCK_N / 32; ++k) {
            const uint32_t a[4] = {p[4 * k], p[4 * k + 1], p[4 * k + 2], p[4 * k + 3]};
            wgmma_rs_e4m3<D>(o, a, v_desc(stage(j), k));
        }
        wgmma_commit();
    };
    float alpha[2], rowsum[2], l_factor = 1.f;
    bool moved = true;  // did the warp move its running maxima this tile (then O is rescaled)?
    auto softmax = [&](int j) {
        const float sl = sq_log2 * ks[j];
        // P' = 2^shift P, shift = P_SHIFT + log2(sv / sv_max): V's tile scale and the factor that
        // keeps P's small values out of e4m3's subnormals, both in the exponent
        const float shift = P_SHIFT + __log2f(vs[j]) - log2_sv_max;
        l_factor = fast_exp2(-shift);  // the row sums of P' back to those of P
        const int c0 = j * BLOCK_N + 2 * t;
        const bool edge = (j + 1) * BLOCK_N > Nk || (causal && (j + 1) * BLOCK_N - 1 > q0 + 64 * w);
        if (edge) {
            #pragma unroll
            for (int i = 0; i < S_REGS; ++i) {
                const int r = row0 + (i % 4 >= 2 ? 8 : 0), c = c0 + 8 * (i / 4) + (i % 2);
                if (c >= Nk || (causal && c > r)) s_acc[i] = neg_inf();
            }
        }
        // the row maxima as four interleaved chains a row (a shorter dependency chain)
        float mx4[2][4];
        #pragma unroll
        for (int h = 0; h < 2; ++h)
            for (int c = 0; c < 4; ++c) mx4[h][c] = neg_inf();
        #pragma unroll
        for (int i = 0; i < S_REGS; ++i) {
            float& x = mx4[(i % 4) / 2][(i / 4) % 4];
            x = fmaxf(x, s_acc[i]);
        }
        float m_new[2];
        bool move = false;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = fmaxf(fmaxf(mx4[h][0], mx4[h][1]), fmaxf(mx4[h][2], mx4[h][3]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
            m_new[h] = fmaxf(m[h], mx * sl);  // sl > 0: the maximum of the scaled
            move |= m_new[h] > m[h] + TAU;     // false for a row with no key yet (both -inf)
        }
        moved = __any_sync(0xffffffff, move);
        float base[2];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (moved) {
                const float m_use = m_new[h] == neg_inf() ? 0.f : m_new[h];  // a row with no key yet
                alpha[h] = fast_exp2(m[h] - m_use);
                m[h] = m_new[h];
            }
            base[h] = (m[h] == neg_inf() ? 0.f : m[h]) - shift;
        }
        float sum4[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        #pragma unroll
        for (int i = 0; i < S_REGS; ++i) {
            const int h = (i % 4) / 2;
            s_acc[i] = fast_exp2(fmaf(s_acc[i], sl, -base[h]));
            sum4[h][(i / 4) % 4] += s_acc[i];
        }
        #pragma unroll
        for (int h = 0; h < 2; ++h) rowsum[h] = (sum4[h][0] + sum4[h][1]) + (sum4[h][2] + sum4[h][3]);
    };
    auto rescale_and_pack = [&]() {
        if (moved) {  // warp-uniform: most tiles of a long row skip the 64 multiplies
            #pragma unroll
            for (int i = 0; i < O_REGS; ++i) o[i] *= alpha[(i % 4) / 2];
            #pragma unroll
            for (int h = 0; h < 2; ++h) l[h] *= alpha[h];
        }
        #pragma unroll
        for (int h = 0; h < 2; ++h) l[h] += rowsum[h] * l_factor;
        #pragma unroll
        for (int kk = 0; kk < BLOCK_N / 32; ++kk) {  // the A fragment of keys 32kk .. 32kk + 31
            const float* s = s_acc + 16 * kk;
            p[4 * kk + 0] = pack_e4m3(s[0], s[1], s[4], s[5]);      // row g
            p[4 * kk + 1] = pack_e4m3(s[2], s[3], s[6], s[7]);      // row g + 8
            p[4 * kk + 2] = pack_e4m3(s[8], s[9], s[12], s[13]);    // row g, keys + 16
            p[4 * kk + 3] = pack_e4m3(s[10], s[11], s[14], s[15]);  // row g + 8, keys + 16
        }
    };

    if (w == CONS - 1) named_arrive(1);  // consumer 0 takes the first turn
    mbar_wait(&sm.q_full[w], 0);  // RAW: this consumer's 64 rows of Q have landed
    // S(0) and its softmax; blocks 1 .. n - 1, each S(j) issued with P(j - 1) V(j - 1); the last
    // P V alone (the bf16 kernel's variant 3)
    wait_k(0);
    turn_begin();
    issue_s(0);
    turn_end(false);
    wgmma_wait<0>();
    fence_regs(s_acc);
    mbar_arrive(&sm.k_empty[stage(0)]);
    softmax(0);
    rescale_and_pack();
    for (int j = 1; j < n_blocks; ++j) {
        wait_k(j);
        wait_v(j - 1);
        turn_begin();
        issue_s(j);
        issue_pv(j - 1);
        turn_end(false);
        wgmma_wait<1>();     // S(j) is done (the older group); P(j - 1) V(j - 1) may still run
        fence_regs(s_acc);
        mbar_arrive(&sm.k_empty[stage(j)]);  // K(j) read: its buffer may be refilled
        softmax(j);
        wgmma_wait<0>();     // P(j - 1) V(j - 1) is done: o may be rescaled, p overwritten
        fence_regs(o);
        fence_regs(p);
        mbar_arrive(&sm.v_empty[stage(j - 1)]);  // V(j - 1)^T read: its buffer may be refilled
        rescale_and_pack();
    }
    wait_v(n_blocks - 1);
    turn_begin();
    issue_pv(n_blocks - 1);
    turn_end(true);
    wgmma_wait<0>();
    fence_regs(o);
    mbar_arrive(&sm.v_empty[stage(n_blocks - 1)]);

    // epilogue: O = acc sv_max / (2^P_SHIFT l) as bf16 (P's factors), LSE = (m + log2 l) ln 2
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffff, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffff, l[h], 2);
        const int r = row0 + 8 * h;
        const float inv = l[h] > 0.f ? sv_max / (P_FACTOR * l[h]) : 0.f;
        store_row_bf16<D>(O + ((size_t)bh * Nq + r) * D, o, h, inv, t, r < Nq);
        if (t == 0 && r < Nq)
            LSE[(size_t)bh * Nq + r] = l[h] > 0.f ? (m[h] + __log2f(l[h])) / LOG2E : neg_inf();
    }
#else
    __trap();  // built for a GPU without sm_90a's wgmma and TMA: the host refuses to launch
#endif
}

#if defined(FA_KERNEL_ONLY)  // compile-only builds (ptxas -v): both head dims
template __global__ void flash_attention_fp8_kernel<128>(
    const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap,
    const __grid_constant__ CUtensorMap, const float*, const float*, const float*, const float*,
    __nv_bfloat16*, float*, int, int, int, float, int);
template __global__ void flash_attention_fp8_kernel<256>(
    const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap,
    const __grid_constant__ CUtensorMap, const float*, const float*, const float*, const float*,
    __nv_bfloat16*, float*, int, int, int, float, int);
#endif

}  // namespace fa_hopper_fp8

#if !defined(__CUDACC_RTC__) && !defined(FA_KERNEL_ONLY)

#include "hopper_host.cuh"  // check_cuda, make_map (the TMA tensor maps, uint8 here)

// O, LSE = attention of the e4m3 inputs (see the head of this file). Q8, K8, Vt8: uint8 views
// of float8_e4m3fn tensors; the scales float32.
std::vector<torch::Tensor> flash_attention_hopper_fp8(torch::Tensor Q8, torch::Tensor K8, torch::Tensor Vt8,
                                                      torch::Tensor q_scale, torch::Tensor k_scale,
                                                      torch::Tensor v_scale, torch::Tensor v_max,
                                                      bool causal, double scale) {
    using namespace fa_hopper_fp8;
    const char* fn = "flash_attention_hopper_fp8";
    for (const auto* X : {&Q8, &K8, &Vt8}) {
        TORCH_CHECK(X->is_cuda() && X->scalar_type() == torch::kByte && X->dim() == 4 && X->is_contiguous(),
                    fn, ": Q8, K8 and Vt8 must be contiguous 4D CUDA uint8 views of e4m3 (x.view(torch.uint8))");
        TORCH_CHECK(reinterpret_cast<uintptr_t>(X->data_ptr()) % 16 == 0, fn, ": inputs must start on 16 bytes");
    }
    const int64_t B = Q8.size(0), H = Q8.size(1), Nq = Q8.size(2), Nk = K8.size(2);
    const int64_t D = Q8.size(3);
    TORCH_CHECK((D == 128 || D == 256) && K8.size(3) == D, fn, ": head dim must be 128 or 256 (and the same for Q and K), got ",
                std::to_string(D));
    TORCH_CHECK(K8.size(0) == B && K8.size(1) == H && Vt8.size(0) == B && Vt8.size(1) == H &&
                Vt8.size(2) == D && Vt8.size(3) >= Nk && Vt8.size(3) % 32 == 0,
                fn, ": Vt8 must be (B, H, D, Nk_pad) with Nk_pad >= Nk a multiple of 32");
    const int64_t Tr = (Nq + BLOCK_M - 1) / BLOCK_M, Tc = (Nk + BLOCK_N - 1) / BLOCK_N;
    auto check_scale = [&](const torch::Tensor& s, int64_t n, const char* name) {
        TORCH_CHECK(s.is_cuda() && s.scalar_type() == torch::kFloat && s.is_contiguous() &&
                    s.numel() == B * H * n, fn, ": ", name, " must be a contiguous float32 CUDA tensor of ",
                    std::to_string(B * H * n), " scales");
    };
    check_scale(q_scale, Tr, "q_scale");
    check_scale(k_scale, Tc, "k_scale");
    check_scale(v_scale, Tc, "v_scale");
    check_scale(v_max, 1, "v_max");
    int major = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, Q8.get_device()), fn);
    TORCH_CHECK(major == 9, fn, ": needs an sm_90 GPU (H100/H200)");
    TORCH_CHECK(H <= 65535 && B <= 65535, fn, ": B and H must be at most 65535");
    auto O = torch::empty({B, H, Nq, D}, Q8.options().dtype(torch::kBFloat16));
    auto LSE = torch::empty({B, H, Nq}, Q8.options().dtype(torch::kFloat));
    if (B == 0 || H == 0 || Nq == 0) return {O, LSE};
    TORCH_CHECK(Nk > 0, fn, ": Nk must be at least 1");
    c10::cuda::CUDAGuard guard(Q8.device());
    const CUtensorMap q_map = make_map(Q8, 64), k_map = make_map(K8, BLOCK_N),
                      vt_map = make_map(Vt8, static_cast<int>(D));
    auto launch = [&](auto kernel, int smem) {
        check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                   "flash_attention_hopper_fp8: asking for shared memory");
        kernel<<<dim3(Tr, H, B), 128 * (CONS + 1), smem, c10::cuda::getCurrentCUDAStream()>>>(
            q_map, k_map, vt_map, q_scale.data_ptr<float>(), k_scale.data_ptr<float>(),
            v_scale.data_ptr<float>(), v_max.data_ptr<float>(),
            reinterpret_cast<__nv_bfloat16*>(O.data_ptr()), LSE.data_ptr<float>(), H, Nq, Nk,
            static_cast<float>(scale), causal ? 1 : 0);
    };
    if (D == 128) launch(flash_attention_fp8_kernel<128>, sizeof(Tiles<128>) + 1024);
    else launch(flash_attention_fp8_kernel<256>, sizeof(Tiles<256>) + 1024);
    check_cuda(cudaGetLastError(), "flash_attention_hopper_fp8: launch");
    return {O, LSE};
}

#endif
