// FlashAttention-2 backward pass, float32, for chapter 08 of the course.
//
// Built with course_utils.load_cuda(path, ["flash_attention_backward"]) (the torch host function
// at the bottom); nvcc -DFA_KERNEL_ONLY (or NVRTC, which defines __CUDACC_RTC__) compiles only
// the kernels, which is how the notebook reads ptxas's register report without a GPU.
//
// Shapes (row-major, contiguous, float32): Q, O, dO, dQ (B, H, Nq, D); K, V, dK, dV (B, H, Nk, D);
// LSE and Dv (B, H, Nq). Three kernels:
//
//   1. preprocess: Dv[r] = sum_k dO[r, k] * O[r, k], one warp per query row.
//   2. dkdv (grid (Tc, H, B)): block j owns key tile K_j, V_j and accumulates dK_j, dV_j in
//      registers while it streams the query tiles Q_i, dO_i, LSE_i, Dv_i through shared memory.
//      Per (i, j): S^T = K_j Q_i^T and dP^T = V_j dO_i^T (one k loop), P = exp(S - LSE),
//      dS = P * (dP - Dv), then dV_j += P^T dO_i, dK_j += dS^T Q_i. With ATOMIC_DQ it also adds
//      dQ_i += dS K_j into global memory with atomicAdd (non-deterministic summation order).
//   3. dq (grid (Tr, H, B)), the deterministic alternative: block i owns Q_i, dO_i and dQ_i,
//      streams K_j, V_j, recomputes S, P, dP, dS (two more matrix products than the atomic
//      version) and accumulates dQ_i in registers.
//
// Block: 256 threads as a TY x TX = 16 x 16 grid, Br = Bc = 64. In the dkdv kernel thread
// (ty, tx) owns key rows c = ty + 16a (a < 4) of S^T and of dK_j, dV_j, and query columns
// r = tx + 16b (b < 4) of S^T; its dK_j, dV_j columns are o_col(tx, q), q < CPT = D / 16.
// Shared rows are padded by 4 floats, as in chapter 07.
//
// Grids (T, H, B): block (x, y, z) works on (batch, head) bh = z * gridDim.y + y = b * H + h.
// Not (T, B * H): grid y and z stop at 65535, and B * H passes that in decode batches. (A grid
// (T, B * H) of a smaller problem still works: gridDim.z = 1.)

#if !defined(__CUDACC_RTC__) && !defined(FA_KERNEL_ONLY)
// From torch, what this file uses: the Tensor class and one header per operator it calls, under
// the torch:: names of <torch/types.h>. That header has every operator: a compile-only build (no
// GPU) takes about 30 % longer with it. On a GPU, load_inline puts it before this file anyway.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
namespace torch { using namespace at; }  // torch::Tensor, torch::empty, torch::kFloat, ...
#include <c10/cuda/CUDAStream.h>
#include <cstdint>
// Numbers in TORCH_CHECK messages go through std::to_string: on the H100 machine the course is
// validated on (torch 2.11.0+cu130, g++ 13), a message that streams a raw int or float into
// TORCH_CHECK crashes the process (segfault) instead of raising, in any load_inline extension.
#include <string>
#include <tuple>
#endif

namespace fa08 {

constexpr int Br = 64;       // query rows per query tile
constexpr int Bc = 64;       // key rows per K/V tile
constexpr int TX = 16;
constexpr int TY = 16;
constexpr int TM = 4;        // rows of the micro-tile (keys in dkdv, queries in dq)
constexpr int TN = 4;        // columns of the micro-tile (queries in dkdv, keys in dq)
constexpr int THREADS = TX * TY;  // 256
constexpr int PAD = 4;
constexpr float LOG2E = 1.4426950408889634f;

// dkdv: Ks, Vs [Bc][D+4]; Qs, dOs [Br][D+4]; Ps, dSs [Bc][Br+4]; Ls, Ds [Br]
__host__ __device__ constexpr int dkdv_shared_floats(int D) {
    return 2 * Bc * (D + PAD) + 2 * Br * (D + PAD) + 2 * Bc * (Br + PAD) + 2 * Br;
}
// dq: Qs, dOs [Br][D+4]; Ks, Vs [Bc][D+4]; dSs [Br][Bc+4]; Ls, Ds [Br]
__host__ __device__ constexpr int dq_shared_floats(int D) {
    return 2 * Br * (D + PAD) + 2 * Bc * (D + PAD) + Br * (Bc + PAD) + 2 * Br;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

// rows [row0, row0 + ROWS) of a (n_rows, D) matrix -> tile[ROWS][D + PAD]; 0 past n_rows.
template <int D, int ROWS>
__device__ __forceinline__ void load_tile(float* tile, const float* __restrict__ src, int row0,
                                          int n_rows) {
    constexpr int VECS_PER_ROW = D / 4;
    for (int f = threadIdx.x; f < ROWS * VECS_PER_ROW; f += THREADS) {
        const int row = f / VECS_PER_ROW;
        const int k = (f % VECS_PER_ROW) * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (row0 + row < n_rows) v = *reinterpret_cast<const float4*>(src + (size_t)(row0 + row) * D + k);
        *reinterpret_cast<float4*>(tile + row * (D + PAD) + k) = v;
    }
}

// LSE (in log2 units, +inf for a row with no key or past Nq: then P = exp2(x - inf) = 0) and
// Dv of query rows [row0, row0 + Br).
__device__ __forceinline__ void load_rows(float* Ls, float* Ds, const float* __restrict__ LSE,
                                          const float* __restrict__ Dv, int row0, int Nq) {
    for (int t = threadIdx.x; t < Br; t += THREADS) {
        const int r = row0 + t;
        const float lse = r < Nq ? LSE[r] : neg_inf();
        Ls[t] = lse == neg_inf() ? pos_inf() : lse * LOG2E;
        Ds[t] = r < Nq ? Dv[r] : 0.f;
    }
}

// Column q (< D / 16) of a thread's output micro-tile: groups of min(CPT, 4) adjacent columns
// (one float4 per group), 16 threads of a row covering 16 * G adjacent columns (chapter 07).
template <int D>
__device__ __forceinline__ int o_col(int tx, int q) {
    constexpr int CPT = D / TX;
    constexpr int G = CPT < 4 ? CPT : 4;
    return (q / G) * (TX * G) + tx * G + q % G;
}

// acc_s[a][b] = sum_k A[ra(a)][k] B[rb(b)][k] and acc_d likewise for C, E, with
// ra(a) = ty + TY * a and rb(b) = tx + TX * b: two register-tiled products in one k loop.
template <int D>
__device__ __forceinline__ void two_products(const float* A, const float* Bm, const float* Cm,
                                             const float* E, int ty, int tx, float (&acc_s)[TM][TN],
                                             float (&acc_d)[TM][TN]) {
    constexpr int LD = D + PAD;
#pragma unroll
    for (int a = 0; a < TM; ++a)
#pragma unroll
        for (int b = 0; b < TN; ++b) acc_s[a][b] = acc_d[a][b] = 0.f;
#pragma unroll 2
    for (int k = 0; k < D; k += 4) {
        float4 av[TM], bv[TN];
#pragma unroll
        for (int a = 0; a < TM; ++a) av[a] = *reinterpret_cast<const float4*>(A + (ty + TY * a) * LD + k);
#pragma unroll
        for (int b = 0; b < TN; ++b) bv[b] = *reinterpret_cast<const float4*>(Bm + (tx + TX * b) * LD + k);
#pragma unroll
        for (int a = 0; a < TM; ++a)
#pragma unroll
            for (int b = 0; b < TN; ++b)
                acc_s[a][b] += av[a].x * bv[b].x + av[a].y * bv[b].y + av[a].z * bv[b].z + av[a].w * bv[b].w;
#pragma unroll
        for (int a = 0; a < TM; ++a) av[a] = *reinterpret_cast<const float4*>(Cm + (ty + TY * a) * LD + k);
#pragma unroll
        for (int b = 0; b < TN; ++b) bv[b] = *reinterpret_cast<const float4*>(E + (tx + TX * b) * LD + k);
#pragma unroll
        for (int a = 0; a < TM; ++a)
#pragma unroll
            for (int b = 0; b < TN; ++b)
                acc_d[a][b] += av[a].x * bv[b].x + av[a].y * bv[b].y + av[a].z * bv[b].z + av[a].w * bv[b].w;
    }
}

}  // namespace fa08

// ----------------------------------------------------------------------------- 1. preprocess

__global__ void __launch_bounds__(256)
flash_attention_backward_preprocess_kernel(const float* __restrict__ O, const float* __restrict__ dO,
                                           float* __restrict__ Dv, int rows, int D) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;  // one warp per row
    const int lane = threadIdx.x % 32;
    if (warp >= rows) return;  // the whole warp leaves together: the shuffles stay full-warp
    float acc = 0.f;
    for (int k = lane; k < D; k += 32) acc += dO[(size_t)warp * D + k] * O[(size_t)warp * D + k];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) Dv[warp] = acc;
}

// ----------------------------------------------------------------------------- 2. dK, dV (+ dQ)

template <int D, bool ATOMIC_DQ>
__global__ void __launch_bounds__(fa08::THREADS, 1)
flash_attention_backward_dkdv_kernel(const float* __restrict__ Q, const float* __restrict__ K,
                                     const float* __restrict__ V, const float* __restrict__ dO,
                                     const float* __restrict__ LSE, const float* __restrict__ Dv,
                                     float* __restrict__ dK, float* __restrict__ dV,
                                     float* __restrict__ dQ, int Nq, int Nk, float scale,
                                     int causal) {
    using namespace fa08;
    static_assert(D % 16 == 0 && D >= 16 && D <= 128, "D must be 16, 32, 64 or 128");
    constexpr int CPT = D / TX;
    constexpr int LD = D + PAD, LDP = Br + PAD;

    extern __shared__ __align__(16) float smem[];
    float* Ks = smem;               // [Bc][LD]
    float* Vs = Ks + Bc * LD;       // [Bc][LD]
    float* Qs = Vs + Bc * LD;       // [Br][LD]
    float* dOs = Qs + Br * LD;      // [Br][LD]
    float* Ps = dOs + Br * LD;      // [Bc][LDP]: P^T of the current (i, j) pair
    float* dSs = Ps + Bc * LDP;     // [Bc][LDP]: dS^T
    float* Ls = dSs + Bc * LDP;     // [Br]
    float* Ds = Ls + Br;            // [Br]

    const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
    const int j = blockIdx.x;
    const unsigned bh = blockIdx.z * gridDim.y + blockIdx.y;  // batch * H + head (< 2^32)
    const int col0 = j * Bc;
    const float* Qbh = Q + (size_t)bh * Nq * D;
    const float* dObh = dO + (size_t)bh * Nq * D;
    const float* LSEbh = LSE + (size_t)bh * Nq;
    const float* Dvbh = Dv + (size_t)bh * Nq;
    float* dQbh = dQ + (size_t)bh * Nq * D;

    float acc_dk[TM][CPT], acc_dv[TM][CPT];  // dK_j, dV_j rows ty + 16a: registers all along
#pragma unroll
    for (int a = 0; a < TM; ++a)
#pragma unroll
        for (int q = 0; q < CPT; ++q) acc_dk[a][q] = acc_dv[a][q] = 0.f;

    load_tile<D, Bc>(Ks, K + (size_t)bh * Nk * D, col0, Nk);
    load_tile<D, Bc>(Vs, V + (size_t)bh * Nk * D, col0, Nk);

    // Causal (top-left): row r sees key c iff c <= r. The first row that sees a key of this
    // tile is row col0, so query tiles before col0 / Br are skipped; none if col0 >= Nq.
    const int Tr = (Nq + Br - 1) / Br;
    const int start = causal ? (col0 < Nq ? col0 / Br : Tr) : 0;
    const float sl2 = scale * LOG2E;

    for (int i = start; i < Tr; ++i) {
        const int row0 = i * Br;
        load_tile<D, Br>(Qs, Qbh, row0, Nq);
        load_tile<D, Br>(dOs, dObh, row0, Nq);
        load_rows(Ls, Ds, LSEbh, Dvbh, row0, Nq);
        __syncthreads();  // (1) RAW: Q_i, dO_i, LSE_i, D_i (and K_j, V_j on the first pass)
                          //     written by all threads, visible before anyone reads them.

        float st[TM][TN], dpt[TM][TN];  // S^T = K_j Q_i^T and dP^T = V_j dO_i^T, unscaled
        two_products<D>(Ks, Qs, Vs, dOs, ty, tx, st, dpt);

        const bool needs_mask = (row0 + Br > Nq) || (col0 + Bc > Nk) || (causal && col0 + Bc - 1 > row0);
#pragma unroll
        for (int a = 0; a < TM; ++a)
#pragma unroll
            for (int b = 0; b < TN; ++b) {
                const int cl = ty + TY * a, rl = tx + TX * b;  // key, query inside the tiles
                float p = exp2f(st[a][b] * sl2 - Ls[rl]);     // P = exp(S - LSE), recomputed
                if (needs_mask) {
                    const int c = col0 + cl, r = row0 + rl;
                    if (c >= Nk || r >= Nq || (causal && c > r)) p = 0.f;
                }
                Ps[cl * LDP + rl] = p;
                dSs[cl * LDP + rl] = p * (dpt[a][b] - Ds[rl]);  // dS = P * (dP - D)
            }
        __syncthreads();  // (2) RAW: the whole P^T and dS^T tiles are written before any
                          //     thread reads other threads' columns of them below.

        // dV_j += P^T dO_i and dK_j += dS^T Q_i: rows ty + 16a, columns o_col(tx, q).
#pragma unroll 2
        for (int r = 0; r < Br; r += 4) {
            float4 pv[TM], dv4[TM];
#pragma unroll
            for (int a = 0; a < TM; ++a) {
                pv[a] = *reinterpret_cast<const float4*>(Ps + (ty + TY * a) * LDP + r);
                dv4[a] = *reinterpret_cast<const float4*>(dSs + (ty + TY * a) * LDP + r);
            }
#pragma unroll
            for (int rr = 0; rr < 4; ++rr) {
                float dov[CPT], qv[CPT];
#pragma unroll
                for (int q = 0; q < CPT; ++q) {
                    dov[q] = dOs[(r + rr) * LD + o_col<D>(tx, q)];
                    qv[q] = Qs[(r + rr) * LD + o_col<D>(tx, q)];
                }
#pragma unroll
                for (int a = 0; a < TM; ++a) {
                    const float p = rr == 0 ? pv[a].x : rr == 1 ? pv[a].y : rr == 2 ? pv[a].z : pv[a].w;
                    const float ds = rr == 0 ? dv4[a].x : rr == 1 ? dv4[a].y : rr == 2 ? dv4[a].z : dv4[a].w;
#pragma unroll
                    for (int q = 0; q < CPT; ++q) {
                        acc_dv[a][q] += p * dov[q];
                        acc_dk[a][q] += ds * qv[q];
                    }
                }
            }
        }

        if constexpr (ATOMIC_DQ) {
            // dQ_i += scale * dS K_j: query rows ty + 16a, columns o_col(tx, q); every key
            // tile adds into the same rows, so the adds go to global memory atomically.
            float acc_dq[TM][CPT];
#pragma unroll
            for (int a = 0; a < TM; ++a)
#pragma unroll
                for (int q = 0; q < CPT; ++q) acc_dq[a][q] = 0.f;
#pragma unroll 4
            for (int c = 0; c < Bc; ++c) {
                float kv[CPT];
#pragma unroll
                for (int q = 0; q < CPT; ++q) kv[q] = Ks[c * LD + o_col<D>(tx, q)];
#pragma unroll
                for (int a = 0; a < TM; ++a) {
                    const float ds = dSs[c * LDP + ty + TY * a];
#pragma unroll
                    for (int q = 0; q < CPT; ++q) acc_dq[a][q] += ds * kv[q];
                }
            }
#pragma unroll
            for (int a = 0; a < TM; ++a) {
                const int r = row0 + ty + TY * a;
                if (r < Nq) {
#pragma unroll
                    for (int q = 0; q < CPT; ++q)
                        atomicAdd(dQbh + (size_t)r * D + o_col<D>(tx, q), scale * acc_dq[a][q]);
                }
            }
        }
        __syncthreads();  // (3) WAR: every thread has finished reading Q_i, dO_i, P^T, dS^T,
                          //     LSE_i, D_i before the next pass overwrites them.
    }

    float* dKbh = dK + (size_t)bh * Nk * D;
    float* dVbh = dV + (size_t)bh * Nk * D;
#pragma unroll
    for (int a = 0; a < TM; ++a) {
        const int c = col0 + ty + TY * a;
        if (c < Nk) {
#pragma unroll
            for (int q = 0; q < CPT; ++q) {
                dKbh[(size_t)c * D + o_col<D>(tx, q)] = scale * acc_dk[a][q];
                dVbh[(size_t)c * D + o_col<D>(tx, q)] = acc_dv[a][q];
            }
        }
    }
}

// ----------------------------------------------------------------------------- 3. dQ

template <int D>
__global__ void __launch_bounds__(fa08::THREADS, 1)
flash_attention_backward_dq_kernel(const float* __restrict__ Q, const float* __restrict__ K,
                                   const float* __restrict__ V, const float* __restrict__ dO,
                                   const float* __restrict__ LSE, const float* __restrict__ Dv,
                                   float* __restrict__ dQ, int Nq, int Nk, float scale,
                                   int causal) {
    using namespace fa08;
    constexpr int CPT = D / TX;
    constexpr int LD = D + PAD, LDS = Bc + PAD;

    extern __shared__ __align__(16) float smem[];
    float* Qs = smem;               // [Br][LD]
    float* dOs = Qs + Br * LD;      // [Br][LD]
    float* Ks = dOs + Br * LD;      // [Bc][LD]
    float* Vs = Ks + Bc * LD;       // [Bc][LD]
    float* dSs = Vs + Bc * LD;      // [Br][LDS]
    float* Ls = dSs + Br * LDS;     // [Br]
    float* Ds = Ls + Br;            // [Br]

    const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
    const int i = blockIdx.x;
    const unsigned bh = blockIdx.z * gridDim.y + blockIdx.y;  // batch * H + head (< 2^32)
    const int row0 = i * Br;
    const float* Kbh = K + (size_t)bh * Nk * D;
    const float* Vbh = V + (size_t)bh * Nk * D;

    float acc_dq[TM][CPT];
#pragma unroll
    for (int a = 0; a < TM; ++a)
#pragma unroll
        for (int q = 0; q < CPT; ++q) acc_dq[a][q] = 0.f;

    load_tile<D, Br>(Qs, Q + (size_t)bh * Nq * D, row0, Nq);
    load_tile<D, Br>(dOs, dO + (size_t)bh * Nq * D, row0, Nq);
    load_rows(Ls, Ds, LSE + (size_t)bh * Nq, Dv + (size_t)bh * Nq, row0, Nq);

    const int Tc = (Nk + Bc - 1) / Bc;
    const int last_row = min(row0 + Br, Nq);  // chapter 07's causal tile count
    const int n_tiles = causal ? min(Tc, (min(Nk, last_row) + Bc - 1) / Bc) : Tc;
    const float sl2 = scale * LOG2E;

    for (int j = 0; j < n_tiles; ++j) {
        const int col0 = j * Bc;
        load_tile<D, Bc>(Ks, Kbh, col0, Nk);
        load_tile<D, Bc>(Vs, Vbh, col0, Nk);
        __syncthreads();  // (1) RAW: K_j, V_j (and Q_i, dO_i, LSE_i, D_i) are visible.

        float s[TM][TN], dp[TM][TN];  // S = Q_i K_j^T and dP = dO_i V_j^T: rows ty + 16a
        two_products<D>(Qs, Ks, dOs, Vs, ty, tx, s, dp);

        const bool needs_mask = (row0 + Br > Nq) || (col0 + Bc > Nk) || (causal && col0 + Bc - 1 > row0);
#pragma unroll
        for (int a = 0; a < TM; ++a)
#pragma unroll
            for (int b = 0; b < TN; ++b) {
                const int rl = ty + TY * a, cl = tx + TX * b;
                float p = exp2f(s[a][b] * sl2 - Ls[rl]);
                if (needs_mask) {
                    const int r = row0 + rl, c = col0 + cl;
                    if (c >= Nk || r >= Nq || (causal && c > r)) p = 0.f;
                }
                dSs[rl * LDS + cl] = p * (dp[a][b] - Ds[rl]);
            }
        __syncthreads();  // (2) RAW: the whole dS tile is written before it is read by rows.

        // dQ_i += dS K_j: rows ty + 16a, columns o_col(tx, q); dS read 4 keys at a time.
#pragma unroll 2
        for (int c = 0; c < Bc; c += 4) {
            float4 dsv[TM];
#pragma unroll
            for (int a = 0; a < TM; ++a) dsv[a] = *reinterpret_cast<const float4*>(dSs + (ty + TY * a) * LDS + c);
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) {
                float kv[CPT];
#pragma unroll
                for (int q = 0; q < CPT; ++q) kv[q] = Ks[(c + cc) * LD + o_col<D>(tx, q)];
#pragma unroll
                for (int a = 0; a < TM; ++a) {
                    const float ds = cc == 0 ? dsv[a].x : cc == 1 ? dsv[a].y : cc == 2 ? dsv[a].z : dsv[a].w;
#pragma unroll
                    for (int q = 0; q < CPT; ++q) acc_dq[a][q] += ds * kv[q];
                }
            }
        }
        __syncthreads();  // (3) WAR: every thread has finished reading K_j, V_j and dS before
                          //     the next pass overwrites Ks, Vs and dSs.
    }

    float* dQbh = dQ + (size_t)bh * Nq * D;
#pragma unroll
    for (int a = 0; a < TM; ++a) {
        const int r = row0 + ty + TY * a;
        if (r < Nq) {
#pragma unroll
            for (int q = 0; q < CPT; ++q) dQbh[(size_t)r * D + o_col<D>(tx, q)] = scale * acc_dq[a][q];
        }
    }
}

#ifdef FA_KERNEL_ONLY
#define FA_INSTANTIATE(D)                                                                          \
    template __global__ void flash_attention_backward_dkdv_kernel<D, false>(                       \
        const float* __restrict__, const float* __restrict__, const float* __restrict__,          \
        const float* __restrict__, const float* __restrict__, const float* __restrict__,          \
        float* __restrict__, float* __restrict__, float* __restrict__, int, int, float, int);     \
    template __global__ void flash_attention_backward_dkdv_kernel<D, true>(                        \
        const float* __restrict__, const float* __restrict__, const float* __restrict__,          \
        const float* __restrict__, const float* __restrict__, const float* __restrict__,          \
        float* __restrict__, float* __restrict__, float* __restrict__, int, int, float, int);     \
    template __global__ void flash_attention_backward_dq_kernel<D>(                                \
        const float* __restrict__, const float* __restrict__, const float* __restrict__,          \
        const float* __restrict__, const float* __restrict__, const float* __restrict__,          \
        float* __restrict__, int, int, float, int);
FA_INSTANTIATE(16)
FA_INSTANTIATE(32)
FA_INSTANTIATE(64)
FA_INSTANTIATE(128)
#endif

#if !defined(__CUDACC_RTC__) && !defined(FA_KERNEL_ONLY)
// ----------------------------------------------------------------------------- torch host side

template <typename Kernel>
static void opt_in(Kernel kernel, int smem_bytes, bool& done) {
    // Above 48 KiB of dynamic shared memory a kernel must opt in, once per kernel.
    if (done) return;
    int device = 0, most = 0;  // a T4 gives a block 64 KiB, an RTX 30/40 99 KiB, an A100 163
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    TORCH_CHECK(smem_bytes <= most, "flash_attention_backward: this head dim's tiles need ",
                std::to_string(smem_bytes), " bytes of shared memory per block and this GPU "
                "gives a block at most ", std::to_string(most), ": use a smaller head dim "
                "here, or a GPU with more shared memory (python -m course_utils portability "
                "shows which kernels fit where)");
    TORCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     smem_bytes) == cudaSuccess,
                "flash_attention_backward: cannot opt into ", std::to_string(smem_bytes),
                " bytes of shared memory");
    done = true;
}

// load_tile reads Q, K, V and dO as float4s, so each base pointer must be 16-byte aligned. A
// contiguous view that starts mid-allocation (x.view(-1)[1:].view(...)) may not be, and a
// misaligned float4 load is a sticky CUDA error that ends the process's CUDA context: refuse it
// here (ValueError). O and LSE are read as plain floats.
static void fa08_check_aligned(const char* name, const torch::Tensor& t) {
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
                      "flash_attention_backward: ", name, ".data_ptr() is not 16-byte aligned "
                      "(storage offset ", std::to_string(t.storage_offset()),
                      " floats) and the kernel loads "
                      "float4s: call ", name, ".clone() to get an aligned copy");
}

static void check_launch(const char* what) {
    const cudaError_t err = cudaGetLastError();
    TORCH_CHECK(err == cudaSuccess, "flash_attention_backward: ", what, " launch failed: ",
                cudaGetErrorString(err));
}

template <int D, bool ATOMIC_DQ>
static void launch_dkdv(const float* Q, const float* K, const float* V, const float* dO,
                        const float* LSE, const float* Dv, float* dK, float* dV, float* dQ,
                        int Nq, int Nk, int H, int B, float scale, bool causal, cudaStream_t stream) {
    const int smem = fa08::dkdv_shared_floats(D) * (int)sizeof(float);
    static bool done = false;
    opt_in(flash_attention_backward_dkdv_kernel<D, ATOMIC_DQ>, smem, done);
    const dim3 grid((Nk + fa08::Bc - 1) / fa08::Bc, H, B);  // y, z <= 65535 (checked)
    flash_attention_backward_dkdv_kernel<D, ATOMIC_DQ><<<grid, fa08::THREADS, smem, stream>>>(
        Q, K, V, dO, LSE, Dv, dK, dV, dQ, Nq, Nk, scale, causal ? 1 : 0);
    check_launch("dkdv");
}

template <int D>
static void launch_dq(const float* Q, const float* K, const float* V, const float* dO,
                      const float* LSE, const float* Dv, float* dQ, int Nq, int Nk, int H,
                      int B, float scale, bool causal, cudaStream_t stream) {
    const int smem = fa08::dq_shared_floats(D) * (int)sizeof(float);
    static bool done = false;
    opt_in(flash_attention_backward_dq_kernel<D>, smem, done);
    const dim3 grid((Nq + fa08::Br - 1) / fa08::Br, H, B);  // y, z <= 65535 (checked)
    flash_attention_backward_dq_kernel<D><<<grid, fa08::THREADS, smem, stream>>>(
        Q, K, V, dO, LSE, Dv, dQ, Nq, Nk, scale, causal ? 1 : 0);
    check_launch("dq");
}

template <int D>
static void launch_all(const torch::Tensor& Q, const torch::Tensor& K, const torch::Tensor& V,
                       const torch::Tensor& dO, const torch::Tensor& LSE, const torch::Tensor& Dv,
                       torch::Tensor& dQ, torch::Tensor& dK, torch::Tensor& dV, int Nq, int Nk,
                       int H, int B, float scale, bool causal, bool deterministic, cudaStream_t stream) {
    const float *q = Q.data_ptr<float>(), *k = K.data_ptr<float>(), *v = V.data_ptr<float>();
    const float *dout = dO.data_ptr<float>(), *lse = LSE.data_ptr<float>(), *dv = Dv.data_ptr<float>();
    if (deterministic) {
        launch_dkdv<D, false>(q, k, v, dout, lse, dv, dK.data_ptr<float>(), dV.data_ptr<float>(),
                              dQ.data_ptr<float>(), Nq, Nk, H, B, scale, causal, stream);
        launch_dq<D>(q, k, v, dout, lse, dv, dQ.data_ptr<float>(), Nq, Nk, H, B, scale, causal, stream);
    } else {
        launch_dkdv<D, true>(q, k, v, dout, lse, dv, dK.data_ptr<float>(), dV.data_ptr<float>(),
                             dQ.data_ptr<float>(), Nq, Nk, H, B, scale, causal, stream);
    }
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> flash_attention_backward(
    torch::Tensor Q, torch::Tensor K, torch::Tensor V, torch::Tensor O, torch::Tensor LSE,
    torch::Tensor dO, bool causal, double scale, bool deterministic) {
    for (const auto* t : {&Q, &K, &V, &O, &LSE, &dO}) {
        TORCH_CHECK(t->is_cuda(), "flash_attention_backward: inputs must be CUDA tensors");
        TORCH_CHECK(t->scalar_type() == torch::kFloat,
                    "flash_attention_backward: inputs must be float32");
        TORCH_CHECK(t->is_contiguous(), "flash_attention_backward: inputs must be contiguous");
    }
    TORCH_CHECK(Q.dim() == 4 && K.dim() == 4 && V.dim() == 4 && LSE.dim() == 3,
                "flash_attention_backward: Q, K, V must be (B, H, N, d), LSE (B, H, Nq)");
    const int64_t B = Q.size(0), H = Q.size(1), Nq = Q.size(2), d = Q.size(3), Nk = K.size(2);
    TORCH_CHECK(K.sizes() == V.sizes() && K.size(0) == B && K.size(1) == H && K.size(3) == d,
                "flash_attention_backward: K and V must be (B, H, Nk, d) with Q's B, H, d");
    TORCH_CHECK(O.sizes() == Q.sizes() && dO.sizes() == Q.sizes(),
                "flash_attention_backward: O and dO must have Q's shape");
    TORCH_CHECK(LSE.size(0) == B && LSE.size(1) == H && LSE.size(2) == Nq,
                "flash_attention_backward: LSE must be (B, H, Nq)");
    TORCH_CHECK(Nk >= 1 && Nq >= 1, "flash_attention_backward: need Nq, Nk >= 1");
    // Grids (T, H, B): CUDA caps grid y and z at 65535 ("invalid argument" beyond).
    TORCH_CHECK_VALUE(H <= 65535 && B <= 65535, "flash_attention_backward: B=", std::to_string(B),
                      ", H=", std::to_string(H),
                      ": the grids are (T, H, B) and CUDA allows at most 65535 blocks in y and z; "
                      "split the batch into chunks of at most 65535");
    fa08_check_aligned("Q", Q);
    fa08_check_aligned("K", K);
    fa08_check_aligned("V", V);
    fa08_check_aligned("dO", dO);
    auto dQ = deterministic ? torch::empty_like(Q) : torch::zeros_like(Q);  // atomics add into 0
    auto dK = torch::empty_like(K);
    auto dV = torch::empty_like(V);
    auto Dv = torch::empty({B, H, Nq}, Q.options());
    const int Bi = (int)B, Hi = (int)H;
    const float s = (float)scale;
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

    const int rows = (int)(B * H * Nq);
    flash_attention_backward_preprocess_kernel<<<(rows + 7) / 8, 256, 0, stream>>>(
        O.data_ptr<float>(), dO.data_ptr<float>(), Dv.data_ptr<float>(), rows, (int)d);
    check_launch("preprocess");
    switch (d) {
        case 16: launch_all<16>(Q, K, V, dO, LSE, Dv, dQ, dK, dV, Nq, Nk, Hi, Bi, s, causal, deterministic, stream); break;
        case 32: launch_all<32>(Q, K, V, dO, LSE, Dv, dQ, dK, dV, Nq, Nk, Hi, Bi, s, causal, deterministic, stream); break;
        case 64: launch_all<64>(Q, K, V, dO, LSE, Dv, dQ, dK, dV, Nq, Nk, Hi, Bi, s, causal, deterministic, stream); break;
        case 128: launch_all<128>(Q, K, V, dO, LSE, Dv, dQ, dK, dV, Nq, Nk, Hi, Bi, s, causal, deterministic, stream); break;
        default: TORCH_CHECK(false, "flash_attention_backward: d must be 16, 32, 64 or 128, got ",
                             std::to_string(d));
    }
    return {dQ, dK, dV};
}
#endif
