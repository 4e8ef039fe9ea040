// Helpers shared by chapter 14's Hopper kernels (flash_attention_hopper.cu and
// flash_attention_hopper_bwd.cu): mbarriers, TMA copies, matrix descriptors and the wgmma
// instructions both use. Included inside each kernel's namespace; course_utils.toolbox.cuda.load_cuda
// puts this file in place of the #include (the compilers get one source string).

constexpr float LOG2E = 1.4426950408889634f;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// 2^x in one MUFU.EX2. volatile: the exponentials stay after the wgmma issued before them in
// program order, so that they run while the tensor cores work (instead of the compiler moving
// the issue behind them).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm volatile("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo -> the lower 16 bits
    return *reinterpret_cast<const uint32_t*>(&v);
}

// Row g + 8h of a 64 x COLS wgmma accumulator (acc, this lane's COLS / 2 floats), times `mul`,
// as COLS bf16 at out[0 .. COLS). A quad's four lanes hold the row: lane t the column pairs
// 8i + 2t, 8i + 2t + 1. Stored as they are, that is 4-byte stores of 16 bytes per row per
// instruction. Two rounds of shuffles transpose each 4 x 4 block of pairs inside the quad, so
// that lane t holds the 8 contiguous columns 8 (4a + t) .. + 7 and stores them with one 16-byte
// store. Every lane of the warp must call it (the shuffles); `store` false skips only the store
// (a row past the end of the tensor). The forward stores O with it, the backward dK and dV.
template <int COLS>
__device__ __forceinline__ void store_row_bf16(__nv_bfloat16* out, const float (&acc)[COLS / 2],
                                               int h, float mul, int t, bool store) {
    #pragma unroll
    for (int a = 0; a < COLS / 32; ++a) {
        uint32_t x[4];  // x[c]: lane t's pair in column group 4a + c
        #pragma unroll
        for (int c = 0; c < 4; ++c)
            x[c] = pack_bf16(acc[4 * (4 * a + c) + 2 * h] * mul, acc[4 * (4 * a + c) + 2 * h + 1] * mul);
        #pragma unroll
        for (int c = 0; c < 4; c += 2) {  // swap with lane t ^ 1 inside each 2 x 2 block
            const uint32_t got = __shfl_xor_sync(0xffffffff, (t & 1) ? x[c] : x[c + 1], 1);
            if (t & 1) x[c] = got; else x[c + 1] = got;
        }
        #pragma unroll
        for (int c = 0; c < 2; ++c) {     // swap the off-diagonal 2 x 2 blocks with lane t ^ 2
            const uint32_t got = __shfl_xor_sync(0xffffffff, (t & 2) ? x[c] : x[c + 2], 2);
            if (t & 2) x[c] = got; else x[c + 2] = got;
        }
        if (store) *reinterpret_cast<uint4*>(out + 8 * (4 * a + t)) = make_uint4(x[0], x[1], x[2], x[3]);
    }
}

// The block's dynamic shared memory as the tiles T, from its first 1024-byte boundary: the
// 128-byte swizzle repeats every 8 rows of 128 bytes, so a swizzled tile must start on one (the
// launch asks for sizeof(T) + 1024 bytes). The padding is added to smem_raw itself, not to its
// address cast to an integer: through the integer round trip the compiler loses that the
// pointer is in shared memory, and every thread store to a tile became a generic store (ST.E)
// with a 64-bit address instead of STS with a 32-bit one. In the backward that cost registers
// (128 query rows a step at D = 64 spilled) and up to 4% of its speed on an H100.
template <class T>
__device__ __forceinline__ T& shared_tiles() {
    extern __shared__ unsigned char smem_raw[];
    const uint32_t pad = (1024u - (smem_addr(smem_raw) & 1023u)) & 1023u;
    return *reinterpret_cast<T*>(smem_raw + pad);
}

// Named barrier `id` for the two consumer warpgroups (256 threads; 0 is __syncthreads): sync
// waits for all 256 arrivals, arrive adds this warpgroup's and goes on (ping-pong's hand-over).
__device__ __forceinline__ void named_sync(int id) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(2 * 128) : "memory");
}
__device__ __forceinline__ void named_arrive(int id) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(2 * 128) : "memory");
}

// ---------------------------------------------------------------- mbarriers and TMA

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
// One arrival that also tells the barrier how many bytes the coming TMA copies will deliver.
__device__ __forceinline__ void mbar_expect_bytes(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
                 "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// A ring of `n` buffers, each with a "full" barrier (one arrival: the producer's expect-bytes, then
// the copy's bytes) and an "empty" one (`readers` arrivals: every consumer thread that read it).
__device__ __forceinline__ void mbar_init_ring(uint64_t* full, uint64_t* empty, int n, int readers) {
    for (int s = 0; s < n; ++s) {
        mbar_init(&full[s], 1);
        mbar_init(&empty[s], readers);
    }
}
// After one thread's mbar_init calls: the barriers, visible to the block's other threads (and
// to TMA) once it passes its next __syncthreads.
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Has the phase of parity `phase` completed? (try_wait suspends the thread for a while first.)
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, int phase) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(smem_addr(bar)), "r"(phase) : "memory");
    return done != 0;
}
// Wait until the phase of parity `phase` has completed. A wrong parity or a missing arrival
// waits forever and hangs the GPU, and whatever waits on it (a notebook, a test). Built with
// -DFA_HOPPER_WATCHDOG (the tests do), a wait gives up after 2^31 cycles (about a second) with
// a trap, and the next CUDA call reports "unspecified launch failure" instead of hanging. The
// watchdog's loop is one PTX block: written in C++ around clock() and __trap(), it made ptxas
// spill the d = 128 overlapped consumers' registers. Off by default: what is measured is the
// plain loop.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int phase) {
#if defined(FA_HOPPER_WATCHDOG)
    asm volatile(
        "{\n.reg .pred done, late;\n.reg .u32 t0, t1;\n"
        "mov.u32 t0, %%clock;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@done bra DONE_%=;\n"
        "mov.u32 t1, %%clock;\n"
        "sub.u32 t1, t1, t0;\n"
        "setp.gt.u32 late, t1, %2;\n"
        "@late trap;\n"
        "bra WAIT_%=;\n"
        "DONE_%=:\n}\n" ::"r"(smem_addr(bar)), "r"(phase), "r"(1u << 31) : "memory");
#else
    while (!mbar_try_wait(bar, phase)) {
    }
#endif
}

// A probe's tiles T (with one mbarrier, `full`), the barrier initialised and visible to every
// thread of the block.
template <class T>
__device__ __forceinline__ T& probe_setup() {
    T& sm = shared_tiles<T>();
    if (threadIdx.x == 0) {
        mbar_init(&sm.full, 1);
        mbar_init_fence();
    }
    __syncthreads();
    return sm;
}

// Copy box (c0, c1, c2) of a 3D tensor map (c0 the fastest dimension) into shared memory; the
// barrier's transaction count drops by the box's bytes when it lands. Rows past the tensor's end
// arrive as zeros.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                         int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}

// ---------------------------------------------------------------- wgmma

// A shared-memory matrix descriptor for a 128-byte-swizzled tile: start address, the byte
// distance between panels of 64 columns (LBO) and between groups of 8 rows (SBO), swizzle mode 1.
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
    const uint64_t a = smem_addr(p);
    return ((a & 0x3FFFF) >> 4) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
           (uint64_t((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// The descriptor of the element `elems` bf16 past a tile's start, from the descriptor of the start:
// the start field holds the address / 16 in its low 14 bits, and a shared-memory address stays
// below 2^18 bytes, so adding elems * 2 / 16 to the low word never carries out of it. The kernels
// build one descriptor per tile and add each k-step's constant: smem_desc's masks and shifts for
// every wgmma (about 13 instructions between two wgmma) become one add (about 7).
__device__ __forceinline__ uint64_t desc_plus(uint64_t d, uint32_t elems) {
    const uint32_t lo = static_cast<uint32_t>(d) + elems * 2 / 16;
    return (d & 0xFFFFFFFF00000000ull) | lo;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keep the compiler from moving reads or writes of accumulator registers across a wait.
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
    #pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int R>
__device__ __forceinline__ void fence_regs(uint32_t (&d)[R]) {
    #pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// The operands of wgmma after the descriptors are immediates: scale-d (a predicate here: 0 on the
// first k-step overwrites D instead of adding to it), imm-scale-a and imm-scale-b (1: no
// negation), then imm-trans-a and imm-trans-b. trans = 0: the operand is K-major (the reduction
// dimension runs along the 128-byte rows of the tile); trans = 1: it is MN-major (M or N runs
// along them). The register form (A from registers) has no imm-trans-a: its last immediate is
// imm-trans-b.

// D[64 x 128] (+)= A[64 x 16] B[16 x 128], A and B in shared memory, both K-major: S = Q K^T in
// the forward, S^T and dP^T with 128 queries in the backward (D = 64).
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(accumulate));
}

// The same product by its width N: each kernel adds the widths it uses (the forward 176, the
// backward 64).
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate);
template <>
__device__ __forceinline__ void wgmma_ss<128>(float (&d)[64], uint64_t a, uint64_t b, int accumulate) { wgmma_ss_n128(d, a, b, accumulate); }

// D[64 x 64] += A[64 x 16] B[16 x 64], A in registers (4 x bf16x2), B in shared memory MN-major.
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, 1, 1, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// D[64 x 128] += A[64 x 16] B[16 x 128], A in registers (4 x bf16x2), B in shared memory MN-major.
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, 1, 1, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
