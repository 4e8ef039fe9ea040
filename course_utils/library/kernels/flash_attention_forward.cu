// FlashAttention-2 forward pass, float32, for chapter 07 of the course.
//
// One source, two ways in:
//   * course_utils.load_cuda(path, ["flash_attention_forward"]) builds it with the torch host
//     function at the bottom (nvcc + load_inline);
//   * course_utils.compile_kernel(path, "flash_attention_forward_kernel<64>") compiles only the
//     kernel with NVRTC (which defines __CUDACC_RTC__, so the torch part is skipped).
//
// Shapes (row-major, contiguous): Q (B, H, Nq, D), K and V (B, H, Nk, D), O (B, H, Nq, D),
// LSE (B, H, Nq), all float32. Grid: (Tr, H, B) blocks, Tr = ceil(Nq / Br): block
// (blockIdx.x, blockIdx.y, blockIdx.z) owns query tile i = blockIdx.x of head h = blockIdx.y of
// batch b = blockIdx.z, i.e. of the (batch, head) bh = b * H + h = blockIdx.z * gridDim.y +
// blockIdx.y. (Not (Tr, B * H): grid y and z stop at 65535, and B * H passes that in decode
// batches; a (Tr, B * H) grid of smaller problems still works, with gridDim.z = 1.)
// Block: THREADS = 256 threads seen as a TY x TX = 16 x 16 grid; thread (ty, tx) owns
//   * S rows    r = ty + TY * a  (a < TM = 4)   and S columns c = tx + TX * b  (b < TN = 4);
//   * O rows    r = ty + TY * a  (the same rows) and O columns  col(tx, q), q < CPT = D / 16;
//   * m and l   of its TM rows (l only its partial sum over its own columns until the end).
// The 16 threads that share a row are 16 consecutive lanes of one warp (tx = lane % 16), so a
// row max is 4 __shfl_xor_sync steps.
//
// Shared memory (dynamic, floats): Qs[Br][D + 4] | KVs[Bc][D + 4] | Ps[Br][Bc + 4]
//   Qs  the query tile, pre-multiplied by scale * log2(e) (so exp(x) becomes exp2f(x'))
//   KVs the K tile, then (after a barrier) the V tile of the same key block: one buffer
//   Ps  the probabilities P of the current tile, read by every thread of the row in P V
// The +4 padding makes 8 consecutive rows start in 8 different groups of 4 banks, so the
// float4 reads Ks[c][k..k+3] of 8 lanes (one 128-byte phase) hit 32 different banks.

#if !defined(__CUDACC_RTC__) && !defined(FA_KERNEL_ONLY)
// From torch, what this file uses: the Tensor class and one header per operator it calls, under
// the torch:: names of <torch/types.h>. That header has every operator: a compile-only build (no
// GPU) takes about 30 % longer with it. On a GPU, load_inline puts it before this file anyway.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
namespace torch { using namespace at; }  // torch::Tensor, torch::empty, torch::kFloat, ...
#include <c10/cuda/CUDAStream.h>
#include <cstdint>
// Numbers in TORCH_CHECK messages go through std::to_string: on the H100 machine the course is
// validated on (torch 2.11.0+cu130, g++ 13), a message that streams a raw int or float into
// TORCH_CHECK crashes the process (segfault) instead of raising, in any load_inline extension.
#include <string>
#include <tuple>
#endif

#ifndef FA_MIN_BLOCKS
#define FA_MIN_BLOCKS 2  // __launch_bounds__: ask ptxas to fit 2 blocks per SM (<= 128 registers)
#endif

namespace fa07 {

constexpr int Br = 64;       // query rows per block (one query tile)
constexpr int Bc = 64;       // key rows per K/V tile
constexpr int TX = 16;       // threads along the columns of S
constexpr int TY = 16;       // threads along the rows of S
constexpr int TM = Br / TY;  // 4 rows of S (and O) per thread
constexpr int TN = Bc / TX;  // 4 columns of S per thread
constexpr int THREADS = TX * TY;  // 256
constexpr int PAD = 4;       // floats of padding per shared row (keeps rows 16-byte aligned)
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

__host__ __device__ constexpr int shared_floats(int D) {
    return Br * (D + PAD) + Bc * (D + PAD) + Br * (Bc + PAD);
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Copy rows [row0, row0 + ROWS) of a (n_rows, D) matrix into tile[ROWS][D + PAD], times `mult`,
// as float4s: consecutive threads read consecutive 16 bytes (coalesced). Rows past n_rows get
// 0, so padded keys contribute P = 0 times V = 0 (not 0 times leftover garbage, which may be NaN).
template <int D, int ROWS>
__device__ __forceinline__ void load_tile(float* tile, const float* __restrict__ src, int row0,
                                          int n_rows, float mult) {
    constexpr int VECS_PER_ROW = D / 4;
    for (int f = threadIdx.x; f < ROWS * VECS_PER_ROW; f += THREADS) {
        const int row = f / VECS_PER_ROW;
        const int k = (f % VECS_PER_ROW) * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (row0 + row < n_rows) {
            v = *reinterpret_cast<const float4*>(src + (size_t)(row0 + row) * D + k);
            v.x *= mult; v.y *= mult; v.z *= mult; v.w *= mult;
        }
        *reinterpret_cast<float4*>(tile + row * (D + PAD) + k) = v;
    }
}

// Column q (< CPT = D / 16) of a thread's O micro-tile. The CPT columns come in groups of
// G = min(CPT, 4) adjacent ones, so a group is one float4 (float2, float) access and the 16
// threads of a row cover 16 * G adjacent columns: conflict-free, coalesced.
template <int D>
__device__ __forceinline__ int o_col(int tx, int q) {
    constexpr int CPT = D / TX;
    constexpr int G = CPT < 4 ? CPT : 4;
    return (q / G) * (TX * G) + tx * G + q % G;
}

}  // namespace fa07

// The kernel lives at file scope, so that NVRTC and the course's tools find it by its plain
// name: flash_attention_forward_kernel<64>.
template <int D>
__global__ void __launch_bounds__(fa07::THREADS, FA_MIN_BLOCKS)
flash_attention_forward_kernel(const float* __restrict__ Q, const float* __restrict__ K,
                               const float* __restrict__ V, float* __restrict__ O,
                               float* __restrict__ LSE, int Nq, int Nk, float scale, int causal) {
    using namespace fa07;
    static_assert(D % 16 == 0 && D >= 16 && D <= 128, "D must be 16, 32, 64 or 128");
    constexpr int CPT = D / TX;  // O columns per thread
    constexpr int LDQ = D + PAD, LDK = D + PAD, LDP = Bc + PAD;

    extern __shared__ __align__(16) float smem[];
    float* Qs = smem;                 // [Br][LDQ]
    float* KVs = Qs + Br * LDQ;       // [Bc][LDK]: K_j, then V_j
    float* Ps = KVs + Bc * LDK;       // [Br][LDP]

    const int tx = threadIdx.x % TX;  // lanes 0..15 and 16..31 of a warp: two rows' groups
    const int ty = threadIdx.x / TX;
    const int i = blockIdx.x;         // query tile
    const unsigned bh = blockIdx.z * gridDim.y + blockIdx.y;  // batch * H + head (< 2^32)
    const int row0 = i * Br;
    const float* Qbh = Q + (size_t)bh * Nq * D;
    const float* Kbh = K + (size_t)bh * Nk * D;
    const float* Vbh = V + (size_t)bh * Nk * D;
    float* Obh = O + (size_t)bh * Nq * D;
    float* LSEbh = LSE + (size_t)bh * Nq;

    // Running state of this thread's TM rows: in registers for the whole loop (FA2's order).
    float m[TM], l[TM], acc_o[TM][CPT];
#pragma unroll
    for (int a = 0; a < TM; ++a) {
        m[a] = neg_inf();
        l[a] = 0.f;
#pragma unroll
        for (int q = 0; q < CPT; ++q) acc_o[a][q] = 0.f;
    }

    // Q_i once, scaled so that S comes out in log2 units: S' = S * log2(e).
    load_tile<D, Br>(Qs, Qbh, row0, Nq, scale * LOG2E);

    // Causal (top-left): the last key any row of this tile sees is min(row0 + Br, Nq) - 1, so
    // the K/V tiles past it are skipped entirely, not loaded and masked.
    const int Tc = (Nk + Bc - 1) / Bc;
    const int last_row = min(row0 + Br, Nq);  // one past this tile's last real query row
    const int n_tiles = causal ? min(Tc, (min(Nk, last_row) + Bc - 1) / Bc) : Tc;

    for (int j = 0; j < n_tiles; ++j) {
        const int col0 = j * Bc;
        load_tile<D, Bc>(KVs, Kbh, col0, Nk, 1.f);
        __syncthreads();  // (1) RAW: K_j (and, on the first pass, Q_i) written by all threads
                          //     must be visible before anyone reads them for S.

        // S' = Q_i K_j^T for this thread's TM x TN micro-tile (chapter 04's register tiling).
        float s[TM][TN];
#pragma unroll
        for (int a = 0; a < TM; ++a)
#pragma unroll
            for (int b = 0; b < TN; ++b) s[a][b] = 0.f;
#pragma unroll 4
        for (int k = 0; k < D; k += 4) {
            float4 qv[TM], kv[TN];
#pragma unroll
            for (int a = 0; a < TM; ++a)
                qv[a] = *reinterpret_cast<const float4*>(Qs + (ty + TY * a) * LDQ + k);
#pragma unroll
            for (int b = 0; b < TN; ++b)
                kv[b] = *reinterpret_cast<const float4*>(KVs + (tx + TX * b) * LDK + k);
#pragma unroll
            for (int a = 0; a < TM; ++a)
#pragma unroll
                for (int b = 0; b < TN; ++b)
                    s[a][b] += qv[a].x * kv[b].x + qv[a].y * kv[b].y + qv[a].z * kv[b].z +
                               qv[a].w * kv[b].w;
        }

        // Mask only where a tile needs it: the ragged last key tile, and tiles that straddle
        // the diagonal. Whole tiles below the diagonal take the fast path.
        const bool needs_mask = (col0 + Bc > Nk) || (causal && col0 + Bc - 1 > row0);
        if (needs_mask) {
#pragma unroll
            for (int a = 0; a < TM; ++a)
#pragma unroll
                for (int b = 0; b < TN; ++b) {
                    const int r = row0 + ty + TY * a, c = col0 + tx + TX * b;
                    if (c >= Nk || (causal && c > r)) s[a][b] = neg_inf();
                }
        }

        // Online softmax (chapter 02), in log2 units. The 16 lanes of a row agree on m, so
        // each keeps only its partial l and its own columns of O.
#pragma unroll
        for (int a = 0; a < TM; ++a) {
            float mx = s[a][0];
#pragma unroll
            for (int b = 1; b < TN; ++b) mx = fmaxf(mx, s[a][b]);
#pragma unroll
            for (int off = TX / 2; off > 0; off /= 2)  // 8, 4, 2, 1: stays inside the 16 lanes
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float m_new = fmaxf(m[a], mx);
            const float m_use = m_new == neg_inf() ? 0.f : m_new;  // no -inf - -inf = NaN
            const float alpha = exp2f(m[a] - m_use);               // 0 on the first tile
            l[a] *= alpha;
#pragma unroll
            for (int q = 0; q < CPT; ++q) acc_o[a][q] *= alpha;
#pragma unroll
            for (int b = 0; b < TN; ++b) {
                const float p = exp2f(s[a][b] - m_use);  // masked: exp2(-inf) = 0
                l[a] += p;
                Ps[(ty + TY * a) * LDP + tx + TX * b] = p;
            }
            m[a] = m_new;
        }
        __syncthreads();  // (2) WAR: every thread has finished reading K_j from KVs before
                          //     V_j overwrites it (P is written above; (3) publishes it).

        load_tile<D, Bc>(KVs, Vbh, col0, Nk, 1.f);
        __syncthreads();  // (3) RAW: V_j and the whole P tile are visible to every thread.

        // O_i += P V_j: each thread's TM rows x CPT columns, P read 4 columns at a time.
#pragma unroll 2
        for (int c = 0; c < Bc; c += 4) {
            float4 pv[TM];
#pragma unroll
            for (int a = 0; a < TM; ++a)
                pv[a] = *reinterpret_cast<const float4*>(Ps + (ty + TY * a) * LDP + c);
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) {
                float v[CPT];
#pragma unroll
                for (int q = 0; q < CPT; ++q) v[q] = KVs[(c + cc) * LDK + o_col<D>(tx, q)];
#pragma unroll
                for (int a = 0; a < TM; ++a) {
                    const float p = cc == 0 ? pv[a].x : cc == 1 ? pv[a].y : cc == 2 ? pv[a].z
                                                                                   : pv[a].w;
#pragma unroll
                    for (int q = 0; q < CPT; ++q) acc_o[a][q] += p * v[q];
                }
            }
        }
        __syncthreads();  // (4) WAR: every thread has finished reading V_j and P before the
                          //     next pass overwrites KVs with K_{j+1} and Ps with new P.
                          //     Without it a fast warp loads K_{j+1} over V_j while a slow
                          //     warp is still multiplying by V_j: a race (racecheck finds it).
    }

    // Epilogue: finish l, normalise O, write O and LSE (natural log) for the real rows.
    // BEGIN EPILOGUE
#pragma unroll
    for (int a = 0; a < TM; ++a) {
        float l_row = l[a];
#pragma unroll
        for (int off = TX / 2; off > 0; off /= 2)  // sum the 16 partial sums of the row
            l_row += __shfl_xor_sync(0xffffffffu, l_row, off);
        const int r = row0 + ty + TY * a;
        if (r < Nq) {
            const float inv_l = l_row > 0.f ? 1.f / l_row : 0.f;  // a row with no key: O = 0
#pragma unroll
            for (int q = 0; q < CPT; ++q) Obh[(size_t)r * D + o_col<D>(tx, q)] = acc_o[a][q] * inv_l;
            if (tx == 0) LSEbh[r] = l_row > 0.f ? (m[a] + log2f(l_row)) * LN2 : neg_inf();
        }
    }
    // END EPILOGUE
}

#ifdef FA_KERNEL_ONLY
// Compile-only reports without torch's headers (nvcc -DFA_KERNEL_ONLY: seconds instead of ~25 s):
// instantiate the kernel for every supported head dim explicitly.
#define FA_INSTANTIATE(D)                                                                         \
    template __global__ void flash_attention_forward_kernel<D>(                                   \
        const float* __restrict__, const float* __restrict__, const float* __restrict__,         \
        float* __restrict__, float* __restrict__, int, int, float, int);
FA_INSTANTIATE(16)
FA_INSTANTIATE(32)
FA_INSTANTIATE(64)
FA_INSTANTIATE(128)
#endif

#if !defined(__CUDACC_RTC__) && !defined(FA_KERNEL_ONLY)
// ----------------------------------------------------------------------------- torch host side

// load_tile reads Q, K, V as float4s, so each base pointer must be 16-byte aligned. A contiguous
// view that starts mid-allocation (x.view(-1)[1:].view(...)) may not be, and a misaligned float4
// load is a sticky CUDA error that ends the process's CUDA context: refuse it here (ValueError).
static void fa07_check_aligned(const char* name, const torch::Tensor& t) {
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
                      "flash_attention_forward: ", name, ".data_ptr() is not 16-byte aligned "
                      "(storage offset ", std::to_string(t.storage_offset()),
                      " floats) and the kernel loads "
                      "float4s: call ", name, ".clone() to get an aligned copy");
}

template <int D>
static void launch_flash_forward(const torch::Tensor& Q, const torch::Tensor& K,
                                 const torch::Tensor& V, torch::Tensor& O, torch::Tensor& LSE,
                                 int Nq, int Nk, int H, int B, float scale, bool causal) {
    const int smem_bytes = fa07::shared_floats(D) * (int)sizeof(float);
    // Above 48 KiB of dynamic shared memory a kernel must opt in, once per kernel. A GPU that
    // gives a block less than the tiles need (a T4: 64 KiB; this kernel at D = 128: 83 KiB)
    // refuses: say so in its numbers rather than as a failed launch.
    static bool opted_in = false;
    if (!opted_in) {
        int device = 0, most = 0;
        cudaGetDevice(&device);
        cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
        TORCH_CHECK(smem_bytes <= most, "flash_attention_forward: at D = ", std::to_string(D),
                    " the tiles need ", std::to_string(smem_bytes), " bytes of shared memory "
                    "per block and this GPU gives a block at most ", std::to_string(most),
                    ": use a smaller head dim here, or a GPU with more shared memory "
                    "(python -m course_utils portability shows which kernels fit where)");
        TORCH_CHECK(cudaFuncSetAttribute(flash_attention_forward_kernel<D>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         smem_bytes) == cudaSuccess,
                    "flash_attention_forward: cannot opt into ", std::to_string(smem_bytes),
                    " bytes of shared memory");
        opted_in = true;
    }
    const dim3 grid((Nq + fa07::Br - 1) / fa07::Br, H, B);  // y, z <= 65535 each (checked)
    flash_attention_forward_kernel<D>
        <<<grid, fa07::THREADS, smem_bytes, c10::cuda::getCurrentCUDAStream()>>>(
            Q.data_ptr<float>(), K.data_ptr<float>(), V.data_ptr<float>(), O.data_ptr<float>(),
            LSE.data_ptr<float>(), Nq, Nk, scale, causal ? 1 : 0);
    const cudaError_t err = cudaGetLastError();
    TORCH_CHECK(err == cudaSuccess, "flash_attention_forward: launch failed: ",
                cudaGetErrorString(err));
}

std::tuple<torch::Tensor, torch::Tensor> flash_attention_forward(torch::Tensor Q, torch::Tensor K,
                                                                 torch::Tensor V, bool causal,
                                                                 double scale) {
    for (const auto* t : {&Q, &K, &V}) {
        TORCH_CHECK(t->is_cuda(), "flash_attention_forward: inputs must be CUDA tensors");
        TORCH_CHECK(t->scalar_type() == torch::kFloat,
                    "flash_attention_forward: inputs must be float32");
        TORCH_CHECK(t->dim() == 4, "flash_attention_forward: inputs must be (B, H, N, d)");
        TORCH_CHECK(t->is_contiguous(), "flash_attention_forward: inputs must be contiguous");
    }
    const int64_t B = Q.size(0), H = Q.size(1), Nq = Q.size(2), d = Q.size(3), Nk = K.size(2);
    TORCH_CHECK(K.size(0) == B && K.size(1) == H && V.size(0) == B && V.size(1) == H,
                "flash_attention_forward: Q, K, V must share (B, H)");
    TORCH_CHECK(K.size(3) == d && V.size(3) == d && V.size(2) == Nk,
                "flash_attention_forward: K and V must be (B, H, Nk, d) with Q's d");
    TORCH_CHECK(Nk >= 1, "flash_attention_forward: need at least one key");
    // Grid (Tr, H, B): CUDA caps grid y and z at 65535 (a larger launch fails with "invalid
    // argument"); B * H may be anything up to 65535 * 65535.
    TORCH_CHECK_VALUE(H <= 65535 && B <= 65535, "flash_attention_forward: B=", std::to_string(B),
                      ", H=", std::to_string(H),
                      ": the grid is (Tr, H, B) and CUDA allows at most 65535 blocks in y and z; "
                      "split the batch into chunks of at most 65535");
    fa07_check_aligned("Q", Q);
    fa07_check_aligned("K", K);
    fa07_check_aligned("V", V);
    auto O = torch::empty_like(Q);
    auto LSE = torch::empty({B, H, Nq}, Q.options());
    if (Nq == 0 || B * H == 0) return {O, LSE};
    const int Bi = (int)B, Hi = (int)H;
    const float s = (float)scale;
    switch (d) {
        case 16: launch_flash_forward<16>(Q, K, V, O, LSE, Nq, Nk, Hi, Bi, s, causal); break;
        case 32: launch_flash_forward<32>(Q, K, V, O, LSE, Nq, Nk, Hi, Bi, s, causal); break;
        case 64: launch_flash_forward<64>(Q, K, V, O, LSE, Nq, Nk, Hi, Bi, s, causal); break;
        case 128: launch_flash_forward<128>(Q, K, V, O, LSE, Nq, Nk, Hi, Bi, s, causal); break;
        default: TORCH_CHECK(false, "flash_attention_forward: d must be 16, 32, 64 or 128, got ",
                             std::to_string(d));
    }
    return {O, LSE};
}
#endif
