// mma_helpers.cuh: the warp-level tensor-core instructions of chapter 10 as small device
// functions, one source for the GPU (inline PTX, sm_80 and later) and for the CPU emulation
// (course_utils.toolbox.cuda_cpu, where each is a warp collective computing what the PTX ISA says).
//
//   #include "mma_helpers.cuh"
//
// The API (every register is an `unsigned`: two bf16 values, the lower 16 bits first):
//
//   unsigned pack_bf16(float lo, float hi);
//       lo and hi rounded to bf16 (nearest, ties to even) in one register: lo in bits 0-15.
//   float unpack_bf16_lo(unsigned r);  float unpack_bf16_hi(unsigned r);
//       the two halves back as floats (exact).
//   void ldmatrix_x4(unsigned r[4], const void* smem_row);
//       ldmatrix.sync.aligned.m8n8.x4.shared.b16. Warp-wide: lanes 8j .. 8j+7 give the addresses
//       of rows 0..7 of the 8 x 8 bf16 matrix j (16 bytes each, 16-byte aligned, in shared
//       memory); lane l receives in r[j] row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of
//       matrix j.
//   void ldmatrix_x4_trans(unsigned r[4], const void* smem_row);
//       the same with .trans: r[j] holds row l / 4, columns 2 (l % 4), + 1 of matrix j's
//       transpose (the elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4) as stored).
//   void mma_m16n8k16_bf16(float d[4], const unsigned a[4], const unsigned b[2], const float c[4]);
//       mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: D = A (16 x 16) B (16 x 8) + C,
//       warp-wide; d may be c (d += A B). With g = lane / 4, t = lane % 4 (course_utils.library.mma):
//         a[0]: A[g][2t, 2t+1]     a[1]: A[g+8][2t, 2t+1]
//         a[2]: A[g][2t+8, 2t+9]   a[3]: A[g+8][2t+8, 2t+9]
//         b[0]: B[2t, 2t+1][g]     b[1]: B[2t+8, 2t+9][g]
//         c[0], c[1]: C[g][2t, 2t+1]   c[2], c[3]: C[g+8][2t, 2t+1]   (d likewise)
//   void cp_async16(void* smem_dst, const void* src, int src_bytes);
//       cp.async.cg.shared.global: 16 bytes into shared memory, the first src_bytes (0..16) read
//       from src (global memory), the rest zero; both addresses 16-byte aligned. Per thread.
//   void cp_async_commit();            cp.async.commit_group: the copies issued since, a group
//   template <int N> void cp_async_wait();
//       cp.async.wait_group N: all of this thread's committed groups but the N most recent have
//       landed (a __syncthreads() after it makes them visible to the other threads).
//       On the CPU a copy lands at that wait, not before: a read of the tile before it sees the
//       NaN that shared memory is filled with.
//
// Every lane of the warp must call ldmatrix and mma together (all 32, no mask), from the same
// line on the CPU. The shuffles (__shfl_xor_sync, ...) are CUDA's own, on both sides.
//
// On a GPU the header needs nothing else (no <cuda_bf16.h>, no <cstdint>): NVRTC compiles it
// once it is on the include path or pasted in place of the #include
// (course_utils.toolbox.cuda_cpu.with_mma_helpers(source) does that). The emulation supplies the same
// names from course_utils/library/kernels/cuda_cpu.h.
#pragma once

#if defined(CUDA_CPU_EMULATION)

using ::cuda_cpu::mma_helpers::cp_async16;
using ::cuda_cpu::mma_helpers::cp_async_commit;
using ::cuda_cpu::mma_helpers::cp_async_wait;
using ::cuda_cpu::mma_helpers::ldmatrix_x4;
using ::cuda_cpu::mma_helpers::ldmatrix_x4_trans;
using ::cuda_cpu::mma_helpers::mma_m16n8k16_bf16;
using ::cuda_cpu::mma_helpers::pack_bf16;
using ::cuda_cpu::mma_helpers::unpack_bf16_hi;
using ::cuda_cpu::mma_helpers::unpack_bf16_lo;

#else

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;  // cvt.rn.bf16x2.f32 d, a, b puts a in the upper half, b in the lower
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float unpack_bf16_lo(unsigned r) { return __uint_as_float(r << 16); }
__device__ __forceinline__ float unpack_bf16_hi(unsigned r) {
    return __uint_as_float(r & 0xffff0000u);
}

__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void* smem_row) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const void* smem_row) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* src, int src_bytes) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(address), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

__device__ __forceinline__ void mma_m16n8k16_bf16(float d[4], const unsigned a[4],
                                                  const unsigned b[2], const float c[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                   "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

#endif
