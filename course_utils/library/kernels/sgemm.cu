// Chapter 04's ladder of float32 matmuls, C = A @ B, on CUDA cores (FFMA), one step per kernel.
//
// Every kernel takes row-major, contiguous A (M x K), B (K x N), C (M x N), float32, any sizes
// (loads outside the matrices read 0, stores outside C are skipped). The host function
// `sgemm(A, B, step)` launches step 0..6; `sgemm_blocks_per_sm(step)` asks the CUDA occupancy
// API how many blocks of that step fit on one SM. Each step changes one thing:
//
//   0 naive          one thread per element of C, every operand read from global memory
//   1 smem           32 x 32 tiles of A and B staged in shared memory, one C element per thread
//   2 reg1d          a column of TM = 8 C elements per thread: one shared B value feeds 8 FMAs
//   3 reg2d          an 8 x 8 micro-tile per thread, 128 x 128 block tile: 16 loads feed 64 FMAs
//   4 vec4           float4 global loads, A stored transposed, float4 shared reads; but the
//                    transposed stores and the thread's 8 contiguous columns collide in banks
//   5 conflict_free  A's rows padded by 4 floats, micro-tiles split into two 4-wide strips 64
//                    apart: no bank conflicts
//   6 prefetch       the global loads of tile t+1 are issued before the products of tile t and
//                    wait in registers; two shared buffers, one barrier per k step
//   7 pipeline       cp.async copies global -> shared in the background, 3 buffers in flight,
//                    BK = 16; A stays row-major (cp.async cannot transpose), read 4 k at a time
//
// The host part is skipped under NVRTC (__CUDACC_RTC__), so course_utils.resource_usage can
// read ptxas's report without nvcc; and under nvcc -DFA_KERNEL_ONLY, which compiles the kernels
// without torch's headers (seconds instead of ~25 s: the compile matrix, course_utils.toolbox.portability).
// Numbers in TORCH_CHECK messages go through std::to_string (a raw number crashed load_inline
// extensions on the machine the course is validated on).

#if !defined(__CUDACC_RTC__) && !defined(FA_KERNEL_ONLY)
// From torch, what this file uses: the Tensor class and one header per operator it calls, under
// the torch:: names of <torch/types.h>. That header has every operator: a compile-only build (no
// GPU) takes about 30 % longer with it. On a GPU, load_inline puts it before this file anyway.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
namespace torch { using namespace at; }  // torch::Tensor, torch::empty, torch::kFloat, ...
#include <c10/cuda/CUDAStream.h>
#include <string>
#endif

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15) == 0;
}

// A[r, c] of a rows x cols row-major matrix, or 0 outside it.
__device__ __forceinline__ float elem(const float* X, int rows, int cols, int r, int c) {
    return (r < rows && c < cols) ? X[(size_t)r * cols + c] : 0.0f;
}

// X[r, c .. c+3] as a float4: one 16-byte load when it is inside and aligned, else 4 guarded.
__device__ __forceinline__ float4 load4(const float* X, int rows, int cols, int r, int c,
                                        bool vec) {
    if (vec && r < rows && c + 3 < cols) {
        return *reinterpret_cast<const float4*>(X + (size_t)r * cols + c);
    }
    return make_float4(elem(X, rows, cols, r, c), elem(X, rows, cols, r, c + 1),
                       elem(X, rows, cols, r, c + 2), elem(X, rows, cols, r, c + 3));
}

// C[r, c .. c+3] = v, skipping what lies outside C.
__device__ __forceinline__ void store4(float* C, int M, int N, int r, int c, float4 v, bool vec) {
    if (r >= M) return;
    float* p = C + (size_t)r * N + c;
    if (vec && c + 3 < N) {
        *reinterpret_cast<float4*>(p) = v;
        return;
    }
    if (c + 0 < N) p[0] = v.x;
    if (c + 1 < N) p[1] = v.y;
    if (c + 2 < N) p[2] = v.z;
    if (c + 3 < N) p[3] = v.w;
}

// ------------------------------------------------------------------ step 0: naive
__global__ void sgemm_naive(const float* __restrict__ A, const float* __restrict__ B,
                            float* __restrict__ C, int M, int N, int K) {
    const int row = blockIdx.y * blockDim.y + threadIdx.y;  // y -> rows of C
    const int col = blockIdx.x * blockDim.x + threadIdx.x;  // x -> columns: a warp reads a row of B
    if (row >= M || col >= N) return;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc += A[(size_t)row * K + k] * B[(size_t)k * N + col];
    C[(size_t)row * N + col] = acc;
}

// ------------------------------------------------------------------ step 1: shared tiles
constexpr int TILE = 32;

__global__ void sgemm_smem(const float* __restrict__ A, const float* __restrict__ B,
                           float* __restrict__ C, int M, int N, int K) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE + 1];  // +1: the column reads Bs[kk][tx] stay conflict-free
    const int ty = threadIdx.y, tx = threadIdx.x;
    const int row = blockIdx.y * TILE + ty, col = blockIdx.x * TILE + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        As[ty][tx] = elem(A, M, K, row, k0 + tx);
        Bs[ty][tx] = elem(B, K, N, k0 + ty, col);
        __syncthreads();  // RAW: the loop reads elements other threads loaded
        #pragma unroll
        for (int kk = 0; kk < TILE; ++kk) acc += As[ty][kk] * Bs[kk][tx];
        __syncthreads();  // WAR: the next step overwrites the tiles
    }
    if (row < M && col < N) C[(size_t)row * N + col] = acc;
}

// ------------------------------------------------------------------ step 2: 1D register tiling
namespace r1 {
constexpr int BM = 64, BN = 64, BK = 8, TM = 8;
constexpr int THREADS = BM * BN / TM;  // 512: thread t owns column t % BN, rows (t / BN) * TM ..
}

__global__ void __launch_bounds__(r1::THREADS)
sgemm_reg1d(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
            int M, int N, int K) {
    using namespace r1;
    __shared__ float As[BM][BK];
    __shared__ float Bs[BK][BN];
    const int t = threadIdx.x;
    const int tc = t % BN, tr = t / BN;  // column of C, group of TM rows
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    float acc[TM] = {};
    for (int k0 = 0; k0 < K; k0 += BK) {
        As[t / BK][t % BK] = elem(A, M, K, m0 + t / BK, k0 + t % BK);  // 512 = 64 x 8 elements
        Bs[t / BN][t % BN] = elem(B, K, N, k0 + t / BN, n0 + t % BN);  // 512 = 8 x 64
        __syncthreads();  // RAW
        #pragma unroll
        for (int kk = 0; kk < BK; ++kk) {
            const float b = Bs[kk][tc];  // one shared load of B ...
            #pragma unroll
            for (int i = 0; i < TM; ++i) acc[i] += As[tr * TM + i][kk] * b;  // ... feeds TM FMAs
        }
        __syncthreads();  // WAR
    }
    #pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int r = m0 + tr * TM + i, c = n0 + tc;
        if (r < M && c < N) C[(size_t)r * N + c] = acc[i];
    }
}

// ------------------------------------------------------------------ steps 3-7: 2D register tiling
// Block tile BM x BN = 128 x 128, k step BK = 8, 256 threads, an 8 x 8 micro-tile per thread.
namespace r2 {
constexpr int BM = 128, BN = 128, BK = 8, TM = 8, TN = 8;
constexpr int THREADS = (BM / TM) * (BN / TN);  // 256
constexpr int APAD = 4;  // step 5: As[k][m] rows of BM + 4 floats (see the store below)
static_assert(BM * BK == 4 * THREADS && BK * BN == 4 * THREADS, "one float4 per tile per thread");
}

// Step 3: each thread owns the contiguous 8 x 8 block rows ty*8.., columns tx*8..; scalar loads.
__global__ void __launch_bounds__(r2::THREADS)
sgemm_reg2d(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
            int M, int N, int K) {
    using namespace r2;
    __shared__ float As[BM][BK];
    __shared__ float Bs[BK][BN];
    const int t = threadIdx.x, ty = t / (BN / TN), tx = t % (BN / TN);
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    float acc[TM][TN] = {};
    float a[TM], b[TN];
    for (int k0 = 0; k0 < K; k0 += BK) {
        #pragma unroll
        for (int e = t; e < BM * BK; e += THREADS) As[e / BK][e % BK] = elem(A, M, K, m0 + e / BK, k0 + e % BK);
        #pragma unroll
        for (int e = t; e < BK * BN; e += THREADS) Bs[e / BN][e % BN] = elem(B, K, N, k0 + e / BN, n0 + e % BN);
        __syncthreads();  // RAW
        #pragma unroll
        for (int kk = 0; kk < BK; ++kk) {
            #pragma unroll
            for (int i = 0; i < TM; ++i) a[i] = As[ty * TM + i][kk];  // 8 loads of A ...
            #pragma unroll
            for (int j = 0; j < TN; ++j) b[j] = Bs[kk][tx * TN + j];  // ... 8 of B ...
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                #pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] += a[i] * b[j];  // ... feed 64 FMAs
            }
        }
        __syncthreads();  // WAR
    }
    #pragma unroll
    for (int i = 0; i < TM; ++i) {
        #pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int r = m0 + ty * TM + i, c = n0 + tx * TN + j;
            if (r < M && c < N) C[(size_t)r * N + c] = acc[i][j];
        }
    }
}

// Steps 4 and 5 differ only in where a thread's rows and columns lie and in As's padding.
//   STRIPS = false (step 4): rows ty*8 .. ty*8+7, columns tx*8 .. tx*8+7 (ty = t / 16, tx = t % 16)
//   STRIPS = true  (step 5): rows ty*4 .. +3 and 64 + ty*4 .. +3, columns tx*4 .. +3 and
//                            64 + tx*4 .. +3: the 8 lanes of one 128-byte phase (same ty,
//                            tx = 0..7) read 8 consecutive float4s of Bs, and one float4 of As.
template <bool STRIPS>
__device__ __forceinline__ void micro_tile(int t, int (&rows)[2], int (&cols)[2]) {
    const int ty = t / (r2::BN / r2::TN), tx = t % (r2::BN / r2::TN);
    if (STRIPS) {
        rows[0] = ty * 4;  rows[1] = rows[0] + r2::BM / 2;
        cols[0] = tx * 4;  cols[1] = cols[0] + r2::BN / 2;
    } else {
        rows[0] = ty * 8;  rows[1] = rows[0] + 4;
        cols[0] = tx * 8;  cols[1] = cols[0] + 4;
    }
}

// Shared by steps 4 to 7. One value of kk: the thread's 8 values of A's column kk (two float4s
// of the transposed tile, at rows[0] and rows[1]) and 8 of B's row kk (at cols[0], cols[1]):
// 4 float4 shared loads feed 64 FMAs.
__device__ __forceinline__ void fma_step(const float* As_kk, const float* Bs_kk,
                                         const int (&rows)[2], const int (&cols)[2],
                                         float (&acc)[r2::TM][r2::TN]) {
    float a[r2::TM], b[r2::TN];
    #pragma unroll
    for (int s = 0; s < 2; ++s) {
        const float4 av = *reinterpret_cast<const float4*>(As_kk + rows[s]);
        const float4 bv = *reinterpret_cast<const float4*>(Bs_kk + cols[s]);
        a[4 * s + 0] = av.x; a[4 * s + 1] = av.y; a[4 * s + 2] = av.z; a[4 * s + 3] = av.w;
        b[4 * s + 0] = bv.x; b[4 * s + 1] = bv.y; b[4 * s + 2] = bv.z; b[4 * s + 3] = bv.w;
    }
    #pragma unroll
    for (int i = 0; i < r2::TM; ++i) {
        #pragma unroll
        for (int j = 0; j < r2::TN; ++j) acc[i][j] += a[i] * b[j];
    }
}

// The thread's micro-tile -> C: row i of acc is C row m0 + rows[i / 4] + i % 4, columns
// n0 + cols[s] .. +3 hold acc[i][4 s .. 4 s + 3]; float4 stores where the rows allow them.
__device__ __forceinline__ void store_micro_tile(float* C, int M, int N, int m0, int n0,
                                                 const int (&rows)[2], const int (&cols)[2],
                                                 const float (&acc)[r2::TM][r2::TN]) {
    const bool c_vec = N % 4 == 0 && aligned16(C);
    #pragma unroll
    for (int i = 0; i < r2::TM; ++i) {
        #pragma unroll
        for (int s = 0; s < 2; ++s) {
            store4(C, M, N, m0 + rows[i / 4] + i % 4, n0 + cols[s],
                   make_float4(acc[i][4 * s], acc[i][4 * s + 1], acc[i][4 * s + 2], acc[i][4 * s + 3]),
                   c_vec);
        }
    }
}

template <bool STRIPS>
__global__ void __launch_bounds__(r2::THREADS)
sgemm_vec4(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
           int M, int N, int K) {
    using namespace r2;
    constexpr int LDA = STRIPS ? BM + APAD : BM;  // row length of the transposed A tile
    __shared__ __align__(16) float As[BK][LDA];   // A tile transposed: As[k][m]
    __shared__ __align__(16) float Bs[BK][BN];
    const int t = threadIdx.x;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    int rows[2], cols[2];
    micro_tile<STRIPS>(t, rows, cols);
    const int a_r = t / (BK / 4), a_c = (t % (BK / 4)) * 4;  // A tile: row 0..127, k 0 or 4
    const int b_r = t / (BN / 4), b_c = (t % (BN / 4)) * 4;  // B tile: k 0..7, col 0..124
    const bool a_vec = K % 4 == 0 && aligned16(A), b_vec = N % 4 == 0 && aligned16(B);
    float acc[TM][TN] = {};
    for (int k0 = 0; k0 < K; k0 += BK) {
        const float4 va = load4(A, M, K, m0 + a_r, k0 + a_c, a_vec);
        // Lanes 2j and 2j+1 store the same m at k and k+4: with LDA = 128 both land in one
        // bank (2-way conflict); LDA = 132 moves k+4 by 16 banks.
        As[a_c + 0][a_r] = va.x;
        As[a_c + 1][a_r] = va.y;
        As[a_c + 2][a_r] = va.z;
        As[a_c + 3][a_r] = va.w;
        *reinterpret_cast<float4*>(&Bs[b_r][b_c]) = load4(B, K, N, k0 + b_r, n0 + b_c, b_vec);
        __syncthreads();  // RAW
        #pragma unroll
        for (int kk = 0; kk < BK; ++kk) fma_step(&As[kk][0], &Bs[kk][0], rows, cols, acc);
        __syncthreads();  // WAR
    }
    store_micro_tile(C, M, N, m0, n0, rows, cols, acc);
}

// ------------------------------------------------------------------ step 6: prefetch through registers
// Step 5 waits for its global loads at the top of every k step. Here the loads of tile t+1 are
// issued before the products of tile t and land in registers while the FMAs run; two shared
// buffers let one barrier per step separate the stores of t+1 from the reads of t.
#ifndef SGEMM_PREFETCH_MIN_BLOCKS
#define SGEMM_PREFETCH_MIN_BLOCKS 2
#endif
__global__ void __launch_bounds__(r2::THREADS, SGEMM_PREFETCH_MIN_BLOCKS)
sgemm_prefetch(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
               int M, int N, int K) {
    using namespace r2;
    constexpr int LDA = BM + APAD;
    __shared__ __align__(16) float As[2][BK][LDA];  // two transposed A tiles
    __shared__ __align__(16) float Bs[2][BK][BN];
    const int t = threadIdx.x;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    int rows[2], cols[2];
    micro_tile<true>(t, rows, cols);
    const int a_r = t / (BK / 4), a_c = (t % (BK / 4)) * 4;
    const int b_r = t / (BN / 4), b_c = (t % (BN / 4)) * 4;
    const bool a_vec = K % 4 == 0 && aligned16(A), b_vec = N % 4 == 0 && aligned16(B);
    float acc[TM][TN] = {};
    float4 va = load4(A, M, K, m0 + a_r, a_c, a_vec);  // tile 0 in registers
    float4 vb = load4(B, K, N, b_r, n0 + b_c, b_vec);
    for (int k0 = 0, buf = 0; k0 < K; k0 += BK, buf ^= 1) {
        As[buf][a_c + 0][a_r] = va.x;
        As[buf][a_c + 1][a_r] = va.y;
        As[buf][a_c + 2][a_r] = va.z;
        As[buf][a_c + 3][a_r] = va.w;
        *reinterpret_cast<float4*>(&Bs[buf][b_r][b_c]) = vb;
        __syncthreads();  // RAW: tile t stored by all; WAR: buffer buf was last read at t - 2,
                          // before every thread passed the previous barrier
        if (k0 + BK < K) {  // tile t+1: the loads fly while the products below run
            va = load4(A, M, K, m0 + a_r, k0 + BK + a_c, a_vec);
            vb = load4(B, K, N, k0 + BK + b_r, n0 + b_c, b_vec);
        }
        #pragma unroll
        for (int kk = 0; kk < BK; ++kk) fma_step(&As[buf][kk][0], &Bs[buf][kk][0], rows, cols, acc);
    }
    store_micro_tile(C, M, N, m0, n0, rows, cols, acc);
}

// ------------------------------------------------------------------ step 7: cp.async pipeline
// cp.async copies global -> shared without passing through registers, and without waiting:
// the thread goes on computing while the copy is in flight. It copies bytes as they are (no
// transpose), so A's tile stays row-major, As[m][k], and a thread reads A 4 k values at a time.
// cp.async exists from sm_80 (A100) on. Before that (a T4 is sm_75) the same four functions
// copy synchronously, through registers: step 7 then runs and gives the same C, only without
// the overlap that is its point.
// (-DSGEMM_SYNC_COPIES forces the fallback on any GPU: how the tests check it on an H100.)
#if (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800) && !defined(SGEMM_SYNC_COPIES)
#define SGEMM_HAS_CP_ASYNC 1
#endif
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    // src_bytes < 16 fills the rest of the 16 bytes with zeros (the matrix edge)
#ifdef SGEMM_HAS_CP_ASYNC
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
#else
    for (int i = 0; i < 4; ++i)
        static_cast<float*>(smem)[i] = 4 * i < src_bytes ? static_cast<const float*>(gmem)[i] : 0.f;
#endif
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int src_bytes) {
#ifdef SGEMM_HAS_CP_ASYNC
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
#else
    *static_cast<float*>(smem) = src_bytes > 0 ? *static_cast<const float*>(gmem) : 0.f;
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef SGEMM_HAS_CP_ASYNC
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N_IN_FLIGHT>
__device__ __forceinline__ void cp_async_wait() {
#ifdef SGEMM_HAS_CP_ASYNC
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N_IN_FLIGHT));
#endif
}

// Copy 4 consecutive elements X[r, c .. c+3] into dst (16-byte aligned shared memory), zeros
// outside X. One 16-byte copy when the rows allow it, else 4 copies of 4 bytes.
__device__ __forceinline__ void copy4_async(float* dst, const float* X, int rows, int cols, int r,
                                            int c, bool vec) {
    const bool row_in = r < rows;
    const float* row = X + (size_t)(row_in ? r : 0) * cols;  // a valid address even outside
    if (vec) {
        const int valid = row_in ? max(0, min(4, cols - c)) : 0;
        cp_async16(dst, valid > 0 ? row + c : X, 4 * valid);
    } else {
        #pragma unroll
        for (int q = 0; q < 4; ++q) {
            const bool in = row_in && c + q < cols;
            cp_async4(dst + q, in ? row + c + q : X, in ? 4 : 0);
        }
    }
}

#ifndef SGEMM_PIPELINE_BK
#define SGEMM_PIPELINE_BK 16
#endif
#ifndef SGEMM_PIPELINE_STAGES
#define SGEMM_PIPELINE_STAGES 3
#endif
#ifndef SGEMM_PIPELINE_MIN_BLOCKS
#define SGEMM_PIPELINE_MIN_BLOCKS 1
#endif
namespace pl {
constexpr int BM = r2::BM, BN = r2::BN, TM = r2::TM, TN = r2::TN, THREADS = r2::THREADS;
constexpr int BK = SGEMM_PIPELINE_BK;          // k step
constexpr int STAGES = SGEMM_PIPELINE_STAGES;  // shared buffers: copies in flight + 1
constexpr int LDA = BK + 4;  // As[m][k] rows of BK + 4 floats: 16-byte aligned, banks spread
static_assert(BK % 4 == 0 && (BM * BK / 4) % THREADS == 0 && (BK * BN / 4) % THREADS == 0,
              "each thread copies whole float4s of both tiles");
}

__global__ void __launch_bounds__(pl::THREADS, SGEMM_PIPELINE_MIN_BLOCKS)
sgemm_pipeline(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
               int M, int N, int K) {
    using namespace pl;
    extern __shared__ __align__(16) float smem[];  // STAGES A tiles, then STAGES B tiles
    float (*As)[BM][LDA] = reinterpret_cast<float (*)[BM][LDA]>(smem);                // row-major A
    float (*Bs)[BK][BN] = reinterpret_cast<float (*)[BK][BN]>(smem + STAGES * BM * LDA);
    const int t = threadIdx.x;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    int rows[2], cols[2];
    micro_tile<true>(t, rows, cols);
    const bool a_vec = K % 4 == 0 && aligned16(A), b_vec = N % 4 == 0 && aligned16(B);
    const int steps = (K + BK - 1) / BK;
    // Interior blocks of aligned matrices (almost all of a large matmul) copy whole float4s
    // with no checks, through pointers that advance by one k tile per step.
    constexpr int A_COPIES = BM * BK / 4 / THREADS, B_COPIES = BK * BN / 4 / THREADS;
    const bool full = a_vec && b_vec && K % BK == 0 && m0 + BM <= M && n0 + BN <= N;
    auto issue = [&](int step, int stage) {  // start copying k tile `step` into buffer `stage`
        const int k0 = step * BK;
        #pragma unroll
        for (int q = 0; q < A_COPIES; ++q) {  // A tile: BM rows of BK / 4 float4s
            const int e = t + q * THREADS, r = e / (BK / 4), c = (e % (BK / 4)) * 4;
            if (full) cp_async16(&As[stage][r][c], A + (size_t)(m0 + r) * K + k0 + c, 16);
            else copy4_async(&As[stage][r][c], A, M, K, m0 + r, k0 + c, a_vec);
        }
        #pragma unroll
        for (int q = 0; q < B_COPIES; ++q) {  // B tile: BK rows of BN / 4 float4s
            const int e = t + q * THREADS, r = e / (BN / 4), c = (e % (BN / 4)) * 4;
            if (full) cp_async16(&Bs[stage][r][c], B + (size_t)(k0 + r) * N + n0 + c, 16);
            else copy4_async(&Bs[stage][r][c], B, K, N, k0 + r, n0 + c, b_vec);
        }
        cp_async_commit();  // one group per tile, even an empty one, so the counts line up
    };
    float acc[TM][TN] = {};
    #pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {  // prologue: the first STAGES - 1 tiles in flight
        if (s < steps) issue(s, s); else cp_async_commit();
    }
    for (int step = 0; step < steps; ++step) {
        const int stage = step % STAGES;
        cp_async_wait<STAGES - 2>();  // tile `step` has landed (for this thread's copies) ...
        __syncthreads();              // ... and for every thread's (RAW); and the buffer the
                                      // next issue overwrites was read by all in step - 1 (WAR)
        if (step + STAGES - 1 < steps) issue(step + STAGES - 1, (step + STAGES - 1) % STAGES);
        else cp_async_commit();
        #pragma unroll
        for (int k4 = 0; k4 < BK; k4 += 4) {
            float4 a4[TM];  // a4[i] = A[row i, k4 .. k4+3]: 8 float4 loads for 4 values of kk
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                a4[i] = *reinterpret_cast<const float4*>(&As[stage][rows[i / 4] + i % 4][k4]);
            }
            #pragma unroll
            for (int kq = 0; kq < 4; ++kq) {
                float b[TN];
                #pragma unroll
                for (int s = 0; s < 2; ++s) {
                    const float4 bv = *reinterpret_cast<const float4*>(&Bs[stage][k4 + kq][cols[s]]);
                    b[4 * s + 0] = bv.x; b[4 * s + 1] = bv.y; b[4 * s + 2] = bv.z; b[4 * s + 3] = bv.w;
                }
                #pragma unroll
                for (int i = 0; i < TM; ++i) {
                    const float a = kq == 0 ? a4[i].x : kq == 1 ? a4[i].y : kq == 2 ? a4[i].z : a4[i].w;
                    #pragma unroll
                    for (int j = 0; j < TN; ++j) acc[i][j] += a * b[j];
                }
            }
        }
    }
    cp_async_wait<0>();  // no copy may still write shared memory when the block exits
    store_micro_tile(C, M, N, m0, n0, rows, cols, acc);
}

#if defined(__CUDACC_RTC__) || defined(FA_KERNEL_ONLY)
// NVRTC (or nvcc -DFA_KERNEL_ONLY) compiles no host code, so nothing instantiates the template:
// do it here.
template __global__ void sgemm_vec4<false>(const float*, const float*, float*, int, int, int);
template __global__ void sgemm_vec4<true>(const float*, const float*, float*, int, int, int);
#else
constexpr int PIPELINE_SMEM = pl::STAGES * (pl::BM * pl::LDA + pl::BK * pl::BN) * 4;  // bytes

constexpr int STEPS = 8;

// grid, block and kernel of one step for C of M x N
struct Launch {
    const void* kernel;
    dim3 grid, block;
    int smem = 0;  // dynamic shared memory, bytes
};

static Launch launch_of(int step, int M, int N) {
    auto cdiv = [](int a, int b) { return (unsigned)((a + b - 1) / b); };
    switch (step) {
        case 0: return {(const void*)sgemm_naive, dim3(cdiv(N, 16), cdiv(M, 16)), dim3(16, 16)};
        case 1: return {(const void*)sgemm_smem, dim3(cdiv(N, TILE), cdiv(M, TILE)), dim3(TILE, TILE)};
        case 2: return {(const void*)sgemm_reg1d, dim3(cdiv(N, r1::BN), cdiv(M, r1::BM)), dim3(r1::THREADS)};
        case 3: return {(const void*)sgemm_reg2d, dim3(cdiv(N, r2::BN), cdiv(M, r2::BM)), dim3(r2::THREADS)};
        case 4: return {(const void*)sgemm_vec4<false>, dim3(cdiv(N, r2::BN), cdiv(M, r2::BM)), dim3(r2::THREADS)};
        case 5: return {(const void*)sgemm_vec4<true>, dim3(cdiv(N, r2::BN), cdiv(M, r2::BM)), dim3(r2::THREADS)};
        case 6: return {(const void*)sgemm_prefetch, dim3(cdiv(N, r2::BN), cdiv(M, r2::BM)), dim3(r2::THREADS)};
        default: return {(const void*)sgemm_pipeline, dim3(cdiv(N, pl::BN), cdiv(M, pl::BM)), dim3(pl::THREADS), PIPELINE_SMEM};
    }
}

// C = A @ B into a given C (M x N, float32, contiguous, on A's GPU): a check can fill C with
// NaN first, so that elements a kernel forgets to write show up.
torch::Tensor sgemm_into(torch::Tensor A, torch::Tensor B, torch::Tensor C, int64_t step) {
    TORCH_CHECK(step >= 0 && step < STEPS, "sgemm: step must be 0..", std::to_string(STEPS - 1),
                ", got ", std::to_string(step));
    TORCH_CHECK(A.is_cuda() && B.is_cuda() && C.is_cuda(), "sgemm: A, B and C must be CUDA tensors");
    TORCH_CHECK(A.device() == B.device() && A.device() == C.device(),
                "sgemm: A, B and C must be on the same GPU");
    TORCH_CHECK(A.scalar_type() == torch::kFloat && B.scalar_type() == torch::kFloat &&
                C.scalar_type() == torch::kFloat, "sgemm: A, B and C must be float32");
    TORCH_CHECK(A.dim() == 2 && B.dim() == 2 && C.dim() == 2, "sgemm: A, B and C must be 2D");
    TORCH_CHECK(A.is_contiguous() && B.is_contiguous() && C.is_contiguous(),
                "sgemm: A, B and C must be contiguous (call .contiguous())");
    TORCH_CHECK(A.size(1) == B.size(0), "sgemm: inner dimensions differ: A is ",
                std::to_string(A.size(0)), " x ", std::to_string(A.size(1)), ", B is ",
                std::to_string(B.size(0)), " x ", std::to_string(B.size(1)));
    TORCH_CHECK(C.size(0) == A.size(0) && C.size(1) == B.size(1), "sgemm: C must be ",
                std::to_string(A.size(0)), " x ", std::to_string(B.size(1)), ", got ",
                std::to_string(C.size(0)), " x ", std::to_string(C.size(1)));
    TORCH_CHECK(A.size(0) < (1LL << 31) / 16 && B.size(1) < (1LL << 31) / 16 &&
                A.size(1) < (1LL << 31), "sgemm: matrix too large for 32-bit tile indices");
    const int M = A.size(0), K = A.size(1), N = B.size(1);
    if (M == 0 || N == 0) return C;
    if (K == 0) return C.zero_();
    const Launch L = launch_of((int)step, M, N);
    TORCH_CHECK(L.grid.y <= 65535, "sgemm: M = ", std::to_string(M),
                " needs more than 65535 block rows; split A into row blocks");
    const float* a = A.data_ptr<float>();
    const float* b = B.data_ptr<float>();
    float* c = C.data_ptr<float>();
    void* args[] = {(void*)&a, (void*)&b, (void*)&c, (void*)&M, (void*)&N, (void*)&K};
    if (L.smem > 48 * 1024) {  // more than 48 KiB of dynamic shared memory must be asked for
        cudaFuncSetAttribute(L.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L.smem);
    }
    const cudaError_t err = cudaLaunchKernel(L.kernel, L.grid, L.block, args, L.smem,
                                             c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == cudaSuccess, "sgemm: launch of step ", std::to_string(step), " failed: ",
                cudaGetErrorString(err));
    return C;
}

// C = A @ B: A (M x K) and B (K x N) float32, contiguous, on one GPU; any sizes.
torch::Tensor sgemm(torch::Tensor A, torch::Tensor B, int64_t step) {
    TORCH_CHECK(A.dim() == 2 && B.dim() == 2, "sgemm: A and B must be 2D matrices");
    return sgemm_into(A, B, torch::empty({A.size(0), B.size(1)}, A.options()), step);
}

int64_t sgemm_blocks_per_sm(int64_t step) {
    TORCH_CHECK(step >= 0 && step < STEPS, "sgemm_blocks_per_sm: step must be 0..",
                std::to_string(STEPS - 1), ", got ", std::to_string(step));
    const Launch L = launch_of((int)step, 1, 1);
    int blocks = 0;
    const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &blocks, L.kernel, (int)(L.block.x * L.block.y), L.smem);
    TORCH_CHECK(err == cudaSuccess, "sgemm_blocks_per_sm: ", cudaGetErrorString(err));
    return blocks;
}
#endif  // __CUDACC_RTC__ || FA_KERNEL_ONLY
