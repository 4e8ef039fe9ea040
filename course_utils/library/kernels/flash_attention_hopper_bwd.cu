// FlashAttention backward for Hopper (sm_90a): TMA copies, wgmma, warp specialization. Chapter 14.
//
// Shapes (row-major, contiguous): Q, O, dO (B, H, Nq, D) bf16; K, V (B, H, Nk, D) bf16; LSE
// (B, H, Nq) float32 (natural log, as the forward flash_attention_hopper.cu returns it). D is 64
// or 128. Causal is top-left aligned (key c is masked for query r when c > r), as the forward's,
// also when Nq != Nk (FlashAttention-2 from 2.1 and FlashAttention-3 align it bottom-right).
// Returns dQ, dK, dV in bf16 with the shapes of Q, K, V. scale = 1 / sqrt(D).
//
// The math (chapter 08), per head, with P the forward's probabilities:
//   P = exp(scale Q K^T - LSE)    dV = P^T dO    dP = dO V^T    Delta = rowsum(dO * O)
//   dS = P * (dP - Delta)         dK = scale dS^T Q              dQ = scale dS K
//
// Three kernels:
//   1. bwd_preprocess: Delta per query row and LSE * log2(e) (the exponent in base 2), both
//      padded to a multiple of the step's query rows R, and the float32 dQ accumulator zeroed
//      (in the same pass: one kernel less than a separate memset).
//   2. the main kernel: a tile is BLOCK_N = 128 keys of one head. K_j and V_j stay in shared
//      memory; the query blocks i stream past them. One block per SM takes tile after tile
//      (persistent, FA_BWD_PERSIST = 1, the default), so that one tile's dK_j, dV_j are stored
//      while the next tile's K, V, Q_i and dO_i load, with no block launch in between (one
//      block per tile with FA_BWD_PERSIST = 0: measured on an H100, forward + backward 1-2%
//      slower, N = 1024 to 16384). dK_j and dV_j are sums over i, so they stay
//      in registers until the tile ends; dQ_i is a sum over the key blocks j that different blocks
//      own, so each block adds its share into a float32 accumulator: the consumers write it to
//      shared memory and one thread hands it to the TMA unit as a bulk reduce-add
//      (cp.reduce.async.bulk ... .add.f32), which adds the 16 KB (R x D / 2 floats, at either D)
//      into global memory in the background. (Per-thread atomicAdd did the same and cost a
//      quarter of the time at D = 128: the consumers waited on atomics while the tensor cores
//      idled.)
//   3. bwd_convert_dq: dQ = scale * accumulator, in bf16, undoing the accumulator's layout.
//
// The accumulator's layout is not dQ's: each (head, query block i) owns R x D floats, half per
// consumer, stored in the order the consumer's threads hold them (float4 c of thread tid at
// float4 index 128 c + tid), so that the shared-memory writes are conflict-free and one bulk
// copy moves the whole half. bwd_convert_dq maps each float4 back to its rows and columns.
//
// The main kernel has 3 warpgroups of 128 threads, as the forward:
//   * warpgroup 0, the producer: one thread issues the TMA copies. K_j and V_j once, then Q_i and
//     dO_i (R rows each: R = 64 at D = 128, R = 128 at D = 64) into a ring of STAGES buffers
//     with a "full" and an "empty" mbarrier each.
//   * warpgroups 1 and 2, the consumers: consumer w owns keys 64w .. 64w + 63 of the block. Per
//     query block it computes everything TRANSPOSED, keys as rows: S^T = K_w Q_i^T and
//     dP^T = V_w dO_i^T (64 keys x R queries in registers). Then P^T and dS^T are already the A
//     operands of dV_w += P^T dO_i and dK_w += dS^T Q_i, straight from registers as P in the
//     forward's O += P V. dQ_i = dS K needs dS with queries as rows: both consumers store their
//     dS^T (bf16) into one shared tile of 128 keys x R queries, wait for each other on a named
//     barrier, and wgmma reads that tile transposed (MN-major A). At D = 128 consumer w
//     computes the columns (D / 2) w .. (D / 2)(w + 1) - 1 of dQ_i; at D = 64 it computes the
//     queries 64w .. 64w + 63, all 64 columns. Either way over all 128 keys, and it hands its
//     half of dQ_i to the TMA unit's bulk reduce-add (above).
// Shared tiles written by TMA use the 128-byte swizzle (see flash_attention_hopper.cu and
// course_utils/library/hopper.py); the dS^T tile is written by the consumers with the same swizzle, so
// that wgmma reads all tiles the same way and the stores have no bank conflicts.
//
// Registers of a consumer thread at D = 128 (setmaxnreg gives it 240): dV_w and dK_w 64 floats
// each, S^T and dP^T 32 each, then P^T and dS^T as 16 bf16 pairs each and dQ 32 floats (in the
// registers S^T and dP^T no longer need). At D = 64 with R = 128 it is the same count: dV_w and
// dK_w 32 floats each, S^T and dP^T 64 each. ptxas (CUDA 13.0) fits both without spills.
// (R = 128 at D = 64 measured 10-19% faster than R = 64 on an H100: every barrier, wait, lse2
// and Delta load and bulk copy of a step serves twice the products.)
// Tried on an H100 and not kept, none faster by more than the noise (lecture 14 gives the
// numbers): dV_w issued before dS^T is computed; S^T(i + 1) issued before dQ_i goes out; the
// consumers taking turns at dQ_i; each consumer its own keys' share of dQ_i; lse2 and Delta
// brought into shared memory by TMA with Q_i instead of read in the loop; the whole loop, or only
// its exponentials, in two copies, with and without the mask (fewer instructions, slower); dQ_i
// computed one query block late, with mbarriers instead of the named barrier so that the
// consumers may drift apart (slower).

#if !defined(__CUDACC_RTC__) && !defined(FA_KERNEL_ONLY)
// From torch, what this file uses: the Tensor class and one header per operator it calls, under
// the torch:: names of <torch/types.h>. That header has every operator: a compile-only build (no
// GPU) takes about 30 % longer with it. On a GPU, load_inline puts it before this file anyway.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
namespace torch { using namespace at; }  // torch::Tensor, torch::empty, torch::kFloat, ...
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cudaTypedefs.h>
#include <string>
#include <vector>
#endif
#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace fa_hopper_bwd {

constexpr int CONSUMERS = 2;                  // consumer warpgroups, 64 keys each
constexpr int BLOCK_N = 64 * CONSUMERS;       // keys per block (K_j, V_j)
constexpr int BLOCK_M = 64;                   // query rows per step at D = 128 (and the probe)
// query rows per step of the main kernel: 128 at D = 64 (the registers allow it, and every
// barrier, wait and bulk copy of a step is then shared by twice the products), 64 at D = 128
template <int D>
constexpr int BM = D == 64 ? 128 : 64;
constexpr int THREADS = 128 * (CONSUMERS + 1);
constexpr int PRE_THREADS = 256;              // threads per block of bwd_preprocess
// Q_i and dO_i buffers in the ring. d = 64 (R = 128): K + V 32 KB, 3 x 32 KB of Q and dO,
// 2 x 32 KB of dS^T, 32 KB of dQ (224 KB); d = 128 (R = 64): 64 KB + 2 x 32 KB + 32 KB + 32 KB
// (192 KB); of the 227 KB a block may have.
// The main kernel: one block per SM taking tile after tile (1), or one block per tile (0).
#ifndef FA_BWD_PERSIST
#define FA_BWD_PERSIST 1
#endif
#ifndef FA_BWD_STAGES_D64
#define FA_BWD_STAGES_D64 3
#endif
#ifndef FA_BWD_STAGES_D128
#define FA_BWD_STAGES_D128 2
#endif
template <int D>
constexpr int STAGES = D == 64 ? FA_BWD_STAGES_D64 : FA_BWD_STAGES_D128;

// mbarriers, TMA, descriptors, the register-A products and the m64n128 shared-memory product
// (shared with the forward)
#include "hopper_common.cuh"

// ---------------------------------------------------------------- wgmma
// (The immediates after the descriptors: see hopper_common.cuh. The forward uses (p, 1, 1, 0, 0)
// for S = Q K^T and (1, 1, 1, 1) for O += P V; dV += P^T dO and dK += dS^T Q are its register-A
// products, wgmma_rs_n64 / _n128, with dO and Q read MN-major as V there.)

// D[64 x 64] (+)= A[64 x 16] B[16 x 64], A and B in shared memory, both K-major
// (imm-trans-a = imm-trans-b = 0). S^T = K_w Q_i^T and dP^T = V_w dO_i^T.
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(accumulate));
}

template <>  // wgmma_ss<N>: hopper_common.cuh; S^T and dP^T are 64 keys x R queries
__device__ __forceinline__ void wgmma_ss<64>(float (&d)[32], uint64_t a, uint64_t b, int accumulate) { wgmma_ss_n64(d, a, b, accumulate); }

// D[64 x 32] (+)= A[64 x 16] B[16 x 32], A and B in shared memory, both MN-major
// (imm-trans-a = imm-trans-b = 1): dQ_i = dS K at D = 64, half of D per consumer.
__device__ __forceinline__ void wgmma_ss_tt_n32(float (&d)[16], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "r"(accumulate));
}

// D[64 x 64] (+)= A[64 x 16] B[16 x 64], both MN-major: a consumer's dQ_i = dS K, at D = 128
// (64 queries x half the columns) and at D = 64 (half of the 128 queries x all 64 columns).
__device__ __forceinline__ void wgmma_ss_tt_n64(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(accumulate));
}

// The products per head dim: dV_w, dK_w are 64 x D (RS); wgmma_ss_dq is the dQ path at R = 64
// (the main kernel at D = 128; the probe at both D), a consumer's part of dQ_i 64 x D / 2.
template <int D>
__device__ __forceinline__ void wgmma_rs_d(float (&d)[D / 2], const uint32_t (&a)[4], uint64_t b);
template <>
__device__ __forceinline__ void wgmma_rs_d<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t b) { wgmma_rs_n64(d, a, b); }
template <>
__device__ __forceinline__ void wgmma_rs_d<128>(float (&d)[64], const uint32_t (&a)[4], uint64_t b) { wgmma_rs_n128(d, a, b); }
template <int D>
__device__ __forceinline__ void wgmma_ss_dq(float (&d)[D / 4], uint64_t a, uint64_t b, int accumulate);
template <>
__device__ __forceinline__ void wgmma_ss_dq<64>(float (&d)[16], uint64_t a, uint64_t b, int accumulate) { wgmma_ss_tt_n32(d, a, b, accumulate); }
template <>
__device__ __forceinline__ void wgmma_ss_dq<128>(float (&d)[32], uint64_t a, uint64_t b, int accumulate) { wgmma_ss_tt_n64(d, a, b, accumulate); }

// ---------------------------------------------------------------- the descriptors
// One function per operand, shared by the kernel and the probe; tests/test_flash_hopper_bwd.py
// mirrors each line and checks with course_utils.library.hopper that every k-step reads exactly the
// elements its product needs. Offsets are in elements (bf16) from a tile's start, added to the
// descriptor of that start (desc_plus, hopper_common.cuh). A tile of R rows x D is D / 64 panels
// of R x 64 (R x 128 bytes each); a step of 16 along a 128-byte row is 32 bytes, a step of 16
// rows is 16 x 64 elements.

// A of S^T = K_w Q_i^T (and V_w of dP^T): rows 64w .. 64w + 63 of the K (V) tile, K-major;
// step k covers columns 16k .. 16k + 15 of D.
__device__ __forceinline__ uint64_t desc_kw(const __nv_bfloat16* K, int w, int k) {
    const uint64_t rows = smem_desc(K + w * 64 * 64, 16, 1024);  // rows 64w ..
    return desc_plus(rows, (k / 4) * BLOCK_N * 64 + (k % 4) * 16);
}
// B of S^T (Q_i) and of dP^T (dO_i): all R rows, K-major; step k covers columns 16k .. 16k + 15.
template <int R = BLOCK_M>
__device__ __forceinline__ uint64_t desc_rows_k(const __nv_bfloat16* X, int k) {
    return desc_plus(smem_desc(X, 16, 1024), (k / 4) * R * 64 + (k % 4) * 16);
}
// A tile of ROWS rows read MN-major, the reduction running over its rows; step k covers rows
// 16k .. 16k + 15, and LBO jumps from one 64-column panel to the next. B of dV += P^T dO_i (dO_i)
// and of dK += dS^T Q_i (Q_i), ROWS = R: D along the 128-byte rows, like V in the forward's P V.
// Both operands of dQ_i = dS K, ROWS = 128 keys: A is dS read from the dS^T tile (128 keys x R
// queries, so the queries run along the rows: dS transposed), B is K.
template <int ROWS = BLOCK_M>
__device__ __forceinline__ uint64_t desc_rows_mn(const __nv_bfloat16* X, int k) {
    return desc_plus(smem_desc(X, ROWS * 128, 1024), k * 16 * 64);
}
// A of dQ_i: the 64 queries of panel w of the dS^T tile. D = 128 (R = 64): consumer w computes
// all 64 queries (the tile's one panel, w = 0), columns (D / 2) w .. of dQ_i. D = 64 (R = 128):
// it computes queries 64w .. 64w + 63 (panel w), all 64 columns, with B = all of K.
__device__ __forceinline__ uint64_t desc_dst_panel(const __nv_bfloat16* dST, int w, int k) {
    return desc_rows_mn<BLOCK_N>(dST + w * BLOCK_N * 64, k);
}
// B of dQ_i at D = 128: K[:, (D / 2) w ..] (128 keys x 64), panel w of the K tile.
template <int D>
__device__ __forceinline__ uint64_t desc_k_half(const __nv_bfloat16* K, int w, int k) {
    return desc_rows_mn<BLOCK_N>(K + (D / 2) * w / 64 * BLOCK_N * 64 + (D / 2) * w % 64, k);
}

// Write this thread's dS^T words into the dS^T tile (128 keys x R queries, bf16: R / 64 panels
// of 128 keys x 64 queries) where TMA would have put them with the 128-byte swizzle: element
// (row, col) of a panel at byte row * 128 + 2 col, with the 16-byte chunk index (col / 8) XORed
// with row % 8. Word j holds dS^T of key row 64w + 16 warp + g + 8 (j % 2) and queries
// 8 (j / 2) + 2t, + 1 (the accumulator's layout): panel (j / 2) / 8, chunk (j / 2) % 8, and
// row % 8 = g. The 8 lanes with the same t write 8 different chunks: no bank conflict.
template <int R = BLOCK_M>
__device__ __forceinline__ void store_dst(__nv_bfloat16* dST, int w, int warp, int g, int t,
                                          const uint32_t (&ds)[R / 4]) {
    unsigned char* base = reinterpret_cast<unsigned char*>(dST);
    #pragma unroll
    for (int j = 0; j < R / 4; ++j) {  // queries 8 (j / 2) + 2t: panel (j / 2) / 8 of 64 queries
        const int row = 64 * w + 16 * warp + g + 8 * (j % 2), chunk = ((j / 2) % 8) ^ g;
        *reinterpret_cast<uint32_t*>(base + (j / 16) * BLOCK_N * 128 + row * 128 + chunk * 16 + 4 * t) = ds[j];
    }
}

// Writes by threads (st.shared) become visible to wgmma, which reads shared memory through the
// "async proxy", only after this fence (then a barrier tells the other threads).
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Named barrier `id` for one warpgroup (128 threads; named_sync, hopper_common.cuh, is the one
// for both consumers).
__device__ __forceinline__ void named_sync_wg(int id) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(128) : "memory");
}

// global[0 .. bytes) += shared[0 .. bytes), float32, done by the TMA unit in the background
// (bytes a multiple of 16, both addresses 16-byte aligned). One thread issues it; commit closes a
// group; wait_read<0> returns once every committed group has finished READING shared memory (the
// buffer may be written again), wait_all<0> once the additions are done.
__device__ __forceinline__ void bulk_reduce_add(float* global, const float* shared, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 ::"l"(global), "r"(smem_addr(shared)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// ---------------------------------------------------------------- 1. preprocessing

// D / 8 lanes per query row r of head bh (Nq_pad rows, a multiple of R), each lane 8 columns
// (16-byte loads of O and dO), so a block of PRE_THREADS threads takes 8 PRE_THREADS / D rows:
//   Delta[r] = sum_d dO[r, d] O[r, d]   (0 past Nq)
//   lse2[r]  = LSE[r] * log2(e)          (+inf past Nq, and where LSE = -inf: a row that saw no
//                                         key; P = 2^(s - lse2) is then 0, never inf or NaN)
//   dQacc[r'] = 0 for D floats of the accumulator (its row r' = r of the same head in the main
//               kernel's order: the zeroing does not care which floats a row holds), so that no
//               separate memset pass over the accumulator is needed
template <int D>
__global__ void __launch_bounds__(PRE_THREADS)
bwd_preprocess_kernel(const __nv_bfloat16* __restrict__ O, const __nv_bfloat16* __restrict__ dO,
                      const float* __restrict__ LSE, float* __restrict__ Delta,
                      float* __restrict__ lse2, float* __restrict__ dQacc,
                      int* __restrict__ tile_counter, int H, int Nq, int Nq_pad) {
    constexpr int L = D / 8, ROWS = PRE_THREADS / L;  // lanes per row, rows per block
    const int bh = blockIdx.z * H + blockIdx.y;
    const int r = blockIdx.x * ROWS + threadIdx.x / L, j = threadIdx.x % L;
    // (no bounds check on r: the grid is exactly Nq_pad rows, and every lane reaches the shuffles)
    const size_t pad_at = (size_t)bh * Nq_pad + r;
    if (tile_counter && bh == 0 && r == 0 && j == 0) *tile_counter = 0;  // the persistent main kernel's
    float4* acc = reinterpret_cast<float4*>(dQacc + pad_at * D);  // D / 4 float4, 2 a lane
    acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    acc[j + L] = make_float4(0.f, 0.f, 0.f, 0.f);
    float sum = 0.f;
    if (r < Nq) {
        const size_t at = ((size_t)bh * Nq + r) * D + 8 * j;
        const uint4 o = *reinterpret_cast<const uint4*>(O + at);
        const uint4 d = *reinterpret_cast<const uint4*>(dO + at);
        const uint32_t ow[4] = {o.x, o.y, o.z, o.w}, dw[4] = {d.x, d.y, d.z, d.w};
        #pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float2 of = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ow[k]));
            const float2 df = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&dw[k]));
            sum = fmaf(of.x, df.x, fmaf(of.y, df.y, sum));
        }
    }
    #pragma unroll
    for (int m = L / 2; m > 0; m /= 2) sum += __shfl_xor_sync(0xffffffff, sum, m);  // in the row's lanes
    if (j == 0) {
        const float l = r < Nq ? LSE[(size_t)bh * Nq + r] : neg_inf();
        Delta[pad_at] = r < Nq ? sum : 0.f;
        lse2[pad_at] = l == neg_inf() ? __int_as_float(0x7f800000) : l * LOG2E;
    }
}

// ---------------------------------------------------------------- 2. the main kernel

// n / d for 0 <= n < 2^31 without a division instruction (the GPU has none: n / d by a runtime d
// compiles to about 25 instructions, a float reciprocal and correction steps). The host picks
// l = ceil(log2 d), s = 31 + l and m = ceil(2^s / d) < 2^32; then n / d = (n m) >> s exactly: the
// error m d - 2^s is below d <= 2^l, so n (m d - 2^s) < 2^(31 + l) never lifts the quotient into
// the next integer. One 64-bit multiply and a shift; the kernel divides tile numbers by n_kb.
struct DivBy {
    uint32_t m;
    int s;
    __device__ __forceinline__ int operator()(int n) const {
        return static_cast<int>((static_cast<uint64_t>(static_cast<uint32_t>(n)) * m) >> s);
    }
};

inline DivBy div_by(int d) {  // (host) for 1 <= d < 2^31
    int l = 0;
    while ((int64_t(1) << l) < d) ++l;
    return {static_cast<uint32_t>(((uint64_t(1) << (31 + l)) + d - 1) / d), 31 + l};
}

template <int D>
struct Tiles {  // every tile starts on a 1024-byte boundary (8 rows x 128 B: the swizzle's unit)
    __nv_bfloat16 K[BLOCK_N * D];
    __nv_bfloat16 V[BLOCK_N * D];
    __nv_bfloat16 Q[STAGES<D>][BM<D> * D];
    __nv_bfloat16 dO[STAGES<D>][BM<D> * D];
    __nv_bfloat16 dST[2][BLOCK_N * BM<D>];  // dS^T of a step: the steps alternate buffers
    float dQ[CONSUMERS][BM<D> * D / 2];      // consumer w's part of dQ_i, as its threads hold it
    uint64_t kv_full, kv_empty, full[STAGES<D>], empty[STAGES<D>];
    int tile;  // the (key block, head) the K_j, V_j in kv_full's current phase belong to
};

template <int D, bool PERSIST>
__global__ void __launch_bounds__(THREADS, 1)
flash_attention_hopper_bwd_kernel(const __grid_constant__ CUtensorMap q_map,
                                  const __grid_constant__ CUtensorMap k_map,
                                  const __grid_constant__ CUtensorMap v_map,
                                  const __grid_constant__ CUtensorMap do_map,
                                  const float* __restrict__ lse2, const float* __restrict__ Delta,
                                  float* __restrict__ dQacc, __nv_bfloat16* __restrict__ dK,
                                  __nv_bfloat16* __restrict__ dV, int* __restrict__ tile_counter,
                                  const DivBy by_n_kb, int B, int H, int Nq, int Nk, float scale,
                                  int causal) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int PANELS = D / 64;       // 64-column panels of a tile
    constexpr int STAGES = fa_hopper_bwd::STAGES<D>;
    constexpr int ACC = D / 2;           // a thread's share of its warpgroup's 64 x D dK_w or dV_w
    constexpr int R = BM<D>;             // query rows per step
    constexpr int DQ = R * D / 256;      // ... and of its R x D / 2 part of dQ_i (32 floats)
    static_assert(sizeof(Tiles<D>) + 1024 <= 227 * 1024,  // + room to align the start to 1024 B
                  "the shared tiles must fit the 227 KB a block may have on an H100: fewer stages");
    Tiles<D>& sm = shared_tiles<Tiles<D>>();

    // The work: tiles of BLOCK_N keys of one head, numbered head by head (key block kb of head
    // bh is tile bh n_kb + kb: the blocks at work share a few heads' Q, dO and dQ accumulator,
    // which stay in L2). One tile a block (the grid is n_kb x H x B), or, PERSIST, one block per
    // SM that takes tile after tile: the first blockIdx.x, then the next one nobody has taken,
    // from a counter in global memory (bwd_preprocess zeroes it). Handed out in order, the causal
    // tiles balance as the hardware's block scheduler balances them (a static order did not:
    // causal key blocks differ in length). The producer takes the next tile and passes it to
    // the consumers in sm.tile with K_j and V_j; meanwhile they store the last tile's dK, dV.
    const int q_blocks = (Nq + R - 1) / R, Nq_pad = q_blocks * R;
    const int n_kb = (Nk + BLOCK_N - 1) / BLOCK_N, n_tiles = n_kb * B * H;
    const int my_tile = PERSIST ? blockIdx.x : (blockIdx.z * H + blockIdx.y) * n_kb + blockIdx.x;
    // causal: query r sees keys 0 .. r, so queries below kb * BLOCK_N see no key of key block kb
    auto first_q_block = [&](int kb) { return causal ? kb * BLOCK_N / R : 0; };
    // the warpgroup, uniform to the compiler when read through a shuffle (see the forward); at
    // d = 128 only: at d = 64 it made ptxas spill 8 bytes
    const int wg = D == 128 ? __shfl_sync(0xffffffff, threadIdx.x / 128, 0) : threadIdx.x / 128;

    if (threadIdx.x == 0) {
        mbar_init_ring(&sm.kv_full, &sm.kv_empty, 1, 128 * CONSUMERS);  // K_j, V_j: one buffer
        mbar_init_ring(sm.full, sm.empty, STAGES, 128 * CONSUMERS);       // Q_i, dO_i
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 0) {  // ------------------------------------------------ the producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (threadIdx.x == 0) {
            // the position in the ring, across tiles: stage s in its phase-th use (mod 2); kept
            // as two counters, not it % STAGES and it / STAGES: at 3 stages the divisions need
            // registers the producer's 24 do not have
            int s = 0, phase = 0;
            for (int n = 0, tile = my_tile;; ++n) {
                if (n > 0) mbar_wait(&sm.kv_empty, (n - 1) & 1);  // the last tile's K, V are free
                sm.tile = tile;                                   // published by the arrival
                if (tile >= n_tiles) {                            // no work left: the consumers stop
                    mbar_arrive(&sm.kv_full);
                    break;
                }
                const int bh = by_n_kb(tile), kb = tile - bh * n_kb, i_first = first_q_block(kb);
                if (i_first < q_blocks) {
                    mbar_expect_bytes(&sm.kv_full, 2 * BLOCK_N * D * 2);
                    for (int p = 0; p < PANELS; ++p) {
                        tma_load(sm.K + p * BLOCK_N * 64, &k_map, &sm.kv_full, 64 * p, kb * BLOCK_N, bh);
                        tma_load(sm.V + p * BLOCK_N * 64, &v_map, &sm.kv_full, 64 * p, kb * BLOCK_N, bh);
                    }
                } else {
                    mbar_arrive(&sm.kv_full);  // no query sees these keys: nothing to load
                }
                for (int i = i_first; i < q_blocks; ++i) {
                    mbar_wait(&sm.empty[s], phase ^ 1);  // a fresh barrier counts as emptied
                    mbar_expect_bytes(&sm.full[s], 2 * R * D * 2);
                    for (int p = 0; p < PANELS; ++p) {
                        tma_load(sm.Q[s] + p * R * 64, &q_map, &sm.full[s], 64 * p, i * R, bh);
                        tma_load(sm.dO[s] + p * R * 64, &do_map, &sm.full[s], 64 * p, i * R, bh);
                    }
                    if (++s == STAGES) s = 0, phase ^= 1;
                }
                if (!PERSIST) break;
                // the next tile: taken here, its atomic's latency hides under the wait for
                // kv_empty (taken before the ring's loads, its value held 4 more registers than
                // the producer's 24 and spilled)
                tile = gridDim.x + atomicAdd(tile_counter, 1);
            }
        }
        return;
    }

    // -------------------------------------------------------------- the consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    const int w = wg - 1;                       // consumer 0 or 1: keys 64w .. 64w + 63 of a block
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;       // a lane holds rows g and g + 8, columns 2t, 2t + 1
    const float scale_log2 = scale * LOG2E;

    // the position in the ring across tiles (stage s in its phase-th use, as the producer counts)
    // and the dS^T buffer of the step (they alternate)
    int s = 0, phase = 0, buf = 0;
    // d = 128 (DK_LATE): dK_w += dS^T Q_i is issued after dQ_i and left running while dQ_i goes
    // out and the next step's S^T and dP^T are issued; it still reads dS^T (ds) and Q_i (stage
    // s_pending) until the next step's first wait. On an H200 the backward alone ran 1.00-1.03x
    // of issuing dK with dV (8 shapes, median 1.02x). At d = 64 (128 query rows a step) ptxas
    // serialized every wgmma for want of registers, and the one-block-per-tile build spilled 16
    // bytes: there dK goes with dV.
    constexpr bool DK_LATE = D == 128 && PERSIST;
    uint32_t ds[R / 4];
    int s_pending = -1;
    for (int n = 0;; ++n) {
        mbar_wait(&sm.kv_full, n & 1);  // this tile's K_j and V_j have landed
        const int tile = sm.tile;
        if (tile >= n_tiles) break;
        const int bh = by_n_kb(tile), kb = tile - bh * n_kb, i_first = first_q_block(kb);
        const int kw0 = kb * BLOCK_N + 64 * w;      // this consumer's first key
        const int key0 = kw0 + 16 * warp + g;       // this thread's keys (rows of S^T): key0, key0 + 8
        const float* lse2_bh = lse2 + (size_t)bh * Nq_pad;
        const float* delta_bh = Delta + (size_t)bh * Nq_pad;

        float dv[ACC], dk[ACC];  // zero if no query sees these keys (i_first = q_blocks)
        #pragma unroll
        for (int i = 0; i < ACC; ++i) dv[i] = dk[i] = 0.f;
        auto issue_dk = [&]() {  // dK_w += dS^T Q_i (stage s): with dV, or DK_LATE after dQ
            #pragma unroll
            for (int k = 0; k < R / 16; ++k) {
                const uint32_t a[4] = {ds[4 * k], ds[4 * k + 1], ds[4 * k + 2], ds[4 * k + 3]};
                wgmma_rs_d<D>(dk, a, desc_rows_mn<R>(sm.Q[s], k));
            }
        };
        auto release_late_stage = [&]() {  // DK_LATE: the last dK has retired; its Q_i is free
            fence_regs(dk);  // unconditionally: ptxas must see dK retired on every path
            fence_regs(ds);
            if (s_pending >= 0) mbar_arrive(&sm.empty[s_pending]);
            s_pending = -1;
        };

        for (int i = i_first; i < q_blocks; ++i) {
            const int q0 = i * R;
            __nv_bfloat16* dST = sm.dST[buf];
            mbar_wait(&sm.full[s], phase);

            // S^T = K_w Q_i^T and dP^T = V_w dO_i^T: two chains, two commit groups, both in flight
            float st[R / 2], dpt[R / 2];
            wgmma_fence();
            #pragma unroll
            for (int k = 0; k < D / 16; ++k) wgmma_ss<R>(st, desc_kw(sm.K, w, k), desc_rows_k<R>(sm.Q[s], k), k > 0);
            wgmma_commit();
            #pragma unroll
            for (int k = 0; k < D / 16; ++k) wgmma_ss<R>(dpt, desc_kw(sm.V, w, k), desc_rows_k<R>(sm.dO[s], k), k > 0);
            wgmma_commit();

            // P^T = 2^(S^T scale log2(e) - LSE log2(e)) while dP^T is still computing. Register i of
            // st is key row key0 + 8 ((i % 4) / 2), query q0 + 8 (i / 4) + 2t + (i % 2): one float2
            // of lse2 serves 4 registers. Masked: keys past Nk, causal key > query. Queries past Nq need
            // no test: lse2 is +inf there (preprocessing), so P is 2^-inf = 0 without one.
            wgmma_wait<1>();  // S^T done (and, DK_LATE, the last step's dK: groups retire in order)
            fence_regs(st);
            if constexpr (DK_LATE) release_late_stage();
            #pragma unroll
            for (int c = 0; c < R / 8; ++c) {
                const float2 l = *reinterpret_cast<const float2*>(lse2_bh + q0 + 8 * c + 2 * t);
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int idx = 4 * c + j;
                    st[idx] = fast_exp2(fmaf(st[idx], scale_log2, -(j % 2 ? l.y : l.x)));
                }
            }
            // The mask, only on the steps that cross the diagonal or the last key, as the forward
            // does: a branch the whole warpgroup takes alike. Written inside the loop above, it
            // was if-converted, and every step paid its ~100 compares and selects (d = 128).
            if (kw0 + 64 > Nk || (causal && kw0 + 63 > q0)) {
                #pragma unroll
                for (int idx = 0; idx < R / 2; ++idx) {
                    const int key = key0 + 8 * ((idx % 4) / 2), q = q0 + 8 * (idx / 4) + 2 * t + idx % 2;
                    if (key >= Nk || (causal && key > q)) st[idx] = 0.f;
                }
            }
            // dS^T = P^T * (dP^T - Delta), Delta per query (column)
            wgmma_wait<0>();
            fence_regs(dpt);
            #pragma unroll
            for (int c = 0; c < R / 8; ++c) {
                const float2 dl = *reinterpret_cast<const float2*>(delta_bh + q0 + 8 * c + 2 * t);
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int idx = 4 * c + j;
                    dpt[idx] = st[idx] * (dpt[idx] - (j % 2 ? dl.y : dl.x));
                }
            }
            // bf16 pairs: word j = registers 2j, 2j + 1, which are the A fragments of the next
            // products (k-step k uses words 4k .. 4k + 3), as P in the forward's O += P V
            uint32_t p[R / 4];
            #pragma unroll
            for (int j = 0; j < R / 4; ++j) {
                p[j] = pack_bf16(st[2 * j], st[2 * j + 1]);
                ds[j] = pack_bf16(dpt[2 * j], dpt[2 * j + 1]);
            }
            // dS^T to shared memory for dQ, made visible to wgmma (the barrier comes below)
            store_dst<R>(dST, w, warp, g, t, ds);
            fence_proxy_async();

            // dV_w += P^T dO_i and dK_w += dS^T Q_i: 4 k-steps of 16 queries each
            wgmma_fence();
            #pragma unroll
            for (int k = 0; k < R / 16; ++k) {
                const uint32_t a[4] = {p[4 * k], p[4 * k + 1], p[4 * k + 2], p[4 * k + 3]};
                wgmma_rs_d<D>(dv, a, desc_rows_mn<R>(sm.dO[s], k));
            }
            if constexpr (!DK_LATE) issue_dk();
            wgmma_commit();

            // dQ_i[:, (D/2) w ..] = dS K[:, (D/2) w ..] over all 128 keys: needs both consumers' dS^T.
            // The tile is double-buffered: passing this barrier at a step means the other consumer
            // finished the step before (its last read of the buffer the next step will overwrite).
            // Both consumers take the same steps, tile after tile, so this holds across tiles.
            named_sync(1);
            float dq[DQ];
            #pragma unroll
            for (int k = 0; k < BLOCK_N / 16; ++k) {
                if constexpr (R == 128)  // queries 64w .. 64w + 63, all D = 64 columns
                    wgmma_ss_tt_n64(dq, desc_dst_panel(dST, w, k), desc_rows_mn<BLOCK_N>(sm.K, k), k > 0);
                else                     // all 64 queries, columns (D / 2) w ..
                    wgmma_ss_dq<D>(dq, desc_dst_panel(dST, 0, k), desc_k_half<D>(sm.K, w, k), k > 0);
            }
            wgmma_commit();
            if constexpr (DK_LATE) {
                issue_dk();
                wgmma_commit();
                wgmma_wait<1>();  // dV and dQ done; dK still runs
                s_pending = s;    // dO_i is no longer read, Q_i is until dK is done
            } else {
                wgmma_wait<0>();
                fence_regs(dk);
                fence_regs(ds);
                mbar_arrive(&sm.empty[s]);  // Q_i and dO_i are no longer read
            }
            fence_regs(dv);
            fence_regs(dq);
            fence_regs(p);

            // Add this block's part of dQ_i (unscaled) into the float32 accumulator. The buffer is
            // free once the last step's bulk copy has read it; then float4 c of every thread goes to
            // float4 128 c + tid (a warp writes 512 contiguous bytes: no bank conflict), and one
            // thread hands the R x D / 2 floats to the TMA unit, which adds them to global memory
            // while this warpgroup goes on to step i + 1.
            float* dq_smem = sm.dQ[w];
            if (tid == 0) bulk_wait_read();
            named_sync_wg(2 + w);
            #pragma unroll
            for (int c = 0; c < DQ / 4; ++c)
                reinterpret_cast<float4*>(dq_smem)[128 * c + tid] =
                    make_float4(dq[4 * c], dq[4 * c + 1], dq[4 * c + 2], dq[4 * c + 3]);
            fence_proxy_async();  // the writes, visible to the TMA unit (the async proxy)
            named_sync_wg(2 + w);
            if (tid == 0) {  // (the head read again from sm.tile: kept in a register across the
                             // step, it spilled at D = 64, where the consumers have none to spare)
                const int head = by_n_kb(sm.tile);
                bulk_reduce_add(dQacc + ((size_t)head * q_blocks + i) * R * D + w * (R * D / 2),
                                dq_smem, R * D / 2 * 4);
                bulk_commit();
            }
            if (++s == STAGES) s = 0, phase ^= 1;
            buf ^= 1;
        }
        if constexpr (DK_LATE) {  // the tile's last dK
            wgmma_wait<0>();
            release_late_stage();
        }
        mbar_arrive(&sm.kv_empty);  // K_j, V_j and sm.tile are no longer read: the next tile's may come

        // ---------------------------------------------------------------- epilogue
        // dK_w = scale dS^T Q and dV_w = P^T dO, rows key0 and key0 + 8, 16 bytes a lane
        // (store_row_bf16; rows past Nk not written)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int key = key0 + 8 * h;
            const size_t row = ((size_t)bh * Nk + key) * D;
            store_row_bf16<D>(dK + row, dk, h, scale, t, key < Nk);
            store_row_bf16<D>(dV + row, dv, h, 1.f, t, key < Nk);
        }
        if (!PERSIST) break;
    }
    if (tid == 0) bulk_wait_all();  // shared memory must outlive the copies
#else
    __trap();  // built for a GPU without sm_90a's wgmma and TMA: the host refuses to launch
#endif
}

// ---------------------------------------------------------------- 3. dQ to bf16

// dQ = scale * dQacc, one float4 of the accumulator per thread and step. Float4 f is, in the
// main kernel's terms: tile f / (R D / 4) (head bh and query block i of that head), consumer w,
// its register group c and thread tid, i.e. registers 4c .. 4c + 3 of that thread: dQ[q, col],
// dQ[q, col + 1], dQ[q + 8, col], dQ[q + 8, col + 1] (the wgmma accumulator's layout), with
// q = R i + 16 warp + g and col = (D / 2) w + 8 c + 2 t at D = 128 (consumer w holds half the
// columns), q = R i + 64 w + 16 warp + g and col = 8 c + 2 t at D = 64 (half the queries).
// Rows past Nq are padding.
template <int D>
__global__ void bwd_convert_dq_kernel(const float* __restrict__ dQacc, __nv_bfloat16* __restrict__ dQ,
                                      size_t n4, int q_blocks, int Nq, float scale) {
    constexpr int R = BM<D>, TILE4 = R * D / 4;  // float4 of one (head, query block) tile
    for (size_t f = (size_t)blockIdx.x * blockDim.x + threadIdx.x; f < n4;
         f += (size_t)gridDim.x * blockDim.x) {
        const float4 v = reinterpret_cast<const float4*>(dQacc)[f];
        const size_t tile = f / TILE4;
        const int in_tile = f % TILE4, w = in_tile / (TILE4 / 2), c = in_tile % (TILE4 / 2) / 128;
        const int tid = in_tile % 128, warp = tid / 32, g = tid % 32 / 4, t = tid % 4;
        const size_t bh = tile / q_blocks;
        // R = 128: consumer w holds queries 64w .., all columns; R = 64: all queries, half w of D
        const int q = (int)(tile % q_blocks) * R + (R == 128 ? 64 * w : 0) + 16 * warp + g;
        const int col = (R == 128 ? 0 : (D / 2) * w) + 8 * c + 2 * t;
        if (q < Nq)
            *reinterpret_cast<uint32_t*>(dQ + (bh * Nq + q) * D + col) = pack_bf16(v.x * scale, v.y * scale);
        if (q + 8 < Nq)
            *reinterpret_cast<uint32_t*>(dQ + (bh * Nq + q + 8) * D + col) = pack_bf16(v.z * scale, v.w * scale);
    }
}

// ---------------------------------------------------------------- probe: dQ = dS K
// The one product the forward's probes do not cover: A (dS) from a tile the threads wrote
// themselves (store_dst), read transposed (MN-major A), and B = K read MN-major from a column
// offset inside a panel (at D = 64). Two warpgroups, exactly as the consumers: each stores its
// 64 rows of dS^T from the accumulator layout, fences, meets the other at the named barrier, and
// computes its D / 2 columns with the kernel's descriptors. dST (128 keys x 64 queries, bf16,
// row-major) and K (128 x D) in, dQ (64 x D float32, row-major) = dST^T K out.

template <int D>
struct ProbeTiles {
    __nv_bfloat16 K[BLOCK_N * D];
    __nv_bfloat16 dST[BLOCK_N * BLOCK_M];
    uint64_t full;
};

template <int D>
__global__ void probe_dq_kernel(const __nv_bfloat16* __restrict__ dST_in,
                                const __grid_constant__ CUtensorMap k_map, float* dQ) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    ProbeTiles<D>& sm = probe_setup<ProbeTiles<D>>();
    if (threadIdx.x == 0) {
        mbar_expect_bytes(&sm.full, BLOCK_N * D * 2);
        for (int p = 0; p < D / 64; ++p) tma_load(sm.K + p * BLOCK_N * 64, &k_map, &sm.full, 64 * p, 0, 0);
    }
    const int w = threadIdx.x / 128, tid = threadIdx.x % 128, warp = tid / 32;
    const int g = (tid % 32) / 4, t = tid % 4;
    uint32_t ds[16];  // the words a consumer's thread holds after packing dS^T
    #pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int row = 64 * w + 16 * warp + g + 8 * (j % 2), col = 8 * (j / 2) + 2 * t;
        ds[j] = *reinterpret_cast<const uint32_t*>(dST_in + row * BLOCK_M + col);
    }
    store_dst(sm.dST, w, warp, g, t, ds);
    fence_proxy_async();
    named_sync(1);
    mbar_wait(&sm.full, 0);
    float dq[D / 4];
    wgmma_fence();
    #pragma unroll
    for (int k = 0; k < BLOCK_N / 16; ++k)
        wgmma_ss_dq<D>(dq, desc_dst_panel(sm.dST, 0, k), desc_k_half<D>(sm.K, w, k), k > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(dq);
    #pragma unroll
    for (int idx = 0; idx < D / 4; ++idx) {
        const int q = 16 * warp + g + 8 * ((idx % 4) / 2), col = (D / 2) * w + 8 * (idx / 4) + 2 * t + idx % 2;
        dQ[q * D + col] = dq[idx];
    }
#else
    __trap();
#endif
}

#if defined(FA_KERNEL_ONLY)  // compile-only builds (ptxas -v): every variant
#define FA_BWD_MAIN(DD, PERSIST)                                                                 \
    template __global__ void flash_attention_hopper_bwd_kernel<DD, PERSIST>(                     \
        const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap,                \
        const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap, const float*,  \
        const float*, float*, __nv_bfloat16*, __nv_bfloat16*, int*, const DivBy, int, int, int, \
        int, float, int);
#define FA_BWD_INSTANTIATE(DD)                                                                   \
    FA_BWD_MAIN(DD, false) FA_BWD_MAIN(DD, true)                                                 \
    template __global__ void probe_dq_kernel<DD>(const __nv_bfloat16*,                           \
                                                 const __grid_constant__ CUtensorMap, float*);   \
    template __global__ void bwd_convert_dq_kernel<DD>(const float*, __nv_bfloat16*, size_t, int, \
                                                       int, float);                              \
    template __global__ void bwd_preprocess_kernel<DD>(const __nv_bfloat16*, const __nv_bfloat16*, \
                                                       const float*, float*, float*, float*, int*, \
                                                       int, int, int);
FA_BWD_INSTANTIATE(64) FA_BWD_INSTANTIATE(128)
#undef FA_BWD_INSTANTIATE
#undef FA_BWD_MAIN
#endif

}  // namespace fa_hopper_bwd

#if !defined(__CUDACC_RTC__) && !defined(FA_KERNEL_ONLY)

#include "hopper_host.cuh"  // check_cuda, make_map (the TMA tensor maps)

static void require_sm90(const char* fn, const torch::Tensor& X) {
    int major = 0, minor = 0;  // device attributes: cheap, unlike cudaGetDeviceProperties
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, X.get_device()), fn);
    check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, X.get_device()), fn);
    TORCH_CHECK(major == 9, fn, ": needs an sm_90 GPU (H100/H200: TMA and wgmma); this one is sm_",
                std::to_string(major * 10 + minor), ". Use chapter 09 or 10's backward instead.");
}

template <int D, bool PERSIST>
static void launch_main(const torch::Tensor& Q, const torch::Tensor& K, const torch::Tensor& V,
                        const torch::Tensor& dO, const torch::Tensor& lse2,
                        const torch::Tensor& Delta, torch::Tensor& dQacc, torch::Tensor& dK,
                        torch::Tensor& dV, int* tile_counter, float scale, bool causal) {
    using namespace fa_hopper_bwd;
    const int B = Q.size(0), H = Q.size(1), Nq = Q.size(2), Nk = K.size(2);
    const CUtensorMap q_map = make_map(Q, BM<D>), do_map = make_map(dO, BM<D>),
                      k_map = make_map(K, BLOCK_N), v_map = make_map(V, BLOCK_N);
    constexpr int SMEM = sizeof(Tiles<D>) + 1024;  // + room to align the start to 1024 bytes
    auto kernel = flash_attention_hopper_bwd_kernel<D, PERSIST>;
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM),
               "flash_attention_hopper_bwd: asking for shared memory");
    const int n_kb = (Nk + BLOCK_N - 1) / BLOCK_N;
    dim3 grid(n_kb, H, B);  // a block per tile (causal: key block 0 has the most query blocks)
    if (PERSIST) {          // a block per SM (or per tile, when there are fewer)
        TORCH_CHECK(int64_t(n_kb) * B * H + 1024 < (int64_t(1) << 31), "flash_attention_hopper_bwd: "
                    "too many key blocks for the persistent kernel (B x H x Nk / 128 must be below 2^31)");
        int sms = 0;
        check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, Q.get_device()),
                   "flash_attention_hopper_bwd: counting SMs");
        grid = dim3(static_cast<unsigned>(std::min<int64_t>(sms, int64_t(n_kb) * B * H)));
    }
    kernel<<<grid, THREADS, SMEM, c10::cuda::getCurrentCUDAStream()>>>(
        q_map, k_map, v_map, do_map, lse2.data_ptr<float>(), Delta.data_ptr<float>(),
        dQacc.data_ptr<float>(), reinterpret_cast<__nv_bfloat16*>(dK.data_ptr()),
        reinterpret_cast<__nv_bfloat16*>(dV.data_ptr()), tile_counter, div_by(n_kb), B, H, Nq, Nk,
        scale, causal ? 1 : 0);
    check_cuda(cudaGetLastError(), "flash_attention_hopper_bwd: launch");
}

// The three passes at head dim D, after the caller's checks (Q, K, V, O, dO bf16, contiguous, on
// the current GPU; B, H, Nq, Nk > 0); they write dQ, dK and dV.
template <int D, bool PERSIST = FA_BWD_PERSIST>
static void backward_passes(const torch::Tensor& Q, const torch::Tensor& K, const torch::Tensor& V,
                            const torch::Tensor& O, const torch::Tensor& dO, const torch::Tensor& LSE,
                            torch::Tensor& dQ, torch::Tensor& dK, torch::Tensor& dV, bool causal) {
    using namespace fa_hopper_bwd;
    const int64_t B = Q.size(0), H = Q.size(1), Nq = Q.size(2);
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    auto stream = c10::cuda::getCurrentCUDAStream();

    // 1. Delta, LSE in base 2 (both padded to whole query blocks), dQ accumulator = 0 (whole
    // query blocks too: R x D floats per head and block, in the main kernel's order), one kernel
    constexpr int64_t R = BM<D>;
    const int64_t q_blocks = (Nq + R - 1) / R, Nq_pad = q_blocks * R;
    auto f32 = Q.options().dtype(torch::kFloat);
    auto Delta = torch::empty({B, H, Nq_pad}, f32);
    auto lse2 = torch::empty({B, H, Nq_pad}, f32);
    auto dQacc = torch::empty({B, H, Nq_pad, D}, f32);  // zeroed by bwd_preprocess
    // the persistent main kernel's next tile (zeroed by bwd_preprocess too)
    auto counter = torch::empty({PERSIST ? 1 : 0}, Q.options().dtype(torch::kInt));
    int* tile_counter = PERSIST ? counter.data_ptr<int>() : nullptr;
    const int pre_rows = PRE_THREADS / (D / 8);  // divides R (16 at D = 128, 32 at D = 64)
    bwd_preprocess_kernel<D><<<dim3(Nq_pad / pre_rows, H, B), PRE_THREADS, 0, stream>>>(
        reinterpret_cast<const __nv_bfloat16*>(O.data_ptr()),
        reinterpret_cast<const __nv_bfloat16*>(dO.data_ptr()), LSE.data_ptr<float>(),
        Delta.data_ptr<float>(), lse2.data_ptr<float>(), dQacc.data_ptr<float>(), tile_counter, H,
        Nq, Nq_pad);
    check_cuda(cudaGetLastError(), "flash_attention_hopper_bwd: preprocess launch");

    // 2. dK, dV, and the dQ accumulator
    launch_main<D, PERSIST>(Q, K, V, dO, lse2, Delta, dQacc, dK, dV, tile_counter, scale, causal);

    // 3. dQ = scale * accumulator, in bf16
    const size_t n4 = static_cast<size_t>(dQacc.numel()) / 4;
    const int blocks = static_cast<int>(std::min<size_t>((n4 + 255) / 256, 65536));
    bwd_convert_dq_kernel<D><<<blocks, 256, 0, stream>>>(
        dQacc.data_ptr<float>(), reinterpret_cast<__nv_bfloat16*>(dQ.data_ptr()), n4,
        static_cast<int>(q_blocks), Nq, scale);
    check_cuda(cudaGetLastError(), "flash_attention_hopper_bwd: convert launch");
}

// dQ, dK, dV of attention(Q, K, V) given the forward's O and LSE and the gradient dO of O (sm_90a).
std::vector<torch::Tensor> flash_attention_hopper_bwd(torch::Tensor Q, torch::Tensor K, torch::Tensor V,
                                                      torch::Tensor O, torch::Tensor dO,
                                                      torch::Tensor LSE, bool causal) {
    using namespace fa_hopper_bwd;
    const char* fn = "flash_attention_hopper_bwd";
    for (const auto* X : {&Q, &K, &V, &O, &dO}) {
        TORCH_CHECK(X->is_cuda(), fn, ": Q, K, V, O and dO must be CUDA tensors");
        TORCH_CHECK(X->scalar_type() == torch::kBFloat16, fn,
                    ": Q, K, V, O and dO must be bfloat16 (call .bfloat16())");
        TORCH_CHECK(X->dim() == 4, fn, ": Q, K, V, O and dO must be 4D (B, H, N, D)");
        TORCH_CHECK(X->is_contiguous(), fn, ": Q, K, V, O and dO must be contiguous (call .contiguous())");
        TORCH_CHECK(reinterpret_cast<uintptr_t>(X->data_ptr()) % 16 == 0,
                    fn, ": Q, K, V, O and dO must start on a 16-byte boundary (call .clone())");
        TORCH_CHECK(X->device() == Q.device(), fn, ": Q, K, V, O, dO and LSE must be on the same GPU");
    }
    TORCH_CHECK(K.sizes() == V.sizes(), fn, ": K and V must have the same shape");
    TORCH_CHECK(Q.size(0) == K.size(0) && Q.size(1) == K.size(1) && Q.size(3) == K.size(3),
                fn, ": Q and K must agree in B, H and D");
    TORCH_CHECK(O.sizes() == Q.sizes() && dO.sizes() == Q.sizes(), fn,
                ": O and dO must have the shape of Q");
    const int64_t D = Q.size(3);
    TORCH_CHECK(D == 64 || D == 128, fn, ": head dim D must be 64 or 128, got ", std::to_string(D));
    const int64_t B = Q.size(0), H = Q.size(1), Nq = Q.size(2), Nk = K.size(2);
    TORCH_CHECK(LSE.is_cuda() && LSE.device() == Q.device(), fn, ": LSE must be on the GPU of Q");
    TORCH_CHECK(LSE.scalar_type() == torch::kFloat, fn, ": LSE must be float32 (the forward's LSE)");
    TORCH_CHECK(LSE.dim() == 3 && LSE.size(0) == B && LSE.size(1) == H && LSE.size(2) == Nq, fn,
                ": LSE must have shape (B, H, Nq) = (", std::to_string(B), ", ", std::to_string(H),
                ", ", std::to_string(Nq), ")");
    TORCH_CHECK(LSE.is_contiguous(), fn, ": LSE must be contiguous (call .contiguous())");
    require_sm90(fn, Q);
    TORCH_CHECK(H <= 65535 && B <= 65535, fn, ": B and H must be at most 65535");
    TORCH_CHECK(Nq <= (1 << 30) && Nk <= (1 << 30), fn, ": Nq and Nk must be at most 2^30");

    auto dQ = torch::empty_like(Q);
    auto dK = torch::empty_like(K);
    auto dV = torch::empty_like(V);
    if (B == 0 || H == 0) return {dQ, dK, dV};
    if (Nq == 0) return {dQ, dK.zero_(), dV.zero_()};  // no query: no gradient reaches K, V
    if (Nk == 0) return {dQ.zero_(), dK, dV};           // no key: O = 0 does not depend on Q
    c10::cuda::CUDAGuard guard(Q.device());
    if (D == 64) backward_passes<64>(Q, K, V, O, dO, LSE, dQ, dK, dV, causal);
    else backward_passes<128>(Q, K, V, O, dO, LSE, dQ, dK, dV, causal);
    return {dQ, dK, dV};
}

// ---------------------------------------------------------------- the probe's host side

// dQ = dST^T K (dST 128 keys x 64 queries, K 128 x D, bf16) by the main kernel's two consumers'
// dQ path: float32 64 x D.
torch::Tensor hopper_bwd_probe_dq(torch::Tensor dST, torch::Tensor K) {
    using namespace fa_hopper_bwd;
    const char* fn = "hopper_bwd_probe_dq";
    TORCH_CHECK(dST.is_cuda() && dST.scalar_type() == torch::kBFloat16 && dST.is_contiguous() &&
                dST.dim() == 2 && dST.size(0) == BLOCK_N && dST.size(1) == BLOCK_M,
                fn, ": dST must be a contiguous bf16 CUDA tensor of 128 x 64");
    TORCH_CHECK(K.is_cuda() && K.scalar_type() == torch::kBFloat16 && K.is_contiguous() &&
                K.dim() == 2 && K.size(0) == BLOCK_N && (K.size(1) == 64 || K.size(1) == 128),
                fn, ": K must be a contiguous bf16 CUDA tensor of 128 x D, D = 64 or 128");
    require_sm90(fn, K);
    const int D = K.size(1);
    auto dQ = torch::empty({BLOCK_M, D}, K.options().dtype(torch::kFloat));
    const CUtensorMap k_map = make_map(K.view({1, 1, BLOCK_N, D}), BLOCK_N);
    const auto* ds = reinterpret_cast<const __nv_bfloat16*>(dST.data_ptr());
    auto run = [&](auto kernel, int smem) {
        check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), fn);
        kernel<<<1, 2 * 128, smem, c10::cuda::getCurrentCUDAStream()>>>(ds, k_map, dQ.data_ptr<float>());
        check_cuda(cudaGetLastError(), fn);
    };
    if (D == 64) run(probe_dq_kernel<64>, sizeof(ProbeTiles<64>) + 1024);
    else run(probe_dq_kernel<128>, sizeof(ProbeTiles<128>) + 1024);
    return dQ;
}

#endif
