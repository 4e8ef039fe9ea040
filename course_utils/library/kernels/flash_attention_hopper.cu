// FlashAttention forward for Hopper (sm_90a): TMA copies, wgmma, warp specialization. Chapter 14.
//
// Shapes (row-major, contiguous): Q (B, H, Nq, D), K and V (B, H, Nk, D), bf16; O (B, H, Nq, D)
// bf16; LSE (B, H, Nq) float32 (natural log). D is 64 or 128 (every variant), 96 (variants 3, 4,
// 6, 7: d = 128's tiles on padded columns, DP), or 192 or 256 (variants 3 and 6, with shorter key
// tiles: WIDE_BN). Causal is top-left aligned, as in
// chapters 07 and 10 and torch's is_causal (key c is masked for query r when c > r), also when
// Nq != Nk; FlashAttention-2 (from 2.1) and FlashAttention-3 align it bottom-right (c masked when
// c > r + Nk - Nq). The two agree when Nq == Nk.
//
// One block computes BLOCK_M = 128 query rows of one head with 3 warpgroups of 128 threads
// (variant 5: 192 rows, 4 warpgroups, three consumers):
//   * warpgroup 0, the producer: one thread issues the TMA copies. Q once, then K(j) and V(j)
//     into a ring of STAGES buffers. Each buffer has a "full" mbarrier (the copy landed: TMA
//     counts the bytes) and an "empty" one (both consumers are done reading it). The producer
//     gives most of its registers away (setmaxnreg.dec) since it only computes addresses.
//   * warpgroups 1 and 2, the consumers: 64 query rows each. S = Q K(j)^T is one wgmma chain
//     (m64 n128 k16, A and B read from shared memory), the online softmax runs on S in
//     registers, O += P V(j) is a second chain with P as the A operand straight from registers.
// Shared tiles are written by TMA with the 128-byte swizzle: a tile of R rows x D columns is
// stored as D / 64 column panels of R rows x 64 bf16 (128 bytes a row), and within each group of
// 8 rows the 16-byte chunk c of row r sits at chunk c ^ (r % 8). wgmma reads the same layout
// through a matrix descriptor (start address, the byte distances between 8-row groups and
// between panels, and the swizzle mode), so no thread ever moves a tile element itself.
//
// The ladder of chapter 14 is the template flags:
//   PINGPONG  the two consumers take turns on the tensor cores (named barriers 1 and 2): while
//             one warpgroup runs its softmax, the other's matmuls run. Without OVERLAP a turn is
//             one product, two turns a key block (variant 1, slower than none on an H100); with
//             it a turn issues S(j) and P(j - 1) V(j - 1) together, one turn a key block, as
//             FlashAttention-3's warp_scheduler_barrier_sync / _arrive (variant 3 on).
//   OVERLAP   inside one warpgroup, S(j + 1) = Q K(j + 1)^T is issued before the softmax of
//             S(j) and O += P(j) V(j) runs under it: the exp units and the tensor cores work
//             at the same time.
//   PERSIST   one block per SM takes query tile after query tile, and the loop runs across
//             them: the next tile's first S is issued with this tile's last P V, and this
//             tile's O is stored under it (no block launch, Q wait or epilogue between tiles).
//
// -DFA_TIMELINE builds the clock of chapter 14's "a clock inside the kernel": for every block of
// the one-tile-a-block variants (0-5), consumer 0's first thread writes the SM it ran on and the
// SM's cycle counter (%clock64) at four points of its tile: before it waits for its Q rows, when
// they have landed, when its last O += P V has completed, when its O stores are issued.
// flash_attention_hopper_timeline returns them as a table. The timed build has no trace of it.
// (Computing only the keys left in a short last block, with m64n64 / m64n128 products there, was
// tried: the extra copies of the step made ptxas serialize every wgmma for want of registers,
// its advisory C7511, and the kernel ran 22% slower. Check ptxas -v for C7511 after any change.)

#if !defined(__CUDACC_RTC__) && !defined(FA_KERNEL_ONLY)
// From torch, what this file uses: the Tensor class and one header per operator it calls, under
// the torch:: names of <torch/types.h>. That header has every operator: a compile-only build (no
// GPU) takes about 30 % longer with it. On a GPU, load_inline puts it before this file anyway.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
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

namespace fa_hopper {

#if defined(FA_TIMELINE)
// Row b (the block's linear index) of the host's table: {smid, t0, t1, t2, t3}. Null: no table.
__device__ long long* timeline = nullptr;
#endif

constexpr int CONSUMERS = 2;                  // consumer warpgroups, 64 query rows each
constexpr int BLOCK_M = 64 * CONSUMERS;       // query rows per block
constexpr int BLOCK_N = 128;                  // keys per K or V tile (variant 4: 176)
// K and V buffers in the ring (d = 64: 16 KB of Q + 3 x 32 KB; d = 128: 32 KB + 2 x 64 KB, of
// the 227 KB a block may have). Measured on the H100: a third stage helps d = 64 (its tiles are
// consumed twice as fast), and changes nothing measurable at d = 128. -DFA_STAGES_D64=4 to try.
#ifndef FA_STAGES_D64
#define FA_STAGES_D64 3
#endif
#ifndef FA_STAGES_D128
#define FA_STAGES_D128 2
#endif
template <int D>
constexpr int STAGES = D == 64 ? FA_STAGES_D64 : FA_STAGES_D128;  // d = 192, 256: 2 as well

// The wide heads, d = 192 and 256 (variants 3 and 6 only), take shorter key tiles: a thread's O
// is D / 2 floats (96, 128), and S, P and O must fit the 240 registers a consumer thread gets
// (S: BN / 2 floats, P: BN / 4 pairs), while Q (128 x D) and two stages of K and V (BN x D
// each) fit the 227 KB of shared memory. d = 192: 112 keys, 96 + 56 + 28 registers, 48 KB of Q
// + 2 x 84 KB; d = 256: 80 keys, 128 + 40 + 20 registers, 64 KB + 2 x 80 KB (FlashAttention-3's
// tiles for these head dims). -DFA_BN_D192=96 builds the other width d = 192 allows.
#ifndef FA_BN_D192
#define FA_BN_D192 112
#endif
#ifndef FA_BN_D256
#define FA_BN_D256 80
#endif
template <int D>
constexpr int WIDE_BN = D == 192 ? FA_BN_D192 : FA_BN_D256;

// d = 96: a row of 192 bytes is one and a half 128-byte panels. Shared tiles are DP = 128 columns
// wide: TMA fills columns 96-127 of the second panel with zeros (past the tensor's last column).
// S = Q K^T takes D / 16 = 6 k-steps and never reads them. O += P V reads V MN-major, where the
// 128-byte swizzle's unit is 64 columns, so it runs 128 columns wide: O's columns 96-127 come out
// zero and are not stored, and 1 product in 8 is wasted. The registers are d = 128's (O: 64 a
// thread), and so are the tiles and variants (3, 4, 6, 7).
template <int D>
constexpr int DP = D == 96 ? 128 : D;

// Causal persistent tiles come from the scheduler (tile_counter, in the kernel below) at d <= 128;
// at d = 256 its few registers made ptxas spill, and the wide heads keep the static order.
template <int D>
constexpr bool SCHEDULED = D <= 128;

// mbarriers, TMA, descriptors, the m64n128 S = Q K^T and the P V products (shared with the
// backward)
#include "hopper_common.cuh"

// ---------------------------------------------------------------- S = Q K^T

// D[64 x 128]: wgmma_ss_n128 in hopper_common.cuh (the backward uses it too).
// D[64 x 176] (+)= A[64 x 16] B[16 x 176], both K-major: for 176-key tiles (variant 4).
__device__ __forceinline__ void wgmma_ss_n176(float (&d)[88], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n176k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87}, %88, %89, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
        : "l"(a), "l"(b), "r"(accumulate));
}

template <>  // wgmma_ss<N>: hopper_common.cuh
__device__ __forceinline__ void wgmma_ss<176>(float (&d)[88], uint64_t a, uint64_t b, int accumulate) { wgmma_ss_n176(d, a, b, accumulate); }

// The key tiles of the wide heads (d = 192: 112 keys, d = 256: 80; see WIDE_BN), the same
// product with N = 112 or 80 (and 96, d = 192's other width in the sweep).
__device__ __forceinline__ void wgmma_ss_n80(float (&d)[40], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39}, %40, %41, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
        : "l"(a), "l"(b), "r"(accumulate));
}
template <>
__device__ __forceinline__ void wgmma_ss<80>(float (&d)[40], uint64_t a, uint64_t b, int accumulate) { wgmma_ss_n80(d, a, b, accumulate); }
__device__ __forceinline__ void wgmma_ss_n96(float (&d)[48], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47}, %48, %49, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
        : "l"(a), "l"(b), "r"(accumulate));
}
template <>
__device__ __forceinline__ void wgmma_ss<96>(float (&d)[48], uint64_t a, uint64_t b, int accumulate) { wgmma_ss_n96(d, a, b, accumulate); }
__device__ __forceinline__ void wgmma_ss_n112(float (&d)[56], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %58, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n112k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55}, %56, %57, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55])
        : "l"(a), "l"(b), "r"(accumulate));
}
template <>
__device__ __forceinline__ void wgmma_ss<112>(float (&d)[56], uint64_t a, uint64_t b, int accumulate) { wgmma_ss_n112(d, a, b, accumulate); }

template <int D, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b);
template <>
__device__ __forceinline__ void wgmma_rs<64, 64>(float (&d)[32], const uint32_t (&a)[4], uint64_t b) { wgmma_rs_n64(d, a, b); }
template <>
__device__ __forceinline__ void wgmma_rs<128, 128>(float (&d)[64], const uint32_t (&a)[4], uint64_t b) { wgmma_rs_n128(d, a, b); }

// O += P V at the wide heads: N = d = 192 (96 accumulators a thread) and 256 (128).
__device__ __forceinline__ void wgmma_rs_n192(float (&d)[96], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95}, {%96,%97,%98,%99}, %100, 1, 1, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_rs<192, 192>(float (&d)[96], const uint32_t (&a)[4], uint64_t b) { wgmma_rs_n192(d, a, b); }
__device__ __forceinline__ void wgmma_rs_n256(float (&d)[128], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, 1, 1, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_rs<256, 256>(float (&d)[128], const uint32_t (&a)[4], uint64_t b) { wgmma_rs_n256(d, a, b); }

// ---------------------------------------------------------------- the kernel

template <int D, int BN, int CONS = CONSUMERS>
struct Tiles {  // the shared-memory ring; every tile starts on a 1024-byte boundary (8 rows x 128 B)
    __nv_bfloat16 Q[64 * CONS * DP<D>];
    __nv_bfloat16 K[STAGES<D>][BN * DP<D>];
    __nv_bfloat16 V[STAGES<D>][BN * DP<D>];
    uint64_t q_full[CONS], q_empty[CONS];  // consumer w's 64 rows of Q: landed / done with (persistent)
    uint64_t k_full[STAGES<D>], v_full[STAGES<D>], k_empty[STAGES<D>], v_empty[STAGES<D>];
    uint64_t tile_full[2], tile_empty[2];  // the scheduler's next tile (causal, persistent): posted / read
    int next_tile[2];
};

// Named barriers for ping-pong (named_sync / named_arrive, hopper_common.cuh): consumer w waits on
// 1 + w for its turn on the tensor cores.

template <int D, int BN, int CONS, bool PINGPONG, bool OVERLAP, bool PERSIST>
__global__ void __launch_bounds__(128 * (CONS + 1), 1)
flash_attention_hopper_kernel(const __grid_constant__ CUtensorMap q_map,
                              const __grid_constant__ CUtensorMap k_map,
                              const __grid_constant__ CUtensorMap v_map,
                              __nv_bfloat16* __restrict__ O, float* __restrict__ LSE, int B, int H,
                              int Nq, int Nk, float scale, int causal, int* __restrict__ tile_counter) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int PANELS = DP<D> / 64;      // 64-column panels of a tile (d = 96: 2, see DP)
    constexpr int S_REGS = BN / 2;     // a thread's share of its warpgroup's 64 x BN S
    constexpr int O_REGS = DP<D> / 2;       // ... and of its 64 x D O (d = 96: 64 x 128)
    constexpr int P_REGS = BN / 4;     // P as bf16 pairs
    constexpr int STAGES = fa_hopper::STAGES<D>;
    constexpr int BLOCK_M = 64 * CONS;      // query rows of the block: 64 per consumer
    // the 64K registers of an SM, shared out by setmaxnreg: 24 a producer thread, the rest to
    // the consumers (a multiple of 8): 240 with two consumers, 160 with three
    constexpr int SHARE = (65536 / 128 - 24) / CONS / 8 * 8;
    constexpr int CONSUMER_REGS = SHARE > 240 ? 240 : SHARE;
    static_assert(sizeof(Tiles<D, BN, CONS>) + 1024 <= 227 * 1024,  // + room to align the start to 1024 B
                  "the shared tiles must fit the 227 KB a block may have on an H100: fewer stages");
    Tiles<D, BN, CONS>& sm = shared_tiles<Tiles<D, BN, CONS>>();

    // The work: tiles of BLOCK_M query rows of one head. One tile a block (the grid is
    // q_blocks x H x B), or, PERSIST, one block per SM that takes tile after tile, so that one
    // tile's last product and epilogue overlap the next's first. Causal: a head's longest rows
    // first (their tiles have the most key blocks). Which tiles a persistent block takes:
    //   * without the mask, every tile is as long: blockIdx.x, + gridDim.x, ... (static);
    //   * with it, tiles are 1 to q_blocks key blocks long, and a static stride hands some blocks
    //     mostly long tiles (with q_blocks = 8 and 132 SMs, block 0 gets 8, 4, 8, 4, ... key
    //     blocks, block 3 gets 5, 1, 5, 1, ...). So a scheduler: the host passes a zeroed
    //     tile_counter, and a block's producer takes its next tile with atomicAdd when it has
    //     issued the loads of its current one, and posts it to the consumers in next_tile.
    //     The first blocks to finish take the next tiles, in the order above (d <= 128:
    //     SCHEDULED).
    const int q_blocks = (Nq + BLOCK_M - 1) / BLOCK_M;
    const int first = PERSIST ? blockIdx.x : 0, step = PERSIST ? gridDim.x : 1;
    const int n_tiles = PERSIST ? q_blocks * B * H : 1;
    const bool scheduled = PERSIST && SCHEDULED<D> && tile_counter != nullptr;
    int q0 = 0, bh = 0, n_blocks = 0;
    auto take_tile = [&](int tile) {  // sets q0, bh and the number of key blocks
        int qb;
        if (!PERSIST) {
            qb = causal ? q_blocks - 1 - blockIdx.x : blockIdx.x;
            bh = blockIdx.z * H + blockIdx.y;
        } else {
            // the tiles of one head together: the blocks at work share a few heads' K and V,
            // which stay in L2 (every head's last rows first, across all heads, was tried for
            // causal: 132 blocks then read 132 heads' K and V, far more than the 50 MB of L2)
            qb = tile % q_blocks;
            bh = tile / q_blocks;
            if (causal) qb = q_blocks - 1 - qb;  // a head's longest rows first
        }
        q0 = qb * BLOCK_M;
        const int key_end = causal ? min(Nk, q0 + BLOCK_M) : Nk;
        n_blocks = (key_end + BN - 1) / BN;
    };
    // the warpgroup: the same for the 128 threads of a warpgroup, but the compiler cannot know
    // that of threadIdx.x / 128; read through a shuffle from lane 0 it can, and keeps it (and
    // the addresses made from it) in uniform registers: on an H200 1.00-1.04x at d = 128
    const int wg = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);

    if (threadIdx.x == 0) {
        mbar_init_ring(sm.q_full, sm.q_empty, CONS, 128);  // each consumer its own rows of Q
        mbar_init_ring(sm.k_full, sm.k_empty, STAGES, 128 * CONS);
        mbar_init_ring(sm.v_full, sm.v_empty, STAGES, 128 * CONS);
        mbar_init_ring(sm.tile_full, sm.tile_empty, 2, 128 * CONS);
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 0) {  // ------------------------------------------------ the producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (threadIdx.x == 0) {
            int it = 0;  // K/V tiles loaded so far: the position in the ring, across query tiles
            for (int tile = first, n = 0; tile < n_tiles; ++n) {
                take_tile(tile);
                for (int c = 0; c < CONS; ++c) {  // consumer c's 64 rows of Q, each with its barriers
                    if (PERSIST) mbar_wait(&sm.q_empty[c], (n & 1) ^ 1);  // c's last tile's S is done
                    mbar_expect_bytes(&sm.q_full[c], 64 * DP<D> * 2);  // whole boxes, zeros included
                    for (int p = 0; p < PANELS; ++p)
                        tma_load(sm.Q + p * BLOCK_M * 64 + c * 64 * 64, &q_map, &sm.q_full[c], 64 * p,
                                 q0 + 64 * c, bh);
                }
                for (int j = 0; j < n_blocks; ++j, ++it) {
                    const int s = it % STAGES, phase = (it / STAGES) & 1;
                    mbar_wait(&sm.k_empty[s], phase ^ 1);  // a fresh barrier counts as emptied
                    mbar_expect_bytes(&sm.k_full[s], BN * DP<D> * 2);
                    for (int p = 0; p < PANELS; ++p)
                        tma_load(sm.K[s] + p * BN * 64, &k_map, &sm.k_full[s], 64 * p, j * BN, bh);
                    mbar_wait(&sm.v_empty[s], phase ^ 1);
                    mbar_expect_bytes(&sm.v_full[s], BN * DP<D> * 2);
                    for (int p = 0; p < PANELS; ++p)
                        tma_load(sm.V[s] + p * BN * 64, &v_map, &sm.v_full[s], 64 * p, j * BN, bh);
                }
                if (scheduled) {  // the tile after tile n, posted in slot n % 2
                    const int next = atomicAdd(tile_counter, 1) + gridDim.x;
                    mbar_wait(&sm.tile_empty[n & 1], ((n >> 1) & 1) ^ 1);
                    sm.next_tile[n & 1] = next;
                    mbar_arrive(&sm.tile_full[n & 1]);
                    tile = next;
                } else {
                    tile += step;
                }
            }
        }
        return;
    }

    // -------------------------------------------------------------- the consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
    const int w = wg - 1;                          // consumer 0, 1 (, 2): rows 64w .. 64w + 63
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;          // a lane holds rows g and g + 8, columns 2t, 2t + 1
    int row0 = 0;                                  // its two query rows: row0 and row0 + 8
    const float scale_log2 = scale * LOG2E;
    int it = 0;  // K/V tiles consumed before this query tile: key block j sits in stage (it + j)
    auto stage = [&](int j) { return (it + j) % STAGES; };
    auto parity = [&](int j) { return ((it + j) / STAGES) & 1; };

    // descriptors: Q's rows of this consumer (K-major), K (K-major), V (MN-major: D runs along
    // the 128-byte rows); step k of 16 columns inside a panel moves the start by 32 bytes
    // (each the descriptor of the tile's start plus the k-step's offset: desc_plus). LBO is
    // ignored for a K-major operand under the 128-byte swizzle (PTX ISA: "not used"), so Q's and
    // K's 16 is a placeholder; V's is the distance between its 64-column panels.
    const uint64_t q_start = smem_desc(sm.Q + w * 64 * 64, 16, 1024);  // this consumer's Q rows
    auto q_desc = [&](int k) { return desc_plus(q_start, (k / 4) * BLOCK_M * 64 + (k % 4) * 16); };
    auto k_desc = [&](int s, int k) {
        return desc_plus(smem_desc(sm.K[s], 16, 1024), (k / 4) * BN * 64 + (k % 4) * 16);
    };
    auto v_desc = [&](int s, int k) {  // keys 16k .. 16k + 15
        return desc_plus(smem_desc(sm.V[s], BN * 128, 1024), k * 16 * 64);
    };
    // Turns go round: consumer w waits on barrier 1 + w and hands the turn to w + 1 (a turn: one
    // product without OVERLAP, S(j) with P(j - 1) V(j - 1) with it). The last
    // consumer opens consumer 0's first turn, so it leaves out its own last hand-over (each
    // barrier then sees as many arrivals as waits).
    auto turn_begin = [&]() { if (PINGPONG) named_sync(1 + w); };
    auto turn_end = [&](bool last) {
        if (PINGPONG && !(w == CONS - 1 && last)) named_arrive(1 + (w + 1) % CONS);
    };

    float o[O_REGS], s_acc[S_REGS];
    uint32_t p[P_REGS];
    float m[2], l[2];
#if defined(FA_TIMELINE)
    auto stamp = [&](int k) {  // point k (0-3) of this block's tile, by consumer 0's first thread
        if (w != 0 || tid != 0 || timeline == nullptr) return;
        long long* row = timeline + 5 * ((size_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x);
        if (k == 0) {
            unsigned smid;
            asm volatile("mov.u32 %0, %%smid;\n" : "=r"(smid));
            row[0] = smid;
        }
        long long now;
        asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(now)::"memory");
        row[1 + k] = now;
    };
#else
    auto stamp = [](int) {};
#endif

    auto mma_s = [&](int j) {  // the wgmma chain of S = Q K(j)^T (no wait, fence or commit)
        const int s = stage(j);
        #pragma unroll
        for (int k = 0; k < D / 16; ++k) wgmma_ss<BN>(s_acc, q_desc(k), k_desc(s, k), k > 0);
    };
    auto mma_pv = [&](int j) {  // the wgmma chain of O += P V(j)
        const int s = stage(j);
        #pragma unroll
        for (int k = 0; k < BN / 16; ++k) {
            const uint32_t a[4] = {p[4 * k], p[4 * k + 1], p[4 * k + 2], p[4 * k + 3]};
            wgmma_rs<DP<D>, DP<D>>(o, a, v_desc(s, k));
        }
    };
    auto issue_s = [&](int j) {  // S = Q K(j)^T, asynchronous
        mbar_wait(&sm.k_full[stage(j)], parity(j));
        wgmma_fence();
        mma_s(j);
        wgmma_commit();
    };
    auto issue_pv = [&](int j) {  // O += P V(j), asynchronous
        mbar_wait(&sm.v_full[stage(j)], parity(j));
        wgmma_fence();
        mma_pv(j);
        wgmma_commit();
    };
    // The online softmax of S(j) in place: s_acc becomes P in float (still to be rescaled into
    // p); returns nothing, updates m, and leaves alpha (the factor for O and l) and the row sums.
    float alpha[2], rowsum[2];
    auto softmax = [&](int j) {
        const int c0 = j * BN + 2 * t;
        const bool edge = (j + 1) * BN > Nk || (causal && (j + 1) * BN - 1 > q0 + 64 * w);
        float mx[2] = {m[0], m[1]};  // the row maxima of the raw scores (scale > 0 keeps the order)
        if (edge) {
            #pragma unroll
            for (int i = 0; i < S_REGS; ++i) {
                const int r = row0 + (i % 4 >= 2 ? 8 : 0), c = c0 + 8 * (i / 4) + (i % 2);
                if (c >= Nk || (causal && c > r)) s_acc[i] = neg_inf();
            }
        }
        #pragma unroll
        for (int i = 0; i < S_REGS; ++i) mx[(i % 4) / 2] = fmaxf(mx[(i % 4) / 2], s_acc[i]);
        float base[2];  // m * scale * log2(e): exp(scale (s - m)) = 2^(s * scale_log2 - base)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 2));
            base[h] = mx[h] == neg_inf() ? 0.f : mx[h] * scale_log2;  // a row with no key yet
            alpha[h] = fast_exp2(m[h] * scale_log2 - base[h]);
            m[h] = mx[h];
            rowsum[h] = 0.f;
        }
        #pragma unroll
        for (int i = 0; i < S_REGS; ++i) {  // one FFMA and one MUFU.EX2 per score
            const int h = (i % 4) / 2;
            s_acc[i] = fast_exp2(fmaf(s_acc[i], scale_log2, -base[h]));
            rowsum[h] += s_acc[i];
        }
    };
    auto rescale = [&]() {  // O and l by alpha, P's row sums added to l
        // After the first key blocks a row's maximum rarely moves, and then alpha is exactly 1
        // (2^0). -DFA_SKIP_UNIT_RESCALE skips O's D / 2 multiplications (as many as the scores'
        // own FFMAs at d = 128) when that holds for every row of the warp: the branch is the
        // same for the whole warp. Off until measured on an H100 against the plain rescale.
#if defined(FA_SKIP_UNIT_RESCALE)
        if (__any_sync(0xffffffff, alpha[0] != 1.f || alpha[1] != 1.f))
#endif
        {
            #pragma unroll
            for (int i = 0; i < O_REGS; ++i) o[i] *= alpha[(i % 4) / 2];
        }
        #pragma unroll
        for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + rowsum[h];
    };
    auto pack = [&]() {  // P as bf16 pairs: the A operand of O += P V
        #pragma unroll
        for (int i = 0; i < P_REGS; ++i) p[i] = pack_bf16(s_acc[2 * i], s_acc[2 * i + 1]);
    };
    auto rescale_and_pack = [&]() {
        rescale();
        pack();
    };

    auto start_tile = [&]() {  // after take_tile: this lane's rows, an empty O, no key seen yet
        row0 = q0 + 64 * w + 16 * warp + g;
        m[0] = m[1] = neg_inf();
        l[0] = l[1] = 0.f;
        #pragma unroll
        for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
    };
    // ---------------------------------------------------------------- epilogue
    // O / l as bf16 and the LSE of rows r_first and r_first + 8, O 16 bytes a lane with
    // store_row_bf16 (on an H100 ~1400 cycles a tile, against ~2000 for the accumulator's own
    // 4-byte layout)
    auto store_o = [&](int r_first, int head, const float (&mm)[2], float (&ll)[2]) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            ll[h] += __shfl_xor_sync(0xffffffff, ll[h], 1);
            ll[h] += __shfl_xor_sync(0xffffffff, ll[h], 2);
            const int r = r_first + 8 * h;
            const float inv = ll[h] > 0.f ? 1.f / ll[h] : 0.f;
            // d = 96: O's first 48 registers are its columns 0-95 (column 8 (i / 4) + 2t + i % 2)
            store_row_bf16<D>(O + ((size_t)head * Nq + r) * D,
                              reinterpret_cast<const float(&)[D / 2]>(o), h, inv, t, r < Nq);
            if (t == 0 && r < Nq)
                LSE[(size_t)head * Nq + r] = ll[h] > 0.f ? (mm[h] * scale_log2 + __log2f(ll[h])) / LOG2E : neg_inf();
        }
    };

    // The overlapped loop of one tile (OVERLAP) in three parts: S(0) and its softmax; blocks
    // 1 .. n - 1, each S(j) issued with P(j - 1) V(j - 1); the last P V alone.
    auto s_done = [&](int j) {  // S(j) has completed: its K stage is free (persistent: Q after the last)
        mbar_arrive(&sm.k_empty[stage(j)]);
        if (PERSIST && j == n_blocks - 1) mbar_arrive(&sm.q_empty[w]);
    };
    auto first_block = [&]() {
        turn_begin();
        issue_s(0);
        turn_end(false);
        wgmma_wait<0>();
        fence_regs(s_acc);
        s_done(0);
        softmax(0);
        rescale_and_pack();
    };
    auto overlapped_blocks = [&]() {
        for (int j = 1; j < n_blocks; ++j) {
            turn_begin();
            issue_s(j);          // S(j) = Q K(j)^T ...
            issue_pv(j - 1);     // ... and O += P(j - 1) V(j - 1), both in flight
            turn_end(false);
            wgmma_wait<1>();     // S(j) is done; O += P V still runs under the softmax
            fence_regs(s_acc);
            s_done(j);
            softmax(j);
            wgmma_wait<0>();
            fence_regs(o);
            fence_regs(p);
            mbar_arrive(&sm.v_empty[stage(j - 1)]);
            rescale_and_pack();
        }
    };
    auto last_pv = [&]() {
        turn_begin();
        issue_pv(n_blocks - 1);
        turn_end(true);
        wgmma_wait<0>();
        fence_regs(o);
        mbar_arrive(&sm.v_empty[stage(n_blocks - 1)]);
    };

    if constexpr (!PERSIST) {  // ------------------------------------ one query tile
    take_tile(0);
    start_tile();
    if (PINGPONG && w == CONS - 1) named_arrive(1);  // consumer 0 takes the first turn
    stamp(0);
    mbar_wait(&sm.q_full[w], 0);
    stamp(1);
#if defined(FA_GENERATED_LOOP)
    // Exercise 14.consumer_loop's GPU build: the grader defines FA_GENERATED_LOOP as the
    // statements generated from the student's list of operations (course_utils.library.hopper_pipeline.
    // emit_cuda), for FA_GENERATED_TILES key blocks at d = FA_GENERATED_D; it takes the place of
    // variant 2's loop (overlap, no ping-pong). Other shapes trap: the list was made for one.
    if constexpr (OVERLAP && !PINGPONG && D == FA_GENERATED_D) {
        if (n_blocks != FA_GENERATED_TILES) __trap();
        FA_GENERATED_LOOP
    } else
#endif
    if (!OVERLAP) {
        for (int j = 0; j < n_blocks; ++j) {
            turn_begin();
            issue_s(j);
            turn_end(false);
            wgmma_wait<0>();
            fence_regs(s_acc);
            mbar_arrive(&sm.k_empty[stage(j)]);
            softmax(j);
            rescale_and_pack();
            turn_begin();
            issue_pv(j);
            turn_end(j == n_blocks - 1);
            wgmma_wait<0>();
            fence_regs(o);
            mbar_arrive(&sm.v_empty[stage(j)]);
        }
    } else {
        first_block();
        overlapped_blocks();
        last_pv();
    }
    stamp(2);
    store_o(row0, bh, m, l);
    stamp(3);
    } else {  // ---------------------------------------------------- persistent: tile after tile
    // The loop above, run across the block's tiles as one stream of turns: the next tile's
    // S(0) = Q K(0)^T is issued in the same turn as this tile's last O += P V, its softmax runs
    // while that product does, and this tile's O is stored after it. So neither the last P V
    // nor the epilogue leaves the tensor cores waiting for a new block, and only the very first
    // turn opens (and the very last closes) the ping-pong. Each consumer releases its 64 rows of
    // Q after its last S of a tile (q_empty[w]), and the producer loads its next rows at once,
    // under that last softmax and P V.
    static_assert(PINGPONG && OVERLAP, "the persistent kernel is built on ping-pong + overlap");
    int tile = first, n = 0;
    if (tile >= n_tiles) return;
    take_tile(tile);
    start_tile();
    if (w == CONS - 1) named_arrive(1);  // consumer 0 takes the first turn
    mbar_wait(&sm.q_full[w], 0);
    first_block();
    while (true) {
        overlapped_blocks();
        int next = tile + step;
        if (scheduled) {  // the producer's pick for the tile after tile n
            mbar_wait(&sm.tile_full[n & 1], (n >> 1) & 1);
            next = sm.next_tile[n & 1];
            mbar_arrive(&sm.tile_empty[n & 1]);
        }
        if (next >= n_tiles) {  // the block's last tile: its last P V alone
            last_pv();
            store_o(row0, bh, m, l);
            break;
        }
        const int r_done = row0, bh_done = bh;  // this tile, to be stored after the turn
        const float m_done[2] = {m[0], m[1]};
        float l_done[2] = {l[0], l[1]};
        it += n_blocks;  // from here stage(-1) is this tile's last K/V stage
        take_tile(next);
        ++n;
        row0 = q0 + 64 * w + 16 * warp + g;
        turn_begin();
        mbar_wait(&sm.q_full[w], n & 1);
        issue_s(0);      // the next tile's S(0) ...
        issue_pv(-1);    // ... and this tile's last P V, both in flight
        turn_end(false);
        wgmma_wait<1>(); // S(0) is done
        fence_regs(s_acc);
        s_done(0);
        m[0] = m[1] = neg_inf();
        softmax(0);      // while the P V runs
        wgmma_wait<0>();
        fence_regs(o);
        fence_regs(p);
        mbar_arrive(&sm.v_empty[stage(-1)]);
        store_o(r_done, bh_done, m_done, l_done);
        #pragma unroll
        for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
        l[0] = l[1] = 0.f;
        rescale_and_pack();  // P(0) of the new tile; alpha multiplies an O of zeros
        tile = next;
    }
    }
#else
    __trap();  // built for a GPU without sm_90a's wgmma and TMA: the host refuses to launch
#endif
}

// ---------------------------------------------------------------- probes: one instruction each
// Three tiny kernels that check, one at a time, what the kernel above assumes of the hardware:
// where TMA puts each element (probe_layout), what S = Q K^T with both operands described in
// shared memory gives (probe_ss), and what O = P V with P in registers and V read MN-major gives
// (probe_rs). tests/test_flash_hopper.py compares them with course_utils.library.hopper's model and with
// torch: when the attention kernel is wrong, these say which assumption broke.

template <int D>
struct ProbeTiles {
    __nv_bfloat16 A[128 * D];   // Q (64 rows) or V (128 rows) or the tile of probe_layout
    __nv_bfloat16 B[128 * D];   // K (128 rows)
    uint64_t full;
};

// Load `rows` x D of head 0 through `map` into `tile`, panel by panel; every thread waits.
template <int D>
__device__ __forceinline__ void probe_load(__nv_bfloat16* tile, const CUtensorMap* map,
                                           uint64_t* bar, int rows, int phase_bytes) {
    if (threadIdx.x == 0) {
        mbar_expect_bytes(bar, phase_bytes);
        for (int p = 0; p < D / 64; ++p) tma_load(tile + p * rows * 64, map, bar, 64 * p, 0, 0);
    }
}

// The raw 16-bit words of a 128 x D tile as TMA left them in shared memory.
template <int D>
__global__ void probe_layout_kernel(const __grid_constant__ CUtensorMap map, uint16_t* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    ProbeTiles<D>& sm = probe_setup<ProbeTiles<D>>();
    probe_load<D>(sm.A, &map, &sm.full, 128, 128 * D * 2);
    mbar_wait(&sm.full, 0);
    const uint16_t* words = reinterpret_cast<const uint16_t*>(sm.A);
    for (int i = threadIdx.x; i < 128 * D; i += blockDim.x) out[i] = words[i];
#else
    __trap();
#endif
}

// S (64 x 128, float32, row-major) = Q (64 x D) K (128 x D)^T: one warpgroup, the kernel's
// q_desc / k_desc (with BLOCK_M = 64 rows of Q) and wgmma_ss_n128.
template <int D>
__global__ void probe_ss_kernel(const __grid_constant__ CUtensorMap q_map,
                                const __grid_constant__ CUtensorMap k_map, float* S) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    ProbeTiles<D>& sm = probe_setup<ProbeTiles<D>>();
    if (threadIdx.x == 0) {
        mbar_expect_bytes(&sm.full, (64 + 128) * D * 2);
        for (int p = 0; p < D / 64; ++p) {
            tma_load(sm.A + p * 64 * 64, &q_map, &sm.full, 64 * p, 0, 0);
            tma_load(sm.B + p * 128 * 64, &k_map, &sm.full, 64 * p, 0, 0);
        }
    }
    mbar_wait(&sm.full, 0);
    float s[64];
    wgmma_fence();
    #pragma unroll
    for (int k = 0; k < D / 16; ++k)
        wgmma_ss_n128(s, smem_desc(sm.A + (k / 4) * 64 * 64 + (k % 4) * 16, 16, 1024),
                      smem_desc(sm.B + (k / 4) * 128 * 64 + (k % 4) * 16, 16, 1024), k > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s);
    const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    #pragma unroll
    for (int i = 0; i < 64; ++i) {
        const int r = 16 * warp + g + (i % 4 >= 2 ? 8 : 0), c = 8 * (i / 4) + 2 * t + (i % 2);
        S[r * 128 + c] = s[i];
    }
#else
    __trap();
#endif
}

// O (64 x D, float32, row-major) = P (64 x 128 keys, bf16, from global into the registers of
// the A fragments) V (128 x D, TMA, read MN-major with the kernel's v_desc): wgmma_rs.
template <int D>
__global__ void probe_rs_kernel(const __nv_bfloat16* __restrict__ P,
                                const __grid_constant__ CUtensorMap v_map, float* O) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    ProbeTiles<D>& sm = probe_setup<ProbeTiles<D>>();
    probe_load<D>(sm.A, &v_map, &sm.full, 128, 128 * D * 2);
    const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const int r0 = 16 * warp + g;
    auto pair = [&](int r, int c) {  // P[r, c] and P[r, c + 1] as one bf16x2 register
        return *reinterpret_cast<const uint32_t*>(P + r * 128 + c);
    };
    float o[D / 2];
    #pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    mbar_wait(&sm.full, 0);
    wgmma_fence();
    #pragma unroll
    for (int k = 0; k < 8; ++k) {  // keys 16k .. 16k + 15
        const uint32_t a[4] = {pair(r0, 16 * k + 2 * t), pair(r0 + 8, 16 * k + 2 * t),
                               pair(r0, 16 * k + 8 + 2 * t), pair(r0 + 8, 16 * k + 8 + 2 * t)};
        wgmma_rs<D, D>(o, a, smem_desc(sm.A + k * 16 * 64, 128 * 128, 1024));
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
    #pragma unroll
    for (int i = 0; i < D / 2; ++i) {
        const int r = r0 + (i % 4 >= 2 ? 8 : 0), c = 8 * (i / 4) + 2 * t + (i % 2);
        O[r * D + c] = o[i];
    }
#else
    __trap();
#endif
}

#if defined(FA_KERNEL_ONLY)  // compile-only builds (the compile matrix, ptxas -v): every variant
#define FA_INSTANTIATE(DD, PP, OV)                                                               \
    template __global__ void flash_attention_hopper_kernel<DD, BLOCK_N, CONSUMERS, PP, OV, false>( \
        const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap,                \
        const __grid_constant__ CUtensorMap, __nv_bfloat16*, float*, int, int, int, int, float, int, int*);
FA_INSTANTIATE(64, false, false) FA_INSTANTIATE(64, true, false)
FA_INSTANTIATE(64, false, true) FA_INSTANTIATE(64, true, true)
FA_INSTANTIATE(128, false, false) FA_INSTANTIATE(128, true, false)
FA_INSTANTIATE(128, false, true) FA_INSTANTIATE(128, true, true)
#undef FA_INSTANTIATE
#define FA_INSTANTIATE(DD, BN, CONS, PERSIST)                                                    \
    template __global__ void flash_attention_hopper_kernel<DD, BN, CONS, true, true, PERSIST>(   \
        const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap,                \
        const __grid_constant__ CUtensorMap, __nv_bfloat16*, float*, int, int, int, int, float, int, int*);
FA_INSTANTIATE(128, 176, 2, false) FA_INSTANTIATE(64, 128, 3, false)
FA_INSTANTIATE(64, 128, 3, true) FA_INSTANTIATE(128, 176, 2, true)
FA_INSTANTIATE(64, 128, 2, true) FA_INSTANTIATE(128, 128, 2, true)
FA_INSTANTIATE(96, 128, 2, false) FA_INSTANTIATE(96, 176, 2, false)
FA_INSTANTIATE(96, 176, 2, true) FA_INSTANTIATE(96, 128, 2, true)
FA_INSTANTIATE(192, WIDE_BN<192>, 2, false) FA_INSTANTIATE(192, WIDE_BN<192>, 2, true)
FA_INSTANTIATE(256, WIDE_BN<256>, 2, false) FA_INSTANTIATE(256, WIDE_BN<256>, 2, true)
#undef FA_INSTANTIATE
template __global__ void probe_layout_kernel<64>(const __grid_constant__ CUtensorMap, uint16_t*);
template __global__ void probe_layout_kernel<128>(const __grid_constant__ CUtensorMap, uint16_t*);
template __global__ void probe_ss_kernel<64>(const __grid_constant__ CUtensorMap,
                                             const __grid_constant__ CUtensorMap, float*);
template __global__ void probe_ss_kernel<128>(const __grid_constant__ CUtensorMap,
                                              const __grid_constant__ CUtensorMap, float*);
template __global__ void probe_rs_kernel<64>(const __nv_bfloat16*, const __grid_constant__ CUtensorMap, float*);
template __global__ void probe_rs_kernel<128>(const __nv_bfloat16*, const __grid_constant__ CUtensorMap, float*);
#endif

}  // namespace fa_hopper

#if !defined(__CUDACC_RTC__) && !defined(FA_KERNEL_ONLY)

#include "hopper_host.cuh"  // check_cuda, make_map (the TMA tensor maps)

template <int D, int BN, int CONS, bool PINGPONG, bool OVERLAP, bool PERSIST = false>
static void launch(const torch::Tensor& Q, const torch::Tensor& K, const torch::Tensor& V,
                   torch::Tensor& O, torch::Tensor& LSE, float scale, bool causal) {
    using namespace fa_hopper;
    const int B = Q.size(0), H = Q.size(1), Nq = Q.size(2), Nk = K.size(2);
    constexpr int BM = 64 * CONS;
    // Q in boxes of 64 rows: each consumer's rows have their own barrier
    const CUtensorMap q_map = make_map(Q, 64), k_map = make_map(K, BN), v_map = make_map(V, BN);
    constexpr int SMEM = sizeof(Tiles<D, BN, CONS>) + 1024;  // + room to align the start to 1024 bytes
    auto kernel = flash_attention_hopper_kernel<D, BN, CONS, PINGPONG, OVERLAP, PERSIST>;
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM),
               "flash_attention_hopper: asking for shared memory");
    const int q_blocks = (Nq + BM - 1) / BM;
    dim3 grid(q_blocks, H, B);  // a block per tile
    if (PERSIST) {              // a block per SM (or per tile, when there are fewer)
        TORCH_CHECK(int64_t(q_blocks) * B * H < (int64_t(1) << 31),
                    "flash_attention_hopper: too many query tiles for the persistent kernel (B x H x Nq / ",
                    std::to_string(BM), " must be below 2^31); use variant 3");
        int sms = 0;
        check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, Q.get_device()),
                   "flash_attention_hopper: counting SMs");
        grid = dim3(static_cast<unsigned>(std::min<int64_t>(sms, int64_t(q_blocks) * B * H)));
    }
    // causal and persistent: the scheduler's counter, zeroed (tiles taken after the first wave)
    torch::Tensor counter;
    if (PERSIST && causal && fa_hopper::SCHEDULED<D>) counter = torch::zeros({1}, Q.options().dtype(torch::kInt));
    kernel<<<grid, 128 * (CONS + 1), SMEM, c10::cuda::getCurrentCUDAStream()>>>(
        q_map, k_map, v_map, reinterpret_cast<__nv_bfloat16*>(O.data_ptr()), LSE.data_ptr<float>(),
        B, H, Nq, Nk, scale, causal ? 1 : 0, counter.defined() ? counter.data_ptr<int>() : nullptr);
    check_cuda(cudaGetLastError(), "flash_attention_hopper: launch");
}

// O, LSE = attention(Q, K, V) with TMA and wgmma (sm_90a: H100/H200 only). variant: 0 = warp specialized,
// 1 = + ping-pong of the two consumers, 2 = + overlap inside a warpgroup, 3 = both; 4 = 3 with
// key tiles of 176 instead of 128 (d = 128 only: fewer, longer softmax passes, FlashAttention-3's
// choice; 88 + 44 + 64 registers of S, P and O a thread); 5 = 3 with three consumers, 192 query
// rows a block (d = 64 only, where the exponentials weigh most: 160 registers a consumer thread);
// 6 = the best tiles of d (4 at d = 128, 5 at d = 64) as a persistent kernel: one block per SM
// takes query tile after query tile, the next tile's first product under this one's last (causal:
// from a scheduler, the next free tile); 7 = 6 with variant 3's tiles (128 query rows, 128 keys;
// d = 64 and 128): causal tiles on short sequences, where a tile's diagonal block is a larger share.
std::vector<torch::Tensor> flash_attention_hopper(torch::Tensor Q, torch::Tensor K, torch::Tensor V,
                                                  bool causal, int64_t variant) {
    const char* fn = "flash_attention_hopper";
    for (const auto* X : {&Q, &K, &V}) {
        TORCH_CHECK(X->is_cuda(), fn, ": Q, K and V must be CUDA tensors");
        TORCH_CHECK(X->scalar_type() == torch::kBFloat16, fn, ": Q, K and V must be bfloat16 (call .bfloat16())");
        TORCH_CHECK(X->dim() == 4, fn, ": Q, K and V must be 4D (B, H, N, D)");
        TORCH_CHECK(X->is_contiguous(), fn, ": Q, K and V must be contiguous (call .contiguous())");
        TORCH_CHECK(reinterpret_cast<uintptr_t>(X->data_ptr()) % 16 == 0,
                    fn, ": Q, K and V must start on a 16-byte boundary (call .clone())");
    }
    TORCH_CHECK(Q.device() == K.device() && Q.device() == V.device(), fn, ": Q, K and V must be on the same GPU");
    TORCH_CHECK(K.sizes() == V.sizes(), fn, ": K and V must have the same shape");
    TORCH_CHECK(Q.size(0) == K.size(0) && Q.size(1) == K.size(1) && Q.size(3) == K.size(3),
                fn, ": Q and K must agree in B, H and D");
    const int64_t D = Q.size(3);
    TORCH_CHECK(D == 64 || D == 96 || D == 128 || D == 192 || D == 256, fn,
                ": head dim D must be 64, 96, 128, 192 or 256, got ", std::to_string(D));
    TORCH_CHECK(variant >= 0 && variant <= 7, fn, ": variant must be 0..7, got ", std::to_string(variant));
    TORCH_CHECK(D <= 128 || variant == 3 || variant == 6, fn, ": at D = ", std::to_string(D),
                " only variants 3 (one tile a block) and 6 (persistent) are built, got ",
                std::to_string(variant));
    TORCH_CHECK(D != 96 || variant == 3 || variant == 4 || variant >= 6, fn, ": at D = 96 only "
                "variants 3, 4, 6 and 7 are built (d = 128's tiles), got ", std::to_string(variant));
    TORCH_CHECK(variant != 4 || D == 128 || D == 96, fn, ": variant 4 (176-key tiles) is built for "
                "D = 96 and 128 only; use variant 3 or 5 at D = 64");
    TORCH_CHECK(variant != 5 || D == 64, fn, ": variant 5 (three consumers) is built for D = 64 only; "
                "use variant 3 or 4 at D = 128");
    int major = 0, minor = 0;  // device attributes: cheap, unlike cudaGetDeviceProperties
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, Q.get_device()), fn);
    check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, Q.get_device()), fn);
    TORCH_CHECK(major == 9, fn, ": needs an sm_90 GPU (H100/H200: TMA and wgmma); this one is sm_",
                std::to_string(major * 10 + minor), ". Use chapter 09 or 10's kernel instead.");
    const int64_t B = Q.size(0), H = Q.size(1), Nq = Q.size(2), Nk = K.size(2);
    TORCH_CHECK(B * H <= 65535 * 65535LL && H <= 65535 && B <= 65535, fn, ": B and H must be at most 65535");
    auto O = torch::empty_like(Q);
    auto LSE = torch::empty({B, H, Nq}, Q.options().dtype(torch::kFloat));
    if (B == 0 || H == 0 || Nq == 0) return {O, LSE};
    if (Nk == 0) return {O.zero_(), LSE.fill_(-INFINITY)};
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    c10::cuda::CUDAGuard guard(Q.device());
#define FA_LAUNCH(DD, PP, OV) launch<DD, fa_hopper::BLOCK_N, fa_hopper::CONSUMERS, PP, OV>(Q, K, V, O, LSE, scale, causal)
    if (D == 64) {
        if (variant == 0) FA_LAUNCH(64, false, false); else if (variant == 1) FA_LAUNCH(64, true, false);
        else if (variant == 2) FA_LAUNCH(64, false, true); else if (variant == 3) FA_LAUNCH(64, true, true);
        else if (variant == 5) launch<64, 128, 3, true, true>(Q, K, V, O, LSE, scale, causal);
        else if (variant == 6) launch<64, 128, 3, true, true, true>(Q, K, V, O, LSE, scale, causal);
        else launch<64, 128, 2, true, true, true>(Q, K, V, O, LSE, scale, causal);
    } else if (D == 96) {  // d = 128's tiles on columns padded to 128 (DP)
        if (variant == 3) launch<96, 128, 2, true, true>(Q, K, V, O, LSE, scale, causal);
        else if (variant == 4) launch<96, 176, 2, true, true>(Q, K, V, O, LSE, scale, causal);
        else if (variant == 6) launch<96, 176, 2, true, true, true>(Q, K, V, O, LSE, scale, causal);
        else launch<96, 128, 2, true, true, true>(Q, K, V, O, LSE, scale, causal);
    } else if (D == 128) {
        if (variant == 0) FA_LAUNCH(128, false, false); else if (variant == 1) FA_LAUNCH(128, true, false);
        else if (variant == 2) FA_LAUNCH(128, false, true); else if (variant == 3) FA_LAUNCH(128, true, true);
        else if (variant == 4) launch<128, 176, 2, true, true>(Q, K, V, O, LSE, scale, causal);
        else if (variant == 6) launch<128, 176, 2, true, true, true>(Q, K, V, O, LSE, scale, causal);
        else launch<128, 128, 2, true, true, true>(Q, K, V, O, LSE, scale, causal);
    } else if (D == 192) {  // the wide heads: their own key tiles (WIDE_BN), variants 3 and 6
        if (variant == 3) launch<192, fa_hopper::WIDE_BN<192>, 2, true, true>(Q, K, V, O, LSE, scale, causal);
        else launch<192, fa_hopper::WIDE_BN<192>, 2, true, true, true>(Q, K, V, O, LSE, scale, causal);
    } else {
        if (variant == 3) launch<256, fa_hopper::WIDE_BN<256>, 2, true, true>(Q, K, V, O, LSE, scale, causal);
        else launch<256, fa_hopper::WIDE_BN<256>, 2, true, true, true>(Q, K, V, O, LSE, scale, causal);
    }
#undef FA_LAUNCH
    return {O, LSE};
}

#if defined(FA_TIMELINE)
// flash_attention_hopper, with the clock read at four points of each block's tile: O, LSE and a
// (blocks x 5) int64 table, row b = {SM, t0 (Q wait begins), t1 (Q landed), t2 (last P V done),
// t3 (O stores issued)} in that SM's cycles, b = blockIdx.x + q_blocks (blockIdx.y + H blockIdx.z).
std::vector<torch::Tensor> flash_attention_hopper_timeline(torch::Tensor Q, torch::Tensor K,
                                                           torch::Tensor V, bool causal,
                                                           int64_t variant) {
    const char* fn = "flash_attention_hopper_timeline";
    TORCH_CHECK(variant >= 0 && variant <= 5, fn, ": variants 0-5 only (one tile a block); the "
                "persistent variants 6 and 7 run many tiles a block, got ", std::to_string(variant));
    TORCH_CHECK(Q.is_cuda() && Q.dim() == 4, fn, ": Q must be a 4D (B, H, N, D) CUDA tensor");
    c10::cuda::CUDAGuard guard(Q.device());  // the table pointer is set on Q's GPU
    const int64_t rows_per_block = variant == 5 ? 192 : 128;
    const int64_t blocks = (Q.size(2) + rows_per_block - 1) / rows_per_block * Q.size(1) * Q.size(0);
    auto table = torch::full({blocks, 5}, -1, Q.options().dtype(torch::kLong));
    auto stream = c10::cuda::getCurrentCUDAStream();
    auto point_to = [&](long long* at) {
        check_cuda(cudaMemcpyToSymbolAsync(fa_hopper::timeline, &at, sizeof(at), 0,
                                           cudaMemcpyHostToDevice, stream), fn);
    };
    point_to(reinterpret_cast<long long*>(table.data_ptr<int64_t>()));
    std::vector<torch::Tensor> out;
    try {
        out = flash_attention_hopper(Q, K, V, causal, variant);
    } catch (...) {
        point_to(nullptr);
        throw;
    }
    point_to(nullptr);  // the next call of the plain entry point writes no table
    out.push_back(table);
    return out;
}
#endif
// ---------------------------------------------------------------- the probes' host side

static void check_probe_input(const char* fn, const torch::Tensor& X, int64_t rows) {
    TORCH_CHECK(X.is_cuda() && X.scalar_type() == torch::kBFloat16 && X.is_contiguous() &&
                X.dim() == 2 && X.size(0) == rows && (X.size(1) == 64 || X.size(1) == 128),
                fn, ": expected a contiguous bf16 CUDA tensor of ", std::to_string(rows),
                " x D, D = 64 or 128");
}

// Launch a probe: one warpgroup, its tiles' shared memory (aligned to 1024 bytes) allowed.
template <int D, class... Params, class... Args>
static void launch_probe(void (*kernel)(Params...), const char* fn, Args... args) {
    const int smem = sizeof(fa_hopper::ProbeTiles<D>) + 1024;
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), fn);
    kernel<<<1, 128, smem, c10::cuda::getCurrentCUDAStream()>>>(args...);
    check_cuda(cudaGetLastError(), fn);
}

// The 16-bit words of shared memory after TMA copied X (128 x D) with the 128-byte swizzle.
torch::Tensor hopper_probe_layout(torch::Tensor X) {
    const char* fn = "hopper_probe_layout";
    check_probe_input(fn, X, 128);
    const int D = X.size(1);
    auto out = torch::empty({128 * D}, X.options().dtype(torch::kShort));
    const CUtensorMap map = make_map(X.view({1, 1, 128, D}), 128);
    auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
    if (D == 64) launch_probe<64>(fa_hopper::probe_layout_kernel<64>, fn, map, dst);
    else launch_probe<128>(fa_hopper::probe_layout_kernel<128>, fn, map, dst);
    return out;
}

// S = Q K^T (Q 64 x D, K 128 x D, bf16) by one warpgroup's wgmma chain: float32 64 x 128.
torch::Tensor hopper_probe_ss(torch::Tensor Q, torch::Tensor K) {
    const char* fn = "hopper_probe_ss";
    check_probe_input(fn, Q, 64);
    check_probe_input(fn, K, 128);
    TORCH_CHECK(Q.size(1) == K.size(1), fn, ": Q and K must have the same D");
    const int D = Q.size(1);
    auto S = torch::empty({64, 128}, Q.options().dtype(torch::kFloat));
    const CUtensorMap q_map = make_map(Q.view({1, 1, 64, D}), 64);
    const CUtensorMap k_map = make_map(K.view({1, 1, 128, D}), 128);
    if (D == 64) launch_probe<64>(fa_hopper::probe_ss_kernel<64>, fn, q_map, k_map, S.data_ptr<float>());
    else launch_probe<128>(fa_hopper::probe_ss_kernel<128>, fn, q_map, k_map, S.data_ptr<float>());
    return S;
}

// O = P V (P 64 x 128 bf16 as the A operand in registers, V 128 x D bf16 read MN-major).
torch::Tensor hopper_probe_rs(torch::Tensor P, torch::Tensor V) {
    const char* fn = "hopper_probe_rs";
    TORCH_CHECK(P.is_cuda() && P.scalar_type() == torch::kBFloat16 && P.is_contiguous() &&
                P.dim() == 2 && P.size(0) == 64 && P.size(1) == 128,
                fn, ": P must be a contiguous bf16 CUDA tensor of 64 x 128");
    check_probe_input(fn, V, 128);
    const int D = V.size(1);
    auto O = torch::empty({64, D}, V.options().dtype(torch::kFloat));
    const CUtensorMap v_map = make_map(V.view({1, 1, 128, D}), 128);
    const auto* p = reinterpret_cast<const __nv_bfloat16*>(P.data_ptr());
    if (D == 64) launch_probe<64>(fa_hopper::probe_rs_kernel<64>, fn, p, v_map, O.data_ptr<float>());
    else launch_probe<128>(fa_hopper::probe_rs_kernel<128>, fn, p, v_map, O.data_ptr<float>());
    return O;
}
#endif
