// FlashAttention-2 on tensor cores (mma.sync.m16n8k16, bf16 in, fp32 accumulate): chapter 10.
// The forward, a deterministic backward and one with atomic dQ (FlashAttention-2's); the CPU
// blueprint of the forward and of the deterministic dK, dV is course_utils.library.mma
// (warp_attention_forward, warp_attention_backward_kv), checked against float64 on a model of the
// same instructions. tests/test_flash_mma.py checks these kernels on a GPU.
//
// Shapes (row-major, contiguous): Q (B, H, Nq, D), K and V (B, H, Nk, D), bf16; O (B, H, Nq, D)
// bf16; LSE (B, H, Nq) float32 (natural log). D is 64, 96 or 128 (the atomic backward: 64 or
// 128). Causal is top-left aligned, as in chapter 07 (key c is masked for query r when c > r).
//
// Forward. Grid (Tr, H, B), Tr = ceil(Nq / BR), the last row blocks first. Block: 4 warps; warp w
// owns MT = 2 m-tiles of 16 query rows (BR = 128 rows a block).
//   * Q: the block's tile sits in shared memory; the warp loads its A fragments with ldmatrix.x4.
//   * K, V: tiles of BC keys (128 at D = 64, 64 at D = 128), one buffer each, copied with
//     cp.async: V(j) flies while S = Q K(j)^T is computed, K(j+1) while O += P V(j) is.
//   * S = Q K^T: per 16 of D and 16 keys, one ldmatrix.x4 of K's rows gives the B fragments of two
//     8-key n-tiles, each used by both m-tiles (2 m-tiles halve the shared-memory reads per mma).
//   * softmax: a lane holds 2 values of each of 2 rows (g and g + 8) per n-tile; a row's max and
//     sum are completed over its 4 lanes with __shfl_xor_sync(..., 1) and (..., 2).
//   * O += P V: two C fragments of P are one A fragment (packed to bf16 in registers, no trip
//     through shared memory); ldmatrix.x4.trans of V's rows gives the B fragments.
//   * masks: only the tiles that cross Nk or the diagonal test keys, against one limit per row.
// Shared tiles are swizzled: the 16-byte chunk c of row r is stored at chunk c ^ (r % 8), so the
// 8 rows an ldmatrix phase reads (same chunk c, 8 consecutive rows) fall in 8 different bank
// groups instead of one (rows are 128 or 256 bytes long, a multiple of the 128-byte bank width).
// At D = 96 the rows are padded from 192 to 208 bytes instead (see swizzle).

#if !defined(__CUDACC_RTC__) && !defined(FA_KERNEL_ONLY)
// From torch, what this file uses: the Tensor class and one header per operator it calls, under
// the torch:: names of <torch/types.h>. That header has every operator: a compile-only build (no
// GPU) takes about 30 % longer with it. On a GPU, load_inline puts it before this file anyway.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
namespace torch { using namespace at; }  // torch::Tensor, torch::empty, torch::kFloat, ...
#include <c10/cuda/CUDAStream.h>
#include <algorithm>
#include <string>
#include <vector>
#endif
#include <cuda_bf16.h>

namespace fa_mma {

constexpr int WARPS = 4, THREADS = 32 * WARPS;
constexpr float LOG2E = 1.4426950408889634f;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// The tile shape of each head dim: keys per tile, 16-row m-tiles per warp, blocks per SM the
// registers must allow, elements per row of a shared tile, Q's fragments kept in registers across
// tiles (or reloaded per tile). Each K or V fragment a warp loads from shared memory feeds MT mma
// instructions (one per m-tile): with MT = 1 the ldmatrix traffic, not the tensor cores, sets the
// pace (210 instead of 300 TFLOP/s at D = 128 on an H100). Measured there too: keeping Q in
// registers costs 32 registers at D = 64 and is no faster; at D = 128 it does not fit.
// ROW: D, except at D = 96, where a row of 192 bytes is padded to 208 (below).
template <int D> struct Config;
template <> struct Config<64> { static constexpr int BC = 128, MT = 2, MIN_BLOCKS = 2, ROW = 64; static constexpr bool Q_REGS = false; };
template <> struct Config<96> { static constexpr int BC = 64, MT = 2, MIN_BLOCKS = 2, ROW = 104; static constexpr bool Q_REGS = false; };
template <> struct Config<128> { static constexpr int BC = 64, MT = 2, MIN_BLOCKS = 2, ROW = 128; static constexpr bool Q_REGS = false; };

// Element (r, c) of a [rows][D] bf16 tile in shared memory. Rows of 64 and 128 elements (128 and
// 256 bytes) are swizzled: the 16-byte chunk c of row r is stored at chunk c ^ (r % 8). Rows of
// 96 elements are padded to Config<96>::ROW = 104 (208 bytes, 13 chunks): row r then starts
// 13 r chunks in, in bank group 5 r mod 8, a different group for each of 8 consecutive rows, so
// an ldmatrix phase (8 rows of one chunk) is conflict-free without a swizzle, for 8 % more memory.
template <int D>
__device__ __forceinline__ int swizzle(int r, int c) {
    if constexpr (D == 96) return r * Config<96>::ROW + c;
    return r * D + (((c >> 3) ^ (r & 7)) << 3) + (c & 7);
}

// 2^x in one MUFU.EX2 instruction (exp2f adds a range fix-up for results below 2^-126; a
// probability that small is 0 for bf16 P anyway)
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// d (4 fp32) += a (8 bf16 in 4 registers) @ b (4 bf16 in 2 registers): one warp-wide instruction
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo -> the lower 16 bits
    return *reinterpret_cast<const unsigned*>(&v);
}

// Copy rows [row0, row0 + ROWS) of a (rows x D) bf16 matrix into a swizzled shared tile with
// cp.async, zeros past the last row. Every thread of the block (NT of them) takes part.
template <int D, int ROWS, int NT = THREADS>
__device__ __forceinline__ void copy_tile(__nv_bfloat16* tile, const __nv_bfloat16* X, int row0,
                                          int rows) {
    constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
    #pragma unroll
    for (int e = threadIdx.x; e < ROWS * CHUNKS; e += NT) {
        const int r = e / CHUNKS, c = e % CHUNKS;
        const bool in = row0 + r < rows;
        const __nv_bfloat16* src = X + (size_t)(in ? row0 + r : 0) * D + c * 8;
        cp_async16(tile + swizzle<D>(r, c * 8), src, in ? 16 : 0);
    }
}


template <int D>
__global__ void __launch_bounds__(THREADS, Config<D>::MIN_BLOCKS)
flash_attention_mma_kernel(const __nv_bfloat16* __restrict__ Q, const __nv_bfloat16* __restrict__ K,
                           const __nv_bfloat16* __restrict__ V, __nv_bfloat16* __restrict__ O,
                           float* __restrict__ LSE, int Nq, int Nk, float scale, int causal) {
    constexpr int BC = Config<D>::BC, MT = Config<D>::MT;
    constexpr bool Q_REGS = Config<D>::Q_REGS;
    constexpr int BR = 16 * MT * WARPS;  // query rows per block
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // BR x D
    __nv_bfloat16* Ks = Qs + BR * Config<D>::ROW;                      // BC x D
    __nv_bfloat16* Vs = Ks + BC * Config<D>::ROW;                      // BC x D

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // the lane's group (row) and place in it (columns)
    const int j8 = lane / 8, r8 = lane % 8;  // for ldmatrix.x4: lane l points at row r8 of matrix j8
    const size_t bh = (size_t)blockIdx.z * gridDim.y + blockIdx.y;
    // the last row blocks first: under a causal mask they have the most key tiles to visit
    const int row0 = (gridDim.x - 1 - blockIdx.x) * BR;
    const int wrow0 = row0 + warp * 16 * MT;  // the warp's first row
    const __nv_bfloat16* Qb = Q + bh * Nq * D;
    const __nv_bfloat16* Kb = K + bh * Nk * D;
    const __nv_bfloat16* Vb = V + bh * Nk * D;

    // key tiles this block needs: all, or (causal) those up to its last query row
    const int last_row = min(row0 + BR, Nq) - 1;
    const int n_tiles = causal ? min((Nk + BC - 1) / BC, last_row / BC + 1) : (Nk + BC - 1) / BC;

    // Schedule (one K and one V buffer): K(j) is copied during P V of tile j-1, V(j) during
    // S = Q K(j)^T; every wait is for all of this thread's copies (wait_group 0), then a barrier.
    copy_tile<D, BR>(Qs, Qb, row0, Nq);
    copy_tile<D, BC>(Ks, Kb, 0, Nk);
    cp_async_commit();

    unsigned q[Q_REGS ? MT : 1][D / 16][4];  // the warp's rows of Q as A fragments (if kept)
    float o[MT][D / 8][4];                   // O: per m-tile, D / 8 C fragments
    float m[MT][2], l[MT][2];                // running max (raw score units) and the lane's sum
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int nd = 0; nd < D / 8; ++nd) o[mt][nd][0] = o[mt][nd][1] = o[mt][nd][2] = o[mt][nd][3] = 0.0f;
        m[mt][0] = m[mt][1] = neg_inf();
        l[mt][0] = l[mt][1] = 0.0f;
    }
    const float scale_log2 = scale * LOG2E;

    for (int jt = 0; jt < n_tiles; ++jt) {
        cp_async_wait<0>();  // K(j) (and, at j = 0, Q) has landed for this thread ...
        __syncthreads();     // ... and for all; every warp is also done with V(j-1) (WAR)
        copy_tile<D, BC>(Vs, Vb, jt * BC, Nk);
        cp_async_commit();
        if (Q_REGS && jt == 0) {
            #pragma unroll
            for (int mt = 0; mt < (Q_REGS ? MT : 0); ++mt)
                #pragma unroll
                for (int kc = 0; kc < D / 16; ++kc)
                    ldmatrix_x4(q[mt][kc], Qs + swizzle<D>(warp * 16 * MT + mt * 16 + (j8 % 2) * 8 + r8,
                                                           kc * 16 + (j8 / 2) * 8));
        }

        // S = Q K^T: BC / 8 C fragments per m-tile; one ldmatrix.x4 of K feeds 2 * MT mma
        float s[MT][BC / 8][4];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
        #pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) {
            unsigned qa[MT][4];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if constexpr (Q_REGS) {
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) qa[mt][i] = q[mt][kc][i];
                } else {
                    ldmatrix_x4(qa[mt], Qs + swizzle<D>(warp * 16 * MT + mt * 16 + (j8 % 2) * 8 + r8,
                                                        kc * 16 + (j8 / 2) * 8));
                }
            }
            #pragma unroll
            for (int np = 0; np < BC / 16; ++np) {  // 16 keys: n-tiles 2np and 2np + 1
                unsigned b[4];
                ldmatrix_x4(b, Ks + swizzle<D>(np * 16 + (j8 / 2) * 8 + r8, kc * 16 + (j8 % 2) * 8));
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(s[mt][2 * np], qa[mt], b[0], b[1]);
                    mma_bf16(s[mt][2 * np + 1], qa[mt], b[2], b[3]);
                }
            }
        }

        // mask (a select, only in tiles that cross N or the diagonal), row max over 4 lanes,
        // rescale, P = exp2(S * scale_log2 - m * scale_log2): one FFMA and one exp2 per element
        const int key0 = jt * BC;
        unsigned p[MT][BC / 16][4];  // P in bf16, as A fragments of 16 keys each
        const bool needs_mask = key0 + BC > Nk || (causal && key0 + BC - 1 > wrow0);
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const int row_g = wrow0 + mt * 16 + g;  // the lane's rows: row_g and row_g + 8
            if (needs_mask) {
                // value i of n-tile nt is key key0 + 2t + (nt * 8 + i % 2): compare the constant
                // part with one limit per row (a few registers, not one predicate per element)
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    int last = Nk - 1 - key0 - 2 * t;                            // key < Nk
                    if (causal) last = min(last, row_g + 8 * h - key0 - 2 * t);  // key <= row
                    #pragma unroll
                    for (int nt = 0; nt < BC / 8; ++nt)
                        #pragma unroll
                        for (int c = 0; c < 2; ++c)
                            if (nt * 8 + c > last) s[mt][nt][2 * h + c] = neg_inf();
                }
            }
            float m_new[2] = {m[mt][0], m[mt][1]};
            #pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt)
                #pragma unroll
                for (int i = 0; i < 4; ++i) m_new[i / 2] = fmaxf(m_new[i / 2], s[mt][nt][i]);
            float m_scaled[2], alpha[2];
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                m_new[h] = fmaxf(m_new[h], __shfl_xor_sync(0xffffffffu, m_new[h], 1));
                m_new[h] = fmaxf(m_new[h], __shfl_xor_sync(0xffffffffu, m_new[h], 2));
                // a row with no key yet keeps m = -inf: subtract 0 instead (P = 0, no NaN)
                m_scaled[h] = m_new[h] == neg_inf() ? 0.0f : m_new[h] * scale_log2;
                alpha[h] = fast_exp2(m[mt][h] * scale_log2 - m_scaled[h]);
                l[mt][h] *= alpha[h];
                m[mt][h] = m_new[h];
            }
            #pragma unroll
            for (int nd = 0; nd < D / 8; ++nd) {  // rescale O's rows by alpha
                o[mt][nd][0] *= alpha[0]; o[mt][nd][1] *= alpha[0];
                o[mt][nd][2] *= alpha[1]; o[mt][nd][3] *= alpha[1];
            }
            // P = exp2(...), summed in fp32, then packed to bf16 at once: P's two C fragments of
            // 16 keys are the A fragment of P V, and the fp32 S registers are free again
            #pragma unroll
            for (int kc = 0; kc < BC / 16; ++kc) {
                float x[8];
                #pragma unroll
                for (int i = 0; i < 8; ++i) {
                    x[i] = fast_exp2(fmaf(s[mt][2 * kc + i / 4][i % 4], scale_log2, -m_scaled[(i / 2) % 2]));
                    l[mt][(i / 2) % 2] += x[i];
                }
                p[mt][kc][0] = pack_bf16(x[0], x[1]);  // row g,     keys 2t, 2t+1
                p[mt][kc][1] = pack_bf16(x[2], x[3]);  // row g + 8, keys 2t, 2t+1
                p[mt][kc][2] = pack_bf16(x[4], x[5]);  // row g,     keys 8 + 2t, 8 + 2t+1
                p[mt][kc][3] = pack_bf16(x[6], x[7]);  // row g + 8, keys 8 + 2t, 8 + 2t+1
            }
        }

        cp_async_wait<0>();  // V(j) has landed for this thread ...
        __syncthreads();     // ... and for all; every warp is also done with K(j) (WAR)
        if (jt + 1 < n_tiles) copy_tile<D, BC>(Ks, Kb, (jt + 1) * BC, Nk);  // flies during P V
        cp_async_commit();

        // O += P V: 16 keys at a time, P straight from registers (no trip through shared memory)
        #pragma unroll
        for (int kc = 0; kc < BC / 16; ++kc) {
            #pragma unroll
            for (int nd = 0; nd < D / 16; ++nd) {  // 16 of D: n-tiles 2nd and 2nd + 1
                unsigned b[4];
                ldmatrix_x4_trans(b, Vs + swizzle<D>(kc * 16 + (j8 % 2) * 8 + r8, nd * 16 + (j8 / 2) * 8));
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(o[mt][2 * nd], p[mt][kc], b[0], b[1]);
                    mma_bf16(o[mt][2 * nd + 1], p[mt][kc], b[2], b[3]);
                }
            }
        }
    }
    cp_async_wait<0>();  // no copy may still be writing shared memory when the block ends

    // finish: the row sums over the 4 lanes of each group, O / l, LSE (natural log)
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = l[mt][h];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int row = wrow0 + mt * 16 + g + 8 * h;
            if (row >= Nq) continue;
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // a row that saw no key: O = 0
            __nv_bfloat16* out = O + (bh * Nq + row) * D;
            #pragma unroll
            for (int nd = 0; nd < D / 8; ++nd) {
                *reinterpret_cast<unsigned*>(out + nd * 8 + 2 * t) =
                    pack_bf16(o[mt][nd][2 * h] * inv, o[mt][nd][2 * h + 1] * inv);
            }
            if (t == 0) {
                LSE[bh * Nq + row] = sum > 0.0f ? m[mt][h] * scale + logf(sum) : neg_inf();
            }
        }
    }
}


// ---------------------------------------------------------------------------------------------
// Backward, in three kernels (deterministic: every gradient element is written by one thread,
// no atomics, so two runs give the same bits):
//   1. delta_kernel:  Delta_i = sum_d dO_id O_id  (fp32, one warp per row)
//   2. dkdv_kernel:   a block owns BKV = 64 keys (16 per warp) and walks the query tiles:
//        S^T = K Q^T, P^T = exp(S^T * scale - LSE), dV += P^T dO, dP^T = V dO^T,
//        dS^T = P^T * (dP^T - Delta), dK += dS^T Q
//      Keys are the rows (the M of every mma), so P^T and dS^T come out of the C fragments in
//      the layout an A fragment needs: both are reused in registers, as P is in the forward.
//   3. dq_kernel:     a block owns 64 queries (16 per warp) and walks the key tiles:
//        S = Q K^T, P = exp(S * scale - LSE), dP = dO V^T, dS = P * (dP - Delta), dQ += dS K
//      It recomputes S and dP (two more products than one pass with atomic dQ adds: the price of
//      determinism).
// Both loops double-buffer their streamed tiles with cp.async (tile i+1 flies while tile i is
// used). LSE = -inf (a row that saw no key) is stored as +inf so that its P is 0.
// ---------------------------------------------------------------------------------------------

__global__ void delta_kernel(const __nv_bfloat16* __restrict__ O, const __nv_bfloat16* __restrict__ dO,
                             float* __restrict__ Delta, int rows, int D) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    float acc = 0.0f;
    for (int c = 2 * lane; c < D; c += 64) {
        const __nv_bfloat162 o = *reinterpret_cast<const __nv_bfloat162*>(O + (size_t)row * D + c);
        const __nv_bfloat162 g = *reinterpret_cast<const __nv_bfloat162*>(dO + (size_t)row * D + c);
        acc += __bfloat162float(o.x) * __bfloat162float(g.x) + __bfloat162float(o.y) * __bfloat162float(g.y);
    }
    #pragma unroll
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) Delta[row] = acc;
}

constexpr int B_ROWS = 16 * WARPS;  // keys per dK/dV block, queries per dQ block
constexpr int B_TILE = 64;          // queries (dK/dV) or keys (dQ) per streamed tile

// A fragments (16 rows x 16 of D) of a swizzled [rows][D] tile, rows row0.. of this warp
template <int D>
__device__ __forceinline__ void load_a(unsigned (&a)[4], const __nv_bfloat16* tile, int row0, int kc) {
    const int lane = threadIdx.x % 32, j8 = lane / 8, r8 = lane % 8;
    ldmatrix_x4(a, tile + swizzle<D>(row0 + (j8 % 2) * 8 + r8, kc * 16 + (j8 / 2) * 8));
}
// B fragments of two 8-row n-tiles (rows n0.. n0+15 of a swizzled [rows][D] tile as the N side,
// 16 of D as the K side): what K's rows are in S = Q K^T
template <int D>
__device__ __forceinline__ void load_b_rows(unsigned (&b)[4], const __nv_bfloat16* tile, int n0, int kc) {
    const int lane = threadIdx.x % 32, j8 = lane / 8, r8 = lane % 8;
    ldmatrix_x4(b, tile + swizzle<D>(n0 + (j8 / 2) * 8 + r8, kc * 16 + (j8 % 2) * 8));
}
// B fragments of two 8-column n-tiles (columns nd*16.. of D as the N side, rows k0.. k0+15 as the
// K side), with .trans: what V's rows are in O = P V
template <int D>
__device__ __forceinline__ void load_b_cols(unsigned (&b)[4], const __nv_bfloat16* tile, int k0, int nd) {
    const int lane = threadIdx.x % 32, j8 = lane / 8, r8 = lane % 8;
    ldmatrix_x4_trans(b, tile + swizzle<D>(k0 + (j8 % 2) * 8 + r8, nd * 16 + (j8 / 2) * 8));
}

// acc (16 x B_TILE, B_TILE / 8 C fragments) = rows of A (16 x D, from shared) times rows of B^T
template <int D>
__device__ __forceinline__ void rows_times_rows(float (&acc)[B_TILE / 8][4], const __nv_bfloat16* A,
                                                int a_row0, const __nv_bfloat16* Bt) {
    #pragma unroll
    for (int nt = 0; nt < B_TILE / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    #pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
        unsigned a[4];
        load_a<D>(a, A, a_row0, kc);
        #pragma unroll
        for (int np = 0; np < B_TILE / 16; ++np) {
            unsigned b[4];
            load_b_rows<D>(b, Bt, np * 16, kc);
            mma_bf16(acc[2 * np], a, b[0], b[1]);
            mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// X (16 x B_TILE, C fragments) as bf16 A fragments: A is two C layouts side by side, so value i
// of n-tile nt goes to register (nt % 2) * 2 + i / 2 of k-chunk nt / 2, half i % 2
__device__ __forceinline__ void c_to_a(unsigned (&a)[B_TILE / 16][4], const float (&x)[B_TILE / 8][4]) {
    #pragma unroll
    for (int kc = 0; kc < B_TILE / 16; ++kc)
        #pragma unroll
        for (int r = 0; r < 4; ++r)
            a[kc][r] = pack_bf16(x[2 * kc + r / 2][2 * (r % 2)], x[2 * kc + r / 2][2 * (r % 2) + 1]);
}

// value i of n-tile nt of packed A fragments, back as a float (the inverse of c_to_a)
__device__ __forceinline__ float a_value(const unsigned (&a)[B_TILE / 16][4], int nt, int i) {
    const unsigned r = a[nt / 2][(nt % 2) * 2 + i / 2];
    return __uint_as_float((i % 2 ? r & 0xffff0000u : r << 16));  // bf16 = the top half of a float
}

// out (16 x D, D / 8 C fragments) += X (16 x B_TILE, bf16 A fragments in registers) times the
// B_TILE x D tile M in shared memory
template <int D>
__device__ __forceinline__ void a_times_tile(float (&out)[D / 8][4], const unsigned (&a)[B_TILE / 16][4],
                                             const __nv_bfloat16* M) {
    #pragma unroll
    for (int kc = 0; kc < B_TILE / 16; ++kc) {
        #pragma unroll
        for (int nd = 0; nd < D / 16; ++nd) {
            unsigned b[4];
            load_b_cols<D>(b, M, kc * 16, nd);
            mma_bf16(out[2 * nd], a[kc], b[0], b[1]);
            mma_bf16(out[2 * nd + 1], a[kc], b[2], b[3]);
        }
    }
}

// out (16 x D) += X (16 x B_TILE, C fragments in registers, reused as A) times the tile M
template <int D>
__device__ __forceinline__ void c_times_tile(float (&out)[D / 8][4], const float (&x)[B_TILE / 8][4],
                                             const __nv_bfloat16* M) {
    unsigned a[B_TILE / 16][4];
    c_to_a(a, x);
    a_times_tile<D>(out, a, M);
}

// Copy n floats (LSE * log2(e), or Delta) of rows [row0, row0 + n) into shared memory; rows past
// `rows` get `fill`. An LSE of -inf becomes +inf (its P must be 0). NT threads take part.
template <int NT = THREADS>
__device__ __forceinline__ void copy_row_stats(float* dst, const float* src, int row0, int rows,
                                               float mul, float fill) {
    for (int i = threadIdx.x; i < B_TILE; i += NT) {
        float v = fill;
        if (row0 + i < rows) {
            v = src[row0 + i];
            v = v == neg_inf() ? -neg_inf() : v * mul;
        }
        dst[i] = v;
    }
}

template <int D>
__global__ void __launch_bounds__(THREADS, 2)
dkdv_kernel(const __nv_bfloat16* __restrict__ Q, const __nv_bfloat16* __restrict__ K,
            const __nv_bfloat16* __restrict__ V, const __nv_bfloat16* __restrict__ dO,
            const float* __restrict__ LSE, const float* __restrict__ Delta,
            __nv_bfloat16* __restrict__ dK, __nv_bfloat16* __restrict__ dV,
            int Nq, int Nk, float scale, int causal) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // B_ROWS x D
    constexpr int ROW = Config<D>::ROW;                                // elements per tile row
    __nv_bfloat16* Vs = Ks + B_ROWS * ROW;                             // B_ROWS x D
    __nv_bfloat16* Qs = Vs + B_ROWS * ROW;                             // 2 x B_TILE x D
    __nv_bfloat16* dOs = Qs + 2 * B_TILE * ROW;                        // 2 x B_TILE x D
    float* lse_s = reinterpret_cast<float*>(dOs + 2 * B_TILE * ROW);  // 2 x B_TILE
    float* delta_s = lse_s + 2 * B_TILE;                               // 2 x B_TILE

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const size_t bh = (size_t)blockIdx.z * gridDim.y + blockIdx.y;
    const int key0 = blockIdx.x * B_ROWS, wkey0 = key0 + warp * 16;
    const __nv_bfloat16 *Qb = Q + bh * Nq * D, *dOb = dO + bh * Nq * D;
    const float *lse_b = LSE + bh * Nq, *delta_b = Delta + bh * Nq;
    const float scale_log2 = scale * LOG2E;

    // query tiles that can see these keys: all, or (causal, key c seen by queries r >= c) from
    // the tile of query key0 on
    const int first = causal ? key0 / B_TILE : 0, n_tiles = (Nq + B_TILE - 1) / B_TILE;

    copy_tile<D, B_ROWS>(Ks, K + bh * Nk * D, key0, Nk);
    copy_tile<D, B_ROWS>(Vs, V + bh * Nk * D, key0, Nk);
    auto stream_in = [&](int i, int buf) {
        copy_tile<D, B_TILE>(Qs + buf * B_TILE * ROW, Qb, i * B_TILE, Nq);
        copy_tile<D, B_TILE>(dOs + buf * B_TILE * ROW, dOb, i * B_TILE, Nq);
        copy_row_stats(lse_s + buf * B_TILE, lse_b, i * B_TILE, Nq, LOG2E, -neg_inf());
        copy_row_stats(delta_s + buf * B_TILE, delta_b, i * B_TILE, Nq, 1.0f, 0.0f);
    };
    if (first < n_tiles) stream_in(first, 0);
    cp_async_commit();

    float dk[D / 8][4], dv[D / 8][4];
    #pragma unroll
    for (int nd = 0; nd < D / 8; ++nd)
        #pragma unroll
        for (int i = 0; i < 4; ++i) dk[nd][i] = dv[nd][i] = 0.0f;

    for (int it = first; it < n_tiles; ++it) {
        const int buf = (it - first) % 2;
        if (it + 1 < n_tiles) stream_in(it + 1, 1 - buf);  // tile i+1 flies while tile i is used
        cp_async_commit();
        cp_async_wait<1>();  // tile i (and K, V) landed for this thread ...
        __syncthreads();     // ... and for all (the plain stores of LSE and Delta too)
        const __nv_bfloat16 *Qt = Qs + buf * B_TILE * ROW, *dOt = dOs + buf * B_TILE * ROW;
        const float *lse_t = lse_s + buf * B_TILE, *delta_t = delta_s + buf * B_TILE;
        const int q0 = it * B_TILE;

        float p[B_TILE / 8][4];  // S^T, then P^T, then dS^T (keys are rows, queries columns)
        rows_times_rows<D>(p, Ks, warp * 16, Qt);
        #pragma unroll
        for (int nt = 0; nt < B_TILE / 8; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i)  // value i of n-tile nt is query q0 + nt * 8 + 2t + i % 2
                p[nt][i] = fast_exp2(fmaf(p[nt][i], scale_log2, -lse_t[nt * 8 + 2 * t + (i & 1)]));
        if (causal && q0 < wkey0 + 15) {  // a tile that crosses the diagonal: P = 0 where key > query
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int first = wkey0 + g + 8 * h - q0 - 2 * t;  // the first visible nt * 8 + c
                #pragma unroll
                for (int nt = 0; nt < B_TILE / 8; ++nt)
                    #pragma unroll
                    for (int c = 0; c < 2; ++c)
                        if (nt * 8 + c < first) p[nt][2 * h + c] = 0.0f;
            }
        }
        unsigned pa[B_TILE / 16][4];  // P^T in bf16: half the registers of p, which dies here
        c_to_a(pa, p);
        a_times_tile<D>(dv, pa, dOt);  // dV += P^T dO

        float ds[B_TILE / 8][4];  // dP^T = V dO^T, then dS^T = P^T (dP^T - Delta) in place
        rows_times_rows<D>(ds, Vs, warp * 16, dOt);
        #pragma unroll
        for (int nt = 0; nt < B_TILE / 8; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                ds[nt][i] = a_value(pa, nt, i) * (ds[nt][i] - delta_t[nt * 8 + 2 * t + (i & 1)]);
        c_times_tile<D>(dk, ds, Qt);  // dK += dS^T Q (scaled at the end)
        __syncthreads();  // WAR: the next iteration's copies overwrite the buffer read here
    }
    cp_async_wait<0>();

    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = wkey0 + g + 8 * h;
        if (key >= Nk) continue;
        __nv_bfloat16* dk_row = dK + (bh * Nk + key) * D;
        __nv_bfloat16* dv_row = dV + (bh * Nk + key) * D;
        #pragma unroll
        for (int nd = 0; nd < D / 8; ++nd) {
            *reinterpret_cast<unsigned*>(dk_row + nd * 8 + 2 * t) =
                pack_bf16(dk[nd][2 * h] * scale, dk[nd][2 * h + 1] * scale);
            *reinterpret_cast<unsigned*>(dv_row + nd * 8 + 2 * t) = pack_bf16(dv[nd][2 * h], dv[nd][2 * h + 1]);
        }
    }
}

template <int D>
__global__ void __launch_bounds__(THREADS, 2)
dq_kernel(const __nv_bfloat16* __restrict__ Q, const __nv_bfloat16* __restrict__ K,
          const __nv_bfloat16* __restrict__ V, const __nv_bfloat16* __restrict__ dO,
          const float* __restrict__ LSE, const float* __restrict__ Delta,
          __nv_bfloat16* __restrict__ dQ, int Nq, int Nk, float scale, int causal) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // B_ROWS x D
    constexpr int ROW = Config<D>::ROW;                                // elements per tile row
    __nv_bfloat16* dOs = Qs + B_ROWS * ROW;                            // B_ROWS x D
    __nv_bfloat16* Ks = dOs + B_ROWS * ROW;                            // 2 x B_TILE x D
    __nv_bfloat16* Vs = Ks + 2 * B_TILE * ROW;                         // 2 x B_TILE x D

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const size_t bh = (size_t)blockIdx.z * gridDim.y + blockIdx.y;
    const int row0 = (gridDim.x - 1 - blockIdx.x) * B_ROWS, wrow0 = row0 + warp * 16;
    const __nv_bfloat16 *Kb = K + bh * Nk * D, *Vb = V + bh * Nk * D;
    const float scale_log2 = scale * LOG2E;
    const int last_row = min(row0 + B_ROWS, Nq) - 1;
    const int n_tiles = causal ? min((Nk + B_TILE - 1) / B_TILE, last_row / B_TILE + 1)
                               : (Nk + B_TILE - 1) / B_TILE;

    copy_tile<D, B_ROWS>(Qs, Q + bh * Nq * D, row0, Nq);
    copy_tile<D, B_ROWS>(dOs, dO + bh * Nq * D, row0, Nq);
    copy_tile<D, B_TILE>(Ks, Kb, 0, Nk);
    copy_tile<D, B_TILE>(Vs, Vb, 0, Nk);
    cp_async_commit();
    float lse2[2], delta[2];  // the lane's two rows: LSE * log2(e) (+inf if no key) and Delta
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = wrow0 + g + 8 * h;
        const float v = row < Nq ? LSE[bh * Nq + row] : neg_inf();
        lse2[h] = v == neg_inf() ? -neg_inf() : v * LOG2E;
        delta[h] = row < Nq ? Delta[bh * Nq + row] : 0.0f;
    }
    float dq[D / 8][4];
    #pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) dq[nd][0] = dq[nd][1] = dq[nd][2] = dq[nd][3] = 0.0f;

    for (int jt = 0; jt < n_tiles; ++jt) {
        const int buf = jt % 2;
        if (jt + 1 < n_tiles) {
            copy_tile<D, B_TILE>(Ks + (1 - buf) * B_TILE * ROW, Kb, (jt + 1) * B_TILE, Nk);
            copy_tile<D, B_TILE>(Vs + (1 - buf) * B_TILE * ROW, Vb, (jt + 1) * B_TILE, Nk);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const __nv_bfloat16 *Kt = Ks + buf * B_TILE * ROW, *Vt = Vs + buf * B_TILE * ROW;
        const int key0 = jt * B_TILE;

        float p[B_TILE / 8][4];  // S, then P, then dS
        rows_times_rows<D>(p, Qs, warp * 16, Kt);
        #pragma unroll
        for (int nt = 0; nt < B_TILE / 8; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) p[nt][i] = fast_exp2(fmaf(p[nt][i], scale_log2, -lse2[i / 2]));
        if (key0 + B_TILE > Nk || (causal && key0 + B_TILE - 1 > wrow0)) {  // as in the forward
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                int last = Nk - 1 - key0 - 2 * t;
                if (causal) last = min(last, wrow0 + g + 8 * h - key0 - 2 * t);
                #pragma unroll
                for (int nt = 0; nt < B_TILE / 8; ++nt)
                    #pragma unroll
                    for (int c = 0; c < 2; ++c)
                        if (nt * 8 + c > last) p[nt][2 * h + c] = 0.0f;
            }
        }
        float dp[B_TILE / 8][4];  // dP = dO V^T
        rows_times_rows<D>(dp, dOs, warp * 16, Vt);
        #pragma unroll
        for (int nt = 0; nt < B_TILE / 8; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) p[nt][i] *= dp[nt][i] - delta[i / 2];
        c_times_tile<D>(dq, p, Kt);  // dQ += dS K (scaled at the end)
        __syncthreads();
    }
    cp_async_wait<0>();

    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = wrow0 + g + 8 * h;
        if (row >= Nq) continue;
        __nv_bfloat16* out = dQ + (bh * Nq + row) * D;
        #pragma unroll
        for (int nd = 0; nd < D / 8; ++nd)
            *reinterpret_cast<unsigned*>(out + nd * 8 + 2 * t) = pack_bf16(dq[nd][2 * h] * scale, dq[nd][2 * h + 1] * scale);
    }
}


// ---------------------------------------------------------------------------------------------
// Backward with atomic dQ, in one pass (FlashAttention-2's way: 5 products per pair of tiles, not
// 7). A block owns A_ROWS = 128 keys and walks the query tiles i (64 queries) as dkdv_kernel
// does, but its 8 warps split each product of a tile differently, so that every fragment loaded
// from shared memory feeds two mma (one m-tile of 16 keys per warp fed one: the Nsight Compute
// profile in lecture 10's lab notes):
//   * S^T = K Q^T and dP^T = V dO^T (128 keys x 64 queries): warp w computes keys 32 (w % 4) ..
//     x queries 32 (w / 4) .., two m-tiles by four n-tiles; then P^T and dS^T on them;
//   * both go into shared tiles (bf16, 128 keys x 64 queries, swizzled as the others); barrier;
//   * dV += P^T dO and dK += dS^T Q: warp w owns keys 32 (w % 4) .. x columns (D / 2)(w / 4) ..
//     of dV and dK, its A fragments read from the P^T and dS^T tiles;
//   * dQ_i += dS K over the block's 128 keys: warp w computes queries 32 (w / 4) .. x columns
//     (D / 4)(w % 4) .., its A fragments (dS) read from the dS^T tile with ldmatrix.trans
//     (queries are the tile's columns), its B fragments K's rows, as V's rows in O = P V;
//   * and adds them into a float32 accumulator in global memory, two at a time (float2
//     atomicAdd, compiled to a RED instruction that does not wait for an answer). The Nk / 128
//     key blocks of a head add into the same rows in no fixed order: float addition is not
//     associative, so the last bits of dQ may change from run to run.
// A last kernel, convert_dq, writes dQ = scale * accumulator in bf16.
// The accumulator traffic: Nq x D x 4 bytes per key block of 128, about a gigabyte per head at
// N = 16k, d = 128, in the L2 (which performs the adds): 128 keys per block (not 64) halves it.
// ---------------------------------------------------------------------------------------------
constexpr int A_WARPS = 8, A_THREADS = 32 * A_WARPS;
constexpr int A_ROWS = 128;           // keys per block: 4 groups of 32, two warps each
constexpr int A_BUFS = 2;             // Q_i, dO_i, LSE and Delta buffers
// the dV, dK loop over a tile's 4 query chunks: unrolled on sm_90; not elsewhere, where ptxas
// (CUDA 13, sm_80) spilled 72 bytes at D = 128 with it unrolled
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr int DKDV_UNROLL = 4;
#else
constexpr int DKDV_UNROLL = 1;
#endif

// A fragments (16 queries x 16 keys) of dS, from the dS^T tile [keys][B_TILE queries]:
// ldmatrix.trans of 8 x 8 blocks whose stored rows are keys; matrix i holds keys
// k0 + (i / 2) * 8 .., queries q0 + (i % 2) * 8 .. (a0: queries 0-7 x keys 0-7, a1: queries
// 8-15, a2: keys 8-15, a3: both)
__device__ __forceinline__ void load_a_transposed(unsigned (&a)[4], const __nv_bfloat16* dsT, int q0,
                                                  int k0) {
    const int lane = threadIdx.x % 32, j8 = lane / 8, r8 = lane % 8;
    ldmatrix_x4_trans(a, dsT + swizzle<B_TILE>(k0 + (j8 / 2) * 8 + r8, q0 + (j8 % 2) * 8));
}

// c[m][j] and c[m][j + 1] += A fragment a[m] times the B fragments b of two 8-column n-tiles
// (one ldmatrix.x4), for both m-tiles m: each B fragment feeds two mma
template <int N>
__device__ __forceinline__ void mma_two_mtiles(float (&c)[2][N][4], int j, const unsigned (&a)[2][4],
                                               const unsigned (&b)[4]) {
    #pragma unroll
    for (int m = 0; m < 2; ++m) {
        mma_bf16(c[m][j], a[m], b[0], b[1]);
        mma_bf16(c[m][j + 1], a[m], b[2], b[3]);
    }
}

// acc (32 x 32: two m-tiles by four n-tiles) += rows r0 .. r0 + 31 of A times rows c0 .. c0 + 31
// of B, transposed, over columns 16 kc .. 16 kc + 15 of both (swizzled [rows][D] tiles): one
// k-step of S^T = K Q^T or dP^T = V dO^T; each fragment feeds two mma
template <int D>
__device__ __forceinline__ void rows_times_rows_32(float (&acc)[2][4][4], const __nv_bfloat16* A,
                                                   int r0, const __nv_bfloat16* B, int c0, int kc) {
    unsigned a[2][4], b[2][4];
    #pragma unroll
    for (int m = 0; m < 2; ++m) load_a<D>(a[m], A, r0 + 16 * m, kc);
    #pragma unroll
    for (int np = 0; np < 2; ++np) load_b_rows<D>(b[np], B, c0 + 16 * np, kc);
    #pragma unroll
    for (int m = 0; m < 2; ++m)
        #pragma unroll
        for (int np = 0; np < 2; ++np) {
            mma_bf16(acc[m][2 * np], a[m], b[np][0], b[np][1]);
            mma_bf16(acc[m][2 * np + 1], a[m], b[np][2], b[np][3]);
        }
}

// acc[r][c] += x, y at columns c, c + 1 (c even): one 8-byte reduction on sm_90, two before
__device__ __forceinline__ void atomic_add2(float* p, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float2*>(p), make_float2(x, y));
#else
    atomicAdd(p, x);
    atomicAdd(p + 1, y);
#endif
}

template <int D>
__global__ void __launch_bounds__(A_THREADS, 1)
dkdvdq_kernel(const __nv_bfloat16* __restrict__ Q, const __nv_bfloat16* __restrict__ K,
              const __nv_bfloat16* __restrict__ V, const __nv_bfloat16* __restrict__ dO,
              const float* __restrict__ LSE, const float* __restrict__ Delta,
              __nv_bfloat16* __restrict__ dK, __nv_bfloat16* __restrict__ dV,
              float* __restrict__ dQacc, int Nq, int Nk, float scale, int causal) {
    static_assert(D % 64 == 0, "dQ's columns are split in 4 groups of a multiple of 16");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // A_ROWS x D
    __nv_bfloat16* Vs = Ks + A_ROWS * D;                               // A_ROWS x D
    __nv_bfloat16* Qs = Vs + A_ROWS * D;                               // A_BUFS x B_TILE x D
    __nv_bfloat16* dOs = Qs + A_BUFS * B_TILE * D;                     // A_BUFS x B_TILE x D
    __nv_bfloat16* pT = dOs + A_BUFS * B_TILE * D;                     // A_ROWS x B_TILE
    __nv_bfloat16* dsT = pT + A_ROWS * B_TILE;                         // A_ROWS x B_TILE
    float* lse_s = reinterpret_cast<float*>(dsT + A_ROWS * B_TILE);   // A_BUFS x B_TILE
    float* delta_s = lse_s + A_BUFS * B_TILE;                          // A_BUFS x B_TILE

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const size_t bh = (size_t)blockIdx.z * gridDim.y + blockIdx.y;
    const int key0 = blockIdx.x * A_ROWS;
    const __nv_bfloat16 *Qb = Q + bh * Nq * D, *dOb = dO + bh * Nq * D;
    const float *lse_b = LSE + bh * Nq, *delta_b = Delta + bh * Nq;
    float* acc_b = dQacc + bh * Nq * D;
    const float scale_log2 = scale * LOG2E;
    // S^T, dP^T: warp w owns keys ks .. ks + 31 x queries qs .. qs + 31 of the tile
    const int ks = 32 * (warp % 4), qs = 32 * (warp / 4);
    // dV, dK: keys ks .. ks + 31 x columns dc .. dc + D / 2 - 1;  dQ: queries qq .. qq + 31 x
    // columns qc .. qc + D / 4 - 1
    const int dc = (D / 2) * (warp / 4), qq = 32 * (warp / 4), qc = (D / 4) * (warp % 4);

    const int first = causal ? key0 / B_TILE : 0, n_tiles = (Nq + B_TILE - 1) / B_TILE;

    copy_tile<D, A_ROWS, A_THREADS>(Ks, K + bh * Nk * D, key0, Nk);
    copy_tile<D, A_ROWS, A_THREADS>(Vs, V + bh * Nk * D, key0, Nk);
    auto stream_in = [&](int i, int buf) {
        copy_tile<D, B_TILE, A_THREADS>(Qs + buf * B_TILE * D, Qb, i * B_TILE, Nq);
        copy_tile<D, B_TILE, A_THREADS>(dOs + buf * B_TILE * D, dOb, i * B_TILE, Nq);
        copy_row_stats<A_THREADS>(lse_s + buf * B_TILE, lse_b, i * B_TILE, Nq, LOG2E, -neg_inf());
        copy_row_stats<A_THREADS>(delta_s + buf * B_TILE, delta_b, i * B_TILE, Nq, 1.0f, 0.0f);
    };
    if (first < n_tiles) stream_in(first, 0);
    cp_async_commit();

    float dk[2][D / 16][4], dv[2][D / 16][4];  // 32 keys x D / 2 columns each
    #pragma unroll
    for (int m = 0; m < 2; ++m)
        #pragma unroll
        for (int j = 0; j < D / 16; ++j)
            #pragma unroll
            for (int i = 0; i < 4; ++i) dk[m][j][i] = dv[m][j][i] = 0.0f;

    for (int it = first; it < n_tiles; ++it) {
        const int buf = (it - first) % A_BUFS;
        if (it + 1 < n_tiles) stream_in(it + 1, (it + 1 - first) % A_BUFS);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();  // tile i landed for all
        const __nv_bfloat16 *Qt = Qs + buf * B_TILE * D, *dOt = dOs + buf * B_TILE * D;
        const float *lse_t = lse_s + buf * B_TILE, *delta_t = delta_s + buf * B_TILE;
        const int q0 = it * B_TILE;

        // S^T = K Q^T and dP^T = V dO^T on this warp's 32 x 32: each fragment feeds 2 mma
        float p[2][4][4], dp[2][4][4];
        #pragma unroll
        for (int m = 0; m < 2; ++m)
            #pragma unroll
            for (int n = 0; n < 4; ++n)
                #pragma unroll
                for (int i = 0; i < 4; ++i) p[m][n][i] = dp[m][n][i] = 0.0f;
        #pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) {
            rows_times_rows_32<D>(p, Ks, ks, Qt, qs, kc);
            rows_times_rows_32<D>(dp, Vs, ks, dOt, qs, kc);
        }
        // P^T, dS^T: value i of n-tile n of m-tile m is key ks + 16 m + g + 8 (i / 2), query
        // qs + 8 n + 2 t + i % 2 of the tile
        const bool edge = (causal && q0 + qs < key0 + ks + 31) || key0 + ks + 32 > Nk;
        #pragma unroll
        for (int m = 0; m < 2; ++m)
            #pragma unroll
            for (int n = 0; n < 4; ++n)
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int qi = qs + 8 * n + 2 * t + (i & 1);
                    float pv = fast_exp2(fmaf(p[m][n][i], scale_log2, -lse_t[qi]));
                    if (edge) {
                        const int key = key0 + ks + 16 * m + g + 8 * (i / 2);
                        if (key >= Nk || (causal && key > q0 + qi)) pv = 0.0f;
                    }
                    p[m][n][i] = pv;
                    dp[m][n][i] = pv * (dp[m][n][i] - delta_t[qi]);
                }
        // both into their shared tiles (bf16), rows = keys, as A operands of dV and dK
        #pragma unroll
        for (int m = 0; m < 2; ++m)
            #pragma unroll
            for (int n = 0; n < 4; ++n)
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int at = swizzle<B_TILE>(ks + 16 * m + g + 8 * h, qs + 8 * n + 2 * t);
                    *reinterpret_cast<unsigned*>(pT + at) = pack_bf16(p[m][n][2 * h], p[m][n][2 * h + 1]);
                    *reinterpret_cast<unsigned*>(dsT + at) = pack_bf16(dp[m][n][2 * h], dp[m][n][2 * h + 1]);
                }
        __syncthreads();  // P^T and dS^T of the whole block are in shared memory

        // dV += P^T dO and dK += dS^T Q: keys ks .. + 31, columns dc .. + D / 2 - 1, over the
        // tile's 64 queries
        #pragma unroll (DKDV_UNROLL)
        for (int kc = 0; kc < B_TILE / 16; ++kc) {
            unsigned ap[2][4], as[2][4];
            #pragma unroll
            for (int m = 0; m < 2; ++m) {
                load_a<B_TILE>(ap[m], pT, ks + 16 * m, kc);
                load_a<B_TILE>(as[m], dsT, ks + 16 * m, kc);
            }
            #pragma unroll
            for (int nd = 0; nd < D / 32; ++nd) {
                unsigned b[4];
                load_b_cols<D>(b, dOt, kc * 16, dc / 16 + nd);
                mma_two_mtiles(dv, 2 * nd, ap, b);
                load_b_cols<D>(b, Qt, kc * 16, dc / 16 + nd);
                mma_two_mtiles(dk, 2 * nd, as, b);
            }
        }

        // dQ_i += dS K: queries qq .. + 31, columns qc .. + D / 4 - 1, over the block's 128 keys
        float dq[2][D / 32][4];
        #pragma unroll
        for (int m = 0; m < 2; ++m)
            #pragma unroll
            for (int j = 0; j < D / 32; ++j) dq[m][j][0] = dq[m][j][1] = dq[m][j][2] = dq[m][j][3] = 0.0f;
        #pragma unroll 2
        for (int kc = 0; kc < A_ROWS / 16; ++kc) {
            unsigned a[2][4];
            #pragma unroll
            for (int m = 0; m < 2; ++m) load_a_transposed(a[m], dsT, qq + 16 * m, kc * 16);
            #pragma unroll
            for (int nd = 0; nd < D / 64; ++nd) {
                unsigned b[4];
                load_b_cols<D>(b, Ks, kc * 16, qc / 16 + nd);
                mma_two_mtiles(dq, 2 * nd, a, b);
            }
        }
        #pragma unroll
        for (int m = 0; m < 2; ++m)
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = q0 + qq + 16 * m + g + 8 * h;
                if (row < Nq) {
                    float* out = acc_b + (size_t)row * D + qc + 2 * t;
                    #pragma unroll
                    for (int j = 0; j < D / 32; ++j) atomic_add2(out + j * 8, dq[m][j][2 * h], dq[m][j][2 * h + 1]);
                }
            }
        __syncthreads();  // WAR: the next tile's copies, P^T and dS^T overwrite what was read here
    }
    cp_async_wait<0>();

    #pragma unroll
    for (int m = 0; m < 2; ++m)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int key = key0 + ks + 16 * m + g + 8 * h;
            if (key >= Nk) continue;
            __nv_bfloat16* dk_row = dK + (bh * Nk + key) * D + dc;
            __nv_bfloat16* dv_row = dV + (bh * Nk + key) * D + dc;
            #pragma unroll
            for (int j = 0; j < D / 16; ++j) {
                *reinterpret_cast<unsigned*>(dk_row + j * 8 + 2 * t) =
                    pack_bf16(dk[m][j][2 * h] * scale, dk[m][j][2 * h + 1] * scale);
                *reinterpret_cast<unsigned*>(dv_row + j * 8 + 2 * t) = pack_bf16(dv[m][j][2 * h], dv[m][j][2 * h + 1]);
            }
        }
}

// dQ = scale * accumulator, in bf16: four elements a thread (n is a multiple of 4: D is)
__global__ void convert_dq(const float4* __restrict__ acc, __nv_bfloat16* __restrict__ dQ,
                           size_t n4, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n4;
         i += (size_t)gridDim.x * blockDim.x) {
        const float4 a = acc[i];
        uint2 out;
        out.x = pack_bf16(a.x * scale, a.y * scale);
        out.y = pack_bf16(a.z * scale, a.w * scale);
        reinterpret_cast<uint2*>(dQ)[i] = out;
    }
}

}  // namespace fa_mma

#ifdef FA_KERNEL_ONLY
// Compile-only reports without torch's headers (nvcc -DFA_KERNEL_ONLY: seconds instead of ~25 s):
// instantiate every kernel the host code below launches, for both head dims.
#define FA_MMA_INSTANTIATE(D)                                                                       \
    template __global__ void fa_mma::flash_attention_mma_kernel<D>(                                 \
        const __nv_bfloat16* __restrict__, const __nv_bfloat16* __restrict__,                      \
        const __nv_bfloat16* __restrict__, __nv_bfloat16* __restrict__, float* __restrict__, int,  \
        int, float, int);                                                                          \
    template __global__ void fa_mma::dkdv_kernel<D>(                                                \
        const __nv_bfloat16* __restrict__, const __nv_bfloat16* __restrict__,                      \
        const __nv_bfloat16* __restrict__, const __nv_bfloat16* __restrict__,                      \
        const float* __restrict__, const float* __restrict__, __nv_bfloat16* __restrict__,         \
        __nv_bfloat16* __restrict__, int, int, float, int);                                        \
    template __global__ void fa_mma::dq_kernel<D>(                                                  \
        const __nv_bfloat16* __restrict__, const __nv_bfloat16* __restrict__,                      \
        const __nv_bfloat16* __restrict__, const __nv_bfloat16* __restrict__,                      \
        const float* __restrict__, const float* __restrict__, __nv_bfloat16* __restrict__, int,    \
        int, float, int);
#define FA_MMA_INSTANTIATE_ATOMIC(D)                                                               \
    template __global__ void fa_mma::dkdvdq_kernel<D>(                                              \
        const __nv_bfloat16* __restrict__, const __nv_bfloat16* __restrict__,                      \
        const __nv_bfloat16* __restrict__, const __nv_bfloat16* __restrict__,                      \
        const float* __restrict__, const float* __restrict__, __nv_bfloat16* __restrict__,         \
        __nv_bfloat16* __restrict__, float* __restrict__, int, int, float, int);
FA_MMA_INSTANTIATE(64)
FA_MMA_INSTANTIATE(96)
FA_MMA_INSTANTIATE(128)
FA_MMA_INSTANTIATE_ATOMIC(64)
FA_MMA_INSTANTIATE_ATOMIC(128)
#endif

#if !defined(__CUDACC_RTC__) && !defined(FA_KERNEL_ONLY)
static void check_launch(const char* what) {
    const cudaError_t err = cudaGetLastError();
    TORCH_CHECK(err == cudaSuccess, what, ": launch failed: ", cudaGetErrorString(err));
}

template <int D>
static void launch_flash_mma(const torch::Tensor& Q, const torch::Tensor& K, const torch::Tensor& V,
                             torch::Tensor& O, torch::Tensor& LSE, int Nq, int Nk, int H, int B,
                             float scale, bool causal) {
    using namespace fa_mma;
    constexpr int BR = 16 * Config<D>::MT * WARPS, BC = Config<D>::BC;
    constexpr int SMEM = (BR + 2 * BC) * Config<D>::ROW * 2;  // Q, K and V tiles, bf16
    auto kernel = flash_attention_mma_kernel<D>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
    dim3 grid((Nq + BR - 1) / BR, H, B);
    kernel<<<grid, THREADS, SMEM, c10::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const __nv_bfloat16*>(Q.data_ptr()),
        reinterpret_cast<const __nv_bfloat16*>(K.data_ptr()),
        reinterpret_cast<const __nv_bfloat16*>(V.data_ptr()),
        reinterpret_cast<__nv_bfloat16*>(O.data_ptr()), LSE.data_ptr<float>(), Nq, Nk, scale,
        causal ? 1 : 0);
    check_launch("flash_attention_mma");
}

// What every entry point checks: bf16, 4D, contiguous, 16-byte aligned CUDA tensors on one GPU,
// K and V alike, Q and K agreeing in B, H and D, and D = 64, 96 or 128.
static void check_qkv(const char* fn, const torch::Tensor& Q, const torch::Tensor& K,
                      const torch::Tensor& V) {
    for (const auto* X : {&Q, &K, &V}) {
        TORCH_CHECK(X->is_cuda(), fn, ": Q, K and V must be CUDA tensors");
        TORCH_CHECK(X->scalar_type() == torch::kBFloat16,
                    fn, ": Q, K and V must be bfloat16 (call .bfloat16())");
        TORCH_CHECK(X->dim() == 4, fn, ": Q, K and V must be 4D (B, H, N, D)");
        TORCH_CHECK(X->is_contiguous(), fn, ": Q, K and V must be contiguous (call .contiguous())");
        TORCH_CHECK(reinterpret_cast<uintptr_t>(X->data_ptr()) % 16 == 0,
                    fn, ": Q, K and V must start on a 16-byte boundary (a view that starts "
                    "mid-row is not: call .clone())");
    }
    TORCH_CHECK(Q.device() == K.device() && Q.device() == V.device(),
                fn, ": Q, K and V must be on the same GPU");
    TORCH_CHECK(K.sizes() == V.sizes(), fn, ": K and V must have the same shape");
    TORCH_CHECK(Q.size(0) == K.size(0) && Q.size(1) == K.size(1) && Q.size(3) == K.size(3),
                fn, ": Q and K must agree in B, H and D");
    const int64_t D = Q.size(3);
    TORCH_CHECK(D == 64 || D == 96 || D == 128, fn, ": head dim D must be 64, 96 or 128, got ",
                std::to_string(D));
    TORCH_CHECK(Q.size(0) <= 65535 && Q.size(1) <= 65535,
                fn, ": B and H must be at most 65535 (grid y and z); split the batch");
}

// O, LSE = attention(Q, K, V) on tensor cores. Q (B, H, Nq, D), K and V (B, H, Nk, D): bf16,
// contiguous, on one GPU, D = 64, 96 or 128.
std::vector<torch::Tensor> flash_attention_mma(torch::Tensor Q, torch::Tensor K, torch::Tensor V,
                                               bool causal) {
    check_qkv("flash_attention_mma", Q, K, V);
    const int64_t B = Q.size(0), H = Q.size(1), Nq = Q.size(2), Nk = K.size(2), D = Q.size(3);
    auto O = torch::empty_like(Q);
    auto LSE = torch::empty({B, H, Nq}, Q.options().dtype(torch::kFloat));
    if (B == 0 || H == 0 || Nq == 0) return {O, LSE};
    if (Nk == 0) return {O.zero_(), LSE.fill_(-INFINITY)};
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    if (D == 64) launch_flash_mma<64>(Q, K, V, O, LSE, Nq, Nk, H, B, scale, causal);
    else if (D == 96) launch_flash_mma<96>(Q, K, V, O, LSE, Nq, Nk, H, B, scale, causal);
    else launch_flash_mma<128>(Q, K, V, O, LSE, Nq, Nk, H, B, scale, causal);
    return {O, LSE};
}

template <int D>
static void launch_backward(const torch::Tensor& Q, const torch::Tensor& K, const torch::Tensor& V,
                            const torch::Tensor& dO, const torch::Tensor& LSE,
                            const torch::Tensor& Delta, torch::Tensor& dQ, torch::Tensor& dK,
                            torch::Tensor& dV, float scale, bool causal) {
    using namespace fa_mma;
    const int B = Q.size(0), H = Q.size(1), Nq = Q.size(2), Nk = K.size(2);
    const auto stream = c10::cuda::getCurrentCUDAStream();
    auto bf = [](const torch::Tensor& X) { return reinterpret_cast<const __nv_bfloat16*>(X.data_ptr()); };
    auto bf_out = [](torch::Tensor& X) { return reinterpret_cast<__nv_bfloat16*>(X.data_ptr()); };
    {   // dK, dV: one block per 64 keys
        constexpr int SMEM = (2 * B_ROWS + 4 * B_TILE) * Config<D>::ROW * 2 + 4 * B_TILE * 4;
        auto kernel = dkdv_kernel<D>;
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
        dim3 grid((Nk + B_ROWS - 1) / B_ROWS, H, B);
        kernel<<<grid, THREADS, SMEM, stream>>>(bf(Q), bf(K), bf(V), bf(dO), LSE.data_ptr<float>(),
                                                Delta.data_ptr<float>(), bf_out(dK), bf_out(dV),
                                                Nq, Nk, scale, causal ? 1 : 0);
        check_launch("flash_attention_mma_backward (dK, dV)");
    }
    {   // dQ: one block per 64 queries
        constexpr int SMEM = (2 * B_ROWS + 4 * B_TILE) * Config<D>::ROW * 2;
        auto kernel = dq_kernel<D>;
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
        dim3 grid((Nq + B_ROWS - 1) / B_ROWS, H, B);
        kernel<<<grid, THREADS, SMEM, stream>>>(bf(Q), bf(K), bf(V), bf(dO), LSE.data_ptr<float>(),
                                                Delta.data_ptr<float>(), bf_out(dQ), Nq, Nk, scale,
                                                causal ? 1 : 0);
        check_launch("flash_attention_mma_backward (dQ)");
    }
}

// What both backward entry points check, past check_qkv: O and dO like Q, LSE the forward's.
static void check_backward(const char* fn, const torch::Tensor& Q, const torch::Tensor& K,
                           const torch::Tensor& V, const torch::Tensor& O, const torch::Tensor& dO,
                           const torch::Tensor& LSE) {
    check_qkv(fn, Q, K, V);
    for (const auto* X : {&O, &dO}) {
        TORCH_CHECK(X->sizes() == Q.sizes(), fn, ": O and dO must have Q's shape (B, H, Nq, D)");
        TORCH_CHECK(X->scalar_type() == torch::kBFloat16 && X->is_cuda() && X->device() == Q.device(),
                    fn, ": O and dO must be bfloat16 tensors on Q's GPU");
        TORCH_CHECK(X->is_contiguous() && reinterpret_cast<uintptr_t>(X->data_ptr()) % 16 == 0,
                    fn, ": O and dO must be contiguous and 16-byte aligned (call .contiguous())");
    }
    TORCH_CHECK(LSE.scalar_type() == torch::kFloat && LSE.device() == Q.device() &&
                LSE.is_contiguous(), fn, ": LSE must be the forward's contiguous float32 LSE");
    TORCH_CHECK(LSE.dim() == 3 && LSE.size(0) == Q.size(0) && LSE.size(1) == Q.size(1) &&
                LSE.size(2) == Q.size(2), fn, ": LSE must have shape (B, H, Nq)");
}

// Delta = rowsum(dO * O), float32 (B, H, Nq)
static torch::Tensor backward_delta(const torch::Tensor& O, const torch::Tensor& dO) {
    auto Delta = torch::empty({O.size(0), O.size(1), O.size(2)}, O.options().dtype(torch::kFloat));
    const int rows = O.size(0) * O.size(1) * O.size(2);
    fa_mma::delta_kernel<<<(rows + 7) / 8, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const __nv_bfloat16*>(O.data_ptr()),
        reinterpret_cast<const __nv_bfloat16*>(dO.data_ptr()), Delta.data_ptr<float>(), rows,
        O.size(3));
    check_launch("flash_attention_mma_backward (Delta)");
    return Delta;
}

// dQ, dK, dV of attention on tensor cores, from the forward's O and LSE and the gradient dO of
// O. Deterministic: no atomics, the same bits every run.
std::vector<torch::Tensor> flash_attention_mma_backward(torch::Tensor Q, torch::Tensor K,
                                                        torch::Tensor V, torch::Tensor O,
                                                        torch::Tensor dO, torch::Tensor LSE,
                                                        bool causal) {
    check_backward("flash_attention_mma_backward", Q, K, V, O, dO, LSE);
    const int64_t B = Q.size(0), H = Q.size(1), Nq = Q.size(2), Nk = K.size(2), D = Q.size(3);
    auto dQ = torch::empty_like(Q), dK = torch::empty_like(K), dV = torch::empty_like(V);
    if (B == 0 || H == 0) return {dQ, dK, dV};
    if (Nq == 0 || Nk == 0) return {dQ.zero_(), dK.zero_(), dV.zero_()};
    auto Delta = backward_delta(O, dO);
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    if (D == 64) launch_backward<64>(Q, K, V, dO, LSE, Delta, dQ, dK, dV, scale, causal);
    else if (D == 96) launch_backward<96>(Q, K, V, dO, LSE, Delta, dQ, dK, dV, scale, causal);
    else launch_backward<128>(Q, K, V, dO, LSE, Delta, dQ, dK, dV, scale, causal);
    return {dQ, dK, dV};
}

template <int D>
static void launch_backward_atomic(const torch::Tensor& Q, const torch::Tensor& K,
                                   const torch::Tensor& V, const torch::Tensor& dO,
                                   const torch::Tensor& LSE, const torch::Tensor& Delta,
                                   torch::Tensor& dQacc, torch::Tensor& dK, torch::Tensor& dV,
                                   float scale, bool causal) {
    using namespace fa_mma;
    const int B = Q.size(0), H = Q.size(1), Nq = Q.size(2), Nk = K.size(2);
    auto bf = [](const torch::Tensor& X) { return reinterpret_cast<const __nv_bfloat16*>(X.data_ptr()); };
    auto bf_out = [](torch::Tensor& X) { return reinterpret_cast<__nv_bfloat16*>(X.data_ptr()); };
    // K, V; A_BUFS buffers of Q and dO; the P^T and dS^T tiles; A_BUFS of LSE and Delta
    constexpr int SMEM = (2 * A_ROWS * D + 2 * A_BUFS * B_TILE * D + 2 * A_ROWS * B_TILE) * 2 +
                         2 * A_BUFS * B_TILE * 4;
    int device = 0, optin = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    TORCH_CHECK(optin >= SMEM, "flash_attention_mma_backward_atomic: at D = ", D, " a block needs ",
                SMEM / 1024, " KiB of shared memory and this GPU gives ", optin / 1024,
                " KiB (an A100 or H100 has enough): use flash_attention_mma_backward");
    auto kernel = dkdvdq_kernel<D>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
    dim3 grid((Nk + A_ROWS - 1) / A_ROWS, H, B);
    kernel<<<grid, A_THREADS, SMEM, c10::cuda::getCurrentCUDAStream()>>>(
        bf(Q), bf(K), bf(V), bf(dO), LSE.data_ptr<float>(), Delta.data_ptr<float>(), bf_out(dK),
        bf_out(dV), dQacc.data_ptr<float>(), Nq, Nk, scale, causal ? 1 : 0);
    check_launch("flash_attention_mma_backward_atomic (dK, dV, dQ)");
}

// The same gradients in one pass over the key blocks, FlashAttention-2's way: 5 products per
// pair of tiles instead of 7, dQ added into a float32 accumulator with atomics. The last bits of
// dQ may differ between two runs (the adds come in no fixed order); dK and dV do not.
std::vector<torch::Tensor> flash_attention_mma_backward_atomic(torch::Tensor Q, torch::Tensor K,
                                                               torch::Tensor V, torch::Tensor O,
                                                               torch::Tensor dO, torch::Tensor LSE,
                                                               bool causal) {
    check_backward("flash_attention_mma_backward_atomic", Q, K, V, O, dO, LSE);
    TORCH_CHECK(Q.size(3) != 96, "flash_attention_mma_backward_atomic: built for D = 64 and 128 "
                "(its warps split dQ's columns in 4 groups of a multiple of 16); at D = 96 use "
                "flash_attention_mma_backward");
    const int64_t B = Q.size(0), H = Q.size(1), Nq = Q.size(2), Nk = K.size(2), D = Q.size(3);
    auto dQ = torch::empty_like(Q), dK = torch::empty_like(K), dV = torch::empty_like(V);
    if (B == 0 || H == 0) return {dQ, dK, dV};
    if (Nq == 0 || Nk == 0) return {dQ.zero_(), dK.zero_(), dV.zero_()};
    auto Delta = backward_delta(O, dO);
    auto dQacc = torch::zeros(Q.sizes(), Q.options().dtype(torch::kFloat));
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    if (D == 64) launch_backward_atomic<64>(Q, K, V, dO, LSE, Delta, dQacc, dK, dV, scale, causal);
    else launch_backward_atomic<128>(Q, K, V, dO, LSE, Delta, dQacc, dK, dV, scale, causal);
    const size_t n4 = static_cast<size_t>(dQ.numel()) / 4;
    const int blocks = static_cast<int>(std::min<size_t>((n4 + 255) / 256, 4096));
    fa_mma::convert_dq<<<blocks, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const float4*>(dQacc.data_ptr<float>()),
        reinterpret_cast<__nv_bfloat16*>(dQ.data_ptr()), n4, scale);
    check_launch("flash_attention_mma_backward_atomic (dQ)");
    return {dQ, dK, dV};
}
#endif
