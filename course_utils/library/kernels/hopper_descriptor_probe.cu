// Chapter 14's descriptor probe: a student's wgmma matrix descriptors in a real wgmma chain.
//
// Exercise 14.descriptors asks for the descriptor words of one operand, k-step by k-step; the
// grader (course_utils/grading/specs/ch14.py) first decodes them with course_utils.library.hopper's byte model,
// and on an sm_90 GPU it then runs the words that model accepts here: TMA copies the operand's
// tile (rows x cols bf16) into shared memory with the case's swizzle (128, 64 or 32 bytes: boxes
// of swizzle / 2 columns, one panel after the other from byte `base` of the block's 1024-aligned
// dynamic shared memory), and one warpgroup runs the chain with the words:
//   * the operand is B (role_b): D (64 x N) = P (64 x K, from registers, as the forward's
//     O += P V) times B, the words read B K-major (trans-b 0) or MN-major (trans-b 1);
//   * the operand is A: D (64 x 64) = A times the partner's transpose, the partner (64 x K) a
//     K-major 128-byte-swizzled tile read with the lecture kernel's own k_desc pattern, and the
//     words read A K-major (trans-a 0) or MN-major (trans-a 1).
// The grader compares D with torch's product. The words hold addresses from the aligned start of
// dynamic shared memory; the kernel adds that start's shared address to each start field.
//
// Only words the CPU model accepted reach this kernel: they read inside the tile, so a wrong
// descriptor cannot send wgmma outside the block's shared memory here.
//
// The asm lists of wgmma_rs_probe / wgmma_ss_probe (m64nNk16, N = 64, 128, 256, either
// transpose) were written by a short script: one pattern, N / 2 accumulator registers each, the
// kind of line (128 registers at N = 256) a typo by hand would hide in.

#if !defined(__CUDACC_RTC__) && !defined(FA_KERNEL_ONLY)
// From torch, what this file uses: the Tensor class and one header per operator it calls, under
// the torch:: names of <torch/types.h>. That header has every operator: a compile-only build (no
// GPU) takes about 30 % longer with it. On a GPU, load_inline puts it before this file anyway.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
namespace torch { using namespace at; }  // torch::Tensor, torch::empty, torch::kFloat, ...
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cudaTypedefs.h>
#include <string>
#endif
#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace desc_probe {

// mbarriers, TMA copies, wgmma fence / commit / wait, shared_tiles (shared with the chapter's
// kernels)
#include "hopper_common.cuh"

constexpr int MAX_K_STEPS = 16;  // the host's limit on the words of one chain

// D[64 x N] += A[64 x 16] (registers) B[16 x N] (shared, descriptor b), trans-b TRANS
template <int N, int TRANS>
__device__ __forceinline__ void wgmma_rs_probe(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b);
// D[64 x 64] += A[64 x 16] (shared, descriptor a, trans-a TRANS) B[16 x 64] (shared, K-major)
template <int TRANS>
__device__ __forceinline__ void wgmma_ss_probe(float (&d)[32], uint64_t a, uint64_t b);

template <>
__device__ __forceinline__ void wgmma_rs_probe<64, 0>(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, 1, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_rs_probe<64, 1>(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, 1, 1, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_rs_probe<128, 0>(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, 1, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_rs_probe<128, 1>(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, 1, 1, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_rs_probe<256, 0>(float (&d)[128], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, 1, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_rs_probe<256, 1>(float (&d)[128], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, 1, 1, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_ss_probe<0>(float (&d)[32], uint64_t a, uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, 1, 1, 1, 0, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_ss_probe<1>(float (&d)[32], uint64_t a, uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, 1, 1, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b));
}

// The student's word for k-step s, its start field moved by the aligned start's shared address
// (a multiple of 1024: the swizzle pattern stays where it was).
__device__ __forceinline__ uint64_t moved(const int64_t* words, int s, uint32_t origin) {
    return desc_plus(static_cast<uint64_t>(words[s]), origin / 2);  // desc_plus counts bf16
}

// Copy `panels` boxes of a tile (box: `width` columns x all rows) to `dst`, one after the other.
__device__ __forceinline__ void load_panels(unsigned char* dst, const CUtensorMap* map, uint64_t* bar,
                                            int panels, int width, int panel_bytes) {
    for (int p = 0; p < panels; ++p) tma_load(dst + p * panel_bytes, map, bar, p * width, 0, 0);
}

template <int N>
__device__ __forceinline__ void store_acc(float* D, const float (&d)[N / 2]) {
    const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    #pragma unroll
    for (int i = 0; i < N / 2; ++i) {
        const int r = 16 * warp + g + (i % 4 >= 2 ? 8 : 0), c = 8 * (i / 4) + 2 * t + (i % 2);
        D[r * N + c] = d[i];
    }
}

struct Layout {
    int base, panels, width, panel_bytes, tile_bytes;  // the student's tile
    int partner, partner_panels;                        // the A role's partner (byte offset)
    int k_steps;
};

// B role: D (64 x N) = P (64 x K) B, B read through the student's words.
template <int N, int TRANS>
__global__ void probe_b_kernel(const __grid_constant__ CUtensorMap x_map,
                               const __nv_bfloat16* __restrict__ P, const int64_t* __restrict__ words,
                               Layout L, float* D) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __shared__ alignas(8) uint64_t full;
    unsigned char* smem = &shared_tiles<unsigned char>();
    if (threadIdx.x == 0) {
        mbar_init(&full, 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_expect_bytes(&full, L.tile_bytes);
        load_panels(smem + L.base, &x_map, &full, L.panels, L.width, L.panel_bytes);
    }
    const uint32_t origin = smem_addr(smem);
    const int K = 16 * L.k_steps;
    const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const int r0 = 16 * warp + g;
    auto pair = [&](int r, int c) {  // P[r, c] and P[r, c + 1] as one bf16x2 register
        return *reinterpret_cast<const uint32_t*>(P + r * K + c);
    };
    float d[N / 2];
    #pragma unroll
    for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
    mbar_wait(&full, 0);
    wgmma_fence();
    for (int s = 0; s < L.k_steps; ++s) {
        const uint32_t a[4] = {pair(r0, 16 * s + 2 * t), pair(r0 + 8, 16 * s + 2 * t),
                               pair(r0, 16 * s + 8 + 2 * t), pair(r0 + 8, 16 * s + 8 + 2 * t)};
        wgmma_rs_probe<N, TRANS>(d, a, moved(words, s, origin));
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(d);
    store_acc<N>(D, d);
#else
    __trap();
#endif
}

// A role: D (64 x 64) = A Y^T, A read through the student's words, Y (64 x K) the partner.
template <int TRANS>
__global__ void probe_a_kernel(const __grid_constant__ CUtensorMap x_map,
                               const __grid_constant__ CUtensorMap y_map,
                               const int64_t* __restrict__ words, Layout L, float* D) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __shared__ alignas(8) uint64_t full;
    unsigned char* smem = &shared_tiles<unsigned char>();
    if (threadIdx.x == 0) {
        mbar_init(&full, 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_expect_bytes(&full, L.tile_bytes + L.partner_panels * 64 * 128);
        load_panels(smem + L.base, &x_map, &full, L.panels, L.width, L.panel_bytes);
        load_panels(smem + L.partner, &y_map, &full, L.partner_panels, 64, 64 * 128);
    }
    const uint32_t origin = smem_addr(smem);
    const __nv_bfloat16* Y = reinterpret_cast<const __nv_bfloat16*>(smem + L.partner);
    float d[32];
    #pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    mbar_wait(&full, 0);
    wgmma_fence();
    for (int s = 0; s < L.k_steps; ++s)  // the partner: the lecture kernel's k_desc, 64 rows
        wgmma_ss_probe<TRANS>(d, moved(words, s, origin),
                              smem_desc(Y + (s / 4) * 64 * 64 + (s % 4) * 16, 16, 1024));
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(d);
    store_acc<64>(D, d);
#else
    __trap();
#endif
}

}  // namespace desc_probe

#if !defined(__CUDACC_RTC__) && !defined(FA_KERNEL_ONLY)

static void check_cuda_probe(cudaError_t err, const char* what) {
    TORCH_CHECK(err == cudaSuccess, what, ": ", cudaGetErrorString(err));
}

// A 3D TMA map (the third dimension 1) over a rows x cols bf16 matrix: boxes of `width` columns
// x `box_rows` rows, with the swizzle of `swizzle` bytes (128, 64, 32), zeros past the edges.
static CUtensorMap probe_map(const torch::Tensor& X, int width, int box_rows, int swizzle) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    if (!encode) {
        cudaDriverEntryPointQueryResult found;
        check_cuda_probe(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled",
                                                          reinterpret_cast<void**>(&encode), 12000,
                                                          cudaEnableDefault, &found),
                         "hopper_descriptor_probe: looking up cuTensorMapEncodeTiled");
        TORCH_CHECK(found == cudaDriverEntryPointSuccess && encode,
                    "hopper_descriptor_probe: the driver has no cuTensorMapEncodeTiled");
    }
    const CUtensorMapSwizzle mode = swizzle == 128 ? CU_TENSOR_MAP_SWIZZLE_128B
                                  : swizzle == 64  ? CU_TENSOR_MAP_SWIZZLE_64B
                                                   : CU_TENSOR_MAP_SWIZZLE_32B;
    CUtensorMap map;
    const cuuint64_t dims[3] = {(cuuint64_t)X.size(1), (cuuint64_t)X.size(0), 1};
    const cuuint64_t strides[2] = {(cuuint64_t)X.size(1) * 2, (cuuint64_t)X.size(0) * X.size(1) * 2};
    const cuuint32_t box[3] = {(cuuint32_t)width, (cuuint32_t)box_rows, 1}, step[3] = {1, 1, 1};
    const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, X.data_ptr(), dims, strides,
                              box, step, CU_TENSOR_MAP_INTERLEAVE_NONE, mode,
                              CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    TORCH_CHECK(r == CUDA_SUCCESS, "hopper_descriptor_probe: cuTensorMapEncodeTiled failed (", (int)r, ")");
    return map;
}

template <class Kernel, class... Args>
static void launch_probe_kernel(Kernel kernel, int smem, Args... args) {
    check_cuda_probe(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                     "hopper_descriptor_probe: asking for shared memory");
    kernel<<<1, 128, smem, c10::cuda::getCurrentCUDAStream()>>>(args...);
    check_cuda_probe(cudaGetLastError(), "hopper_descriptor_probe: launch");
}

// The product of one wgmma chain whose operand X (rows x cols bf16, TMA-copied with `swizzle`
// to byte `base`) is read through `words` (int64, one per k-step): role_b: P (64 x K) X-operand
// (64 x mn); else X-operand (64 x K) times other^T (other: 64 x K), 64 x 64. K = 16 x k-steps.
torch::Tensor hopper_descriptor_probe(torch::Tensor X, torch::Tensor other, torch::Tensor words,
                                      bool role_b, bool mn_major, int64_t swizzle, int64_t base,
                                      int64_t mn) {
    const char* fn = "hopper_descriptor_probe";
    for (const auto* T : {&X, &other}) {
        TORCH_CHECK(T->is_cuda() && T->scalar_type() == torch::kBFloat16 && T->is_contiguous() &&
                    T->dim() == 2, fn, ": X and other must be contiguous 2D bf16 CUDA tensors");
    }
    TORCH_CHECK(words.is_cuda() && words.scalar_type() == torch::kLong && words.dim() == 1 &&
                words.size(0) >= 1 && words.size(0) <= desc_probe::MAX_K_STEPS,
                fn, ": words must be an int64 CUDA vector of 1 to 16 k-steps");
    TORCH_CHECK(swizzle == 128 || swizzle == 64 || swizzle == 32, fn, ": swizzle 128, 64 or 32");
    const int rows = X.size(0), cols = X.size(1), k_steps = words.size(0), K = 16 * k_steps;
    const int width = swizzle / 2;
    TORCH_CHECK(rows % 8 == 0 && rows <= 256 && cols % width == 0, fn, ": a ", std::to_string(rows),
                " x ", std::to_string(cols), " tile cannot be copied in boxes of ", std::to_string(width),
                " columns");
    TORCH_CHECK(base >= 0 && base % (8 * swizzle) == 0, fn, ": base must be on the swizzle pattern");
    TORCH_CHECK(other.size(0) == 64 && other.size(1) == K, fn, ": other must be 64 x 16 k-steps");
    desc_probe::Layout L;
    L.base = base;
    L.panels = cols / width;
    L.width = width;
    L.panel_bytes = rows * swizzle;
    L.tile_bytes = rows * cols * 2;
    L.partner = (base + L.tile_bytes + 1023) / 1024 * 1024;
    L.partner_panels = role_b ? 0 : (K + 63) / 64;
    L.k_steps = k_steps;
    const int smem = 1024 + L.partner + L.partner_panels * 64 * 128;
    TORCH_CHECK(smem <= 227 * 1024, fn, ": the tiles need ", std::to_string(smem),
                " bytes of shared memory, more than a block may have");
    c10::cuda::CUDAGuard guard(X.device());
    const CUtensorMap x_map = probe_map(X, width, rows, swizzle);
    const int64_t* w = words.data_ptr<int64_t>();
    if (role_b) {
        auto D = torch::empty({64, mn}, X.options().dtype(torch::kFloat));
        const auto* P = reinterpret_cast<const __nv_bfloat16*>(other.data_ptr());
        float* d = D.data_ptr<float>();
#define PROBE_B(NN, TT) launch_probe_kernel(desc_probe::probe_b_kernel<NN, TT>, smem, x_map, P, w, L, d)
        if (mn == 64) { if (mn_major) PROBE_B(64, 1); else PROBE_B(64, 0); }
        else if (mn == 128) { if (mn_major) PROBE_B(128, 1); else PROBE_B(128, 0); }
        else if (mn == 256) { if (mn_major) PROBE_B(256, 1); else PROBE_B(256, 0); }
        else TORCH_CHECK(false, fn, ": the B operand's N must be 64, 128 or 256 here");
#undef PROBE_B
        return D;
    }
    TORCH_CHECK(mn == 64, fn, ": wgmma's A has M = 64");
    auto D = torch::empty({64, 64}, X.options().dtype(torch::kFloat));
    const CUtensorMap y_map = probe_map(other, 64, 64, 128);
    if (mn_major) launch_probe_kernel(desc_probe::probe_a_kernel<1>, smem, x_map, y_map, w, L, D.data_ptr<float>());
    else launch_probe_kernel(desc_probe::probe_a_kernel<0>, smem, x_map, y_map, w, L, D.data_ptr<float>());
    return D;
}
#endif

#if defined(FA_KERNEL_ONLY)  // compile-only builds (ptxas -v)
namespace desc_probe {
template __global__ void probe_b_kernel<64, 0>(const __grid_constant__ CUtensorMap, const __nv_bfloat16*, const int64_t*, Layout, float*);
template __global__ void probe_b_kernel<64, 1>(const __grid_constant__ CUtensorMap, const __nv_bfloat16*, const int64_t*, Layout, float*);
template __global__ void probe_b_kernel<128, 0>(const __grid_constant__ CUtensorMap, const __nv_bfloat16*, const int64_t*, Layout, float*);
template __global__ void probe_b_kernel<128, 1>(const __grid_constant__ CUtensorMap, const __nv_bfloat16*, const int64_t*, Layout, float*);
template __global__ void probe_b_kernel<256, 0>(const __grid_constant__ CUtensorMap, const __nv_bfloat16*, const int64_t*, Layout, float*);
template __global__ void probe_b_kernel<256, 1>(const __grid_constant__ CUtensorMap, const __nv_bfloat16*, const int64_t*, Layout, float*);
template __global__ void probe_a_kernel<0>(const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap, const int64_t*, Layout, float*);
template __global__ void probe_a_kernel<1>(const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap, const int64_t*, Layout, float*);
}  // namespace desc_probe
#endif
