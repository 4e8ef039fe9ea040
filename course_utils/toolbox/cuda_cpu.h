// cuda_cpu.h: the CUDA thread model on the CPU, for checking a kernel's *results* without a GPU.
//
// course_utils.toolbox.cuda_cpu compiles a student's CUDA C++ source with the host g++ after this
// header, together with a small generated launcher, and runs the executable as a subprocess.
// It defines CUDA_CPU_EMULATION, which a source may test.
//
// What it emulates
//   * blocks run one after another; the threads of a block are fibers (ucontext), run in a fixed
//     order: thread 0 runs until its next __syncthreads() or warp function (or its end), then
//     thread 1, ... A warp function completes when the last lane of its mask arrives, and the
//     run starts again from the first thread that can go on: a warp runs as far as it can
//     before the warps after it run at all. When every thread of the block waits at a
//     __syncthreads(), all go on. The launch can ask for the reverse order (the last thread,
//     and so the last warp, first): a kernel without races gives the same bits in both orders,
//     one with a missing barrier (between threads or between warps) does not.
//   * threadIdx, blockIdx, blockDim, gridDim are per fiber; __shared__ variables live in one
//     section, filled with 0xFF bytes (NaN as float and bf16, -1 as int) before each block, so
//     a read of a slot no thread stored this block shows.
//   * warp functions, as warp collectives (warp w = threads 32w .. 32w+31 of the block, in
//     threadIdx.x-fastest order; the lanes of the mask meet, exchange, go on):
//       __shfl_sync, __shfl_up_sync, __shfl_down_sync, __shfl_xor_sync (any 1- to 8-byte value,
//       with width), __syncwarp(mask), __ballot_sync, __any_sync, __all_sync; __activemask()
//       (the lanes of the warp that have not returned);
//       the tensor-core helpers of mma_helpers.cuh (a kernel includes "mma_helpers.cuh", on the
//       GPU inline PTX): mma_m16n8k16_bf16 (mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32:
//       the bf16 products summed exactly in double, rounded to float, plus C in float, as
//       course_utils.library.mma.mma_m16n8k16), ldmatrix_x4 and ldmatrix_x4_trans (from __shared__
//       memory only, 16-byte aligned rows), pack_bf16 / unpack_bf16_lo / unpack_bf16_hi;
//       and cp_async16 / cp_async_commit / cp_async_wait<N> (per thread, not collectives: a
//       copy lands in shared memory only at the wait that covers its group);
//       __nv_bfloat16 / __nv_bfloat162 as storage with __float2bfloat16(_rn), __bfloat162float,
//       __floats2bfloat162_rn (round to nearest even), no bf16 arithmetic.
//   * checks: a barrier reached by only part of the block (some threads returned, or waited at
//     another __syncthreads), a warp function not every lane of its mask calls (a lane returned,
//     waits at a barrier or in another warp function, or passed another mask; mma and ldmatrix:
//     all 32 lanes, from the same line), a mask without the calling lane or with lanes that do
//     not exist, a shuffle that reads a lane outside its mask, an ldmatrix row outside shared
//     memory or not 16-byte aligned, an access past the end of a buffer (each buffer ends at a
//     page that cannot be touched: the faulting thread is named), a store before its start (a
//     guard band filled with 0xFF, checked after the run), a thread's stack overflow, a kernel
//     that does not finish (alarm).
// What it cannot show: speed; races between threads that the fixed order hides (two threads
// that need a barrier between them only at another interleaving); lockstep execution (lanes of
// a warp run one after another between warp functions: a kernel that relies on implicit warp
// synchronisation without __syncwarp is not caught unless the order changes its result); the
// GPU's floating-point contractions (FMA) and the tensor cores' own accumulation order; inline
// PTX (asm) of any kind: kernels call the helpers of mma_helpers.cuh instead.
#pragma once

#undef _FORTIFY_SOURCE  // its longjmp check refuses a jump to another fiber's stack
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <setjmp.h>
#include <signal.h>
#include <source_location>
#include <type_traits>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

// ------------------------------------------------------------------ CUDA keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __constant__
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static __attribute__((section("cuda_cpu_shared")))
#define __syncthreads() ::cuda_cpu::barrier(__LINE__)
#define CUDA_CPU_EMULATION 1  // a kernel can test it: #ifdef CUDA_CPU_EMULATION
#define __threadfence() ((void)0)
#define __threadfence_block() ((void)0)

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
        : x(x_), y(y_), z(z_) {}
};
struct float2 {
    float x, y;
};
struct __attribute__((aligned(16))) float4 {
    float x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

namespace cuda_cpu {

enum State { READY, AT_BARRIER, AT_WARP, DONE };

// A warp function a lane waits in (see "warp functions" below): what it called and with what.
enum WarpKind { SHFL, SHFL_UP, SHFL_DOWN, SHFL_XOR, SYNCWARP, BALLOT, ANY, ALL, MMA, LDMATRIX,
                LDMATRIX_TRANS };
inline const char* const warp_names[] = {
    "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync", "__syncwarp",
    "__ballot_sync", "__any_sync", "__all_sync", "mma_m16n8k16_bf16", "ldmatrix_x4",
    "ldmatrix_x4_trans"};

struct WarpCall {
    WarpKind kind;
    int line;
    unsigned mask;
    int arg, width;                  // a shuffle's lane, delta or lane mask; its width
    unsigned long long value;        // the lane's value (its bytes), then the result
    const void* in[3];               // mma: a, b, c; ldmatrix: the row address
    void* out;                       // mma: d; ldmatrix: the 4 registers
};

struct Fiber {
    ucontext_t context;  // the first entry (makecontext)
    jmp_buf resume;      // later ones: _setjmp/_longjmp, which save no signal mask (no syscall)
    bool started;
    char* stack;  // its lowest page is a guard (PROT_NONE)
    uint3 index;
    State state;
    int barrier_line;
    WarpCall call;  // while state == AT_WARP
    // cp_async16 copies not yet done (mma_helpers.cuh): they land at the cp_async_wait that
    // covers their group, not before (group 0: not committed yet)
    struct Copy {
        char* dst;
        const char* src;
        int bytes;
        unsigned group;
    } copies[128];
    unsigned copy_count, groups;
};

struct Buffer {
    const char* name;
    char* mapping;  // PROT_NONE page, guard band, data (ending at a PROT_NONE page)
    size_t mapping_bytes;
    char* data;
    size_t count, element_bytes;
    char* end_page;  // the first byte past the data: not accessible
};

constexpr size_t STACK_BYTES = 256 * 1024;
constexpr size_t GUARD_BYTES = 256;  // the band in front of each buffer, filled with 0xFF

inline ucontext_t scheduler;
inline jmp_buf scheduler_resume;
inline Fiber* fibers = nullptr;
inline unsigned fiber_count = 0;
inline Fiber* current = nullptr;
inline uint3 block_index{0, 0, 0};
inline dim3 grid_size, block_size;
inline void (*body)() = nullptr;
inline Buffer buffers[64];
inline int buffer_count = 0;
inline size_t page = 4096;
inline unsigned timeout_s = 20;
inline char* dynamic_shared_memory = nullptr;
inline size_t dynamic_shared_bytes = 0;
inline char* dynamic_shared_end = nullptr;  // a page that cannot be touched
inline bool reverse_order = false;  // run the fibers last to first (a second schedule)
inline int barrier_lines[64];  // the source lines of the __syncthreads() that were reached
inline int barrier_line_count = 0;

[[noreturn]] inline void fail(const char* kind, const char* message) {
    // one line the Python side reads: "CUDA_CPU_ERROR <kind>: <message>"
    char line[1024];
    int n = snprintf(line, sizeof line, "\nCUDA_CPU_ERROR %s: %s\n", kind, message);
    if (n > 0) {
        ssize_t ignored = write(2, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
        (void)ignored;
    }
    _exit(3);
}

inline void where(char* out, size_t size) {
    if (current)
        snprintf(out, size, "thread (%u, %u, %u) of block (%u, %u, %u)", current->index.x,
                 current->index.y, current->index.z, block_index.x, block_index.y, block_index.z);
    else
        snprintf(out, size, "outside the kernel");
}

inline const uint3& thread_index() { return current->index; }

// The running fiber stops here; the scheduler continues after its _setjmp.
inline void yield_to_scheduler(Fiber* self) {
    if (_setjmp(self->resume) == 0) _longjmp(scheduler_resume, 1);
}

inline void barrier(int line) {
    bool known = false;
    for (int i = 0; i < barrier_line_count; ++i) known = known || barrier_lines[i] == line;
    if (!known && barrier_line_count < 64) barrier_lines[barrier_line_count++] = line;
    current->state = AT_BARRIER;
    current->barrier_line = line;
    yield_to_scheduler(current);
}

inline void trampoline() {
    body();
    current->state = DONE;
    _longjmp(scheduler_resume, 1);
}

extern "C" char __start_cuda_cpu_shared[] __attribute__((weak));
extern "C" char __stop_cuda_cpu_shared[] __attribute__((weak));

inline void poison_shared(size_t dynamic_bytes) {
    if (__start_cuda_cpu_shared && __stop_cuda_cpu_shared)
        memset(__start_cuda_cpu_shared, 0xFF, __stop_cuda_cpu_shared - __start_cuda_cpu_shared);
    if (dynamic_shared_memory) memset(dynamic_shared_memory, 0xFF, dynamic_bytes);
}

// ------------------------------------------------------------------ warp functions
// A lane that calls a warp function (a shuffle, a vote, __syncwarp, the mma and ldmatrix of
// mma_helpers.cuh) records the call and waits (AT_WARP). When no fiber can run any more, the
// scheduler completes every call whose lanes have all arrived (the lanes its mask names, all 32
// for mma and ldmatrix, each with the same function and mask), computes every lane's result and
// lets them go on. A call that cannot complete (a lane of its mask returned, waits at a
// __syncthreads() or in another warp function, or passed another mask) is an error that names
// the warp, the lanes and the lines.

inline unsigned fiber_number(const Fiber* f) { return (unsigned)(f - fibers); }

// "0-15, 17, 20-31": the lanes of a mask
inline void lanes_text(unsigned mask, char* out, size_t size) {
    size_t used = 0;
    out[0] = 0;
    for (int l = 0; l < 32 && used + 12 < size;) {
        if (!(mask >> l & 1)) { ++l; continue; }
        int e = l;
        while (e + 1 < 32 && (mask >> (e + 1) & 1)) ++e;
        int n = e > l ? snprintf(out + used, size - used, "%s%d-%d", used ? ", " : "", l, e)
                      : snprintf(out + used, size - used, "%s%d", used ? ", " : "", l);
        used += n > 0 ? (size_t)n : 0;
        l = e + 1;
    }
}

inline unsigned warp_lanes(unsigned warp) {  // the lanes that exist (a last, partial warp)
    unsigned n = fiber_count - warp * 32;
    return n >= 32 ? 0xffffffffu : (1u << n) - 1u;
}

inline void warp_where(char* out, size_t size, unsigned warp) {
    snprintf(out, size, "warp %u (threads %u-%u) of block (%u, %u, %u)", warp, warp * 32,
             warp * 32 + (fiber_count - warp * 32 >= 32 ? 31 : fiber_count - warp * 32 - 1),
             block_index.x, block_index.y, block_index.z);
}

inline bool aligned_call(WarpKind k) { return k == MMA || k == LDMATRIX || k == LDMATRIX_TRANS; }

// The calling lane records its call and waits until the scheduler completes it.
inline unsigned long long warp_call(WarpKind kind, int line, unsigned mask,
                                    unsigned long long value, int arg = 0, int width = 32,
                                    const void* in0 = nullptr, const void* in1 = nullptr,
                                    const void* in2 = nullptr, void* out = nullptr) {
    Fiber* self = current;
    unsigned lane = fiber_number(self) % 32, warp = fiber_number(self) / 32;
    char who[160], message[700];
    if (!(mask >> lane & 1)) {
        where(who, sizeof who);
        snprintf(message, sizeof message,
                 "%s (lane %u of warp %u) called %s at line %d with the mask 0x%08x, which does "
                 "not name its own lane: a lane that calls a warp function must be in its mask",
                 who, lane, warp, warp_names[kind], line, mask);
        fail("warp", message);
    }
    if (mask & ~warp_lanes(warp)) {
        char lanes[200];
        lanes_text(mask & ~warp_lanes(warp), lanes, sizeof lanes);
        where(who, sizeof who);
        snprintf(message, sizeof message,
                 "%s called %s at line %d with the mask 0x%08x, which names lanes %s of warp %u: "
                 "they do not exist (the block has %u threads; %s)", who, warp_names[kind], line,
                 mask, lanes, warp, fiber_count,
                 aligned_call(kind) ? "mma and ldmatrix need whole warps: a multiple of 32 "
                                      "threads per block"
                                    : "pass a mask of the lanes that exist");
        fail("warp", message);
    }
    if ((kind == SHFL || kind == SHFL_UP || kind == SHFL_DOWN || kind == SHFL_XOR) &&
        (width < 1 || width > 32 || (width & (width - 1)))) {
        where(who, sizeof who);
        snprintf(message, sizeof message,
                 "%s called %s at line %d with width %d: the width must be a power of 2, 1 to 32",
                 who, warp_names[kind], line, width);
        fail("warp", message);
    }
    self->call = WarpCall{kind, line, mask, arg, width, value, {in0, in1, in2}, out};
    self->state = AT_WARP;
    yield_to_scheduler(self);
    return self->call.value;
}

inline float bf16_bits_to_float(unsigned bits16) {
    unsigned u = bits16 << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// Complete the call of the lanes `mask` of warp `warp` (every one is there with the same call).
inline void complete_warp_call(unsigned warp, unsigned mask) {
    Fiber* lanes = fibers + warp * 32;
    const WarpCall& first = lanes[__builtin_ctz(mask)].call;
    unsigned long long results[32] = {};
    char message[700], who[200];
    switch (first.kind) {
    case SHFL: case SHFL_UP: case SHFL_DOWN: case SHFL_XOR:
        for (unsigned l = 0; l < 32; ++l) {
            if (!(mask >> l & 1)) continue;
            const WarpCall& c = lanes[l].call;
            int w = c.width, start = (int)l & ~(w - 1), src = (int)l;
            bool own = false;
            if (c.kind == SHFL) src = start + (c.arg & (w - 1));
            else if (c.kind == SHFL_UP) { src = (int)l - c.arg; own = c.arg < 0 || src < start; }
            else if (c.kind == SHFL_DOWN) { src = (int)l + c.arg; own = c.arg < 0 || src >= start + w; }
            else { src = (int)l ^ (c.arg & 31); own = src >= start + w; }
            if (own) { results[l] = c.value; continue; }
            if (!(mask >> src & 1)) {
                warp_where(who, sizeof who, warp);
                snprintf(message, sizeof message,
                         "%s: lane %u's %s at line %d reads lane %d, which is not in the mask "
                         "0x%08x (a lane outside the mask gives no value: the result would be "
                         "undefined on a GPU)", who, l, warp_names[c.kind], c.line, src, mask);
                fail("warp", message);
            }
            results[l] = lanes[src].call.value;
        }
        break;
    case SYNCWARP:
        break;
    case BALLOT: case ANY: case ALL: {
        unsigned ballot = 0;
        for (unsigned l = 0; l < 32; ++l)
            if ((mask >> l & 1) && lanes[l].call.value) ballot |= 1u << l;
        unsigned long long r = first.kind == BALLOT ? ballot
                             : first.kind == ANY    ? (ballot != 0)
                                                    : (ballot == mask);
        for (unsigned l = 0; l < 32; ++l) results[l] = r;
        break;
    }
    case MMA: {  // D (16 x 8) = A (16 x 16) @ B (16 x 8) + C, fragments as in course_utils.library.mma
        float A[16][16], B[16][8], C[16][8];
        for (unsigned l = 0; l < 32; ++l) {
            const unsigned* a = (const unsigned*)lanes[l].call.in[0];
            const unsigned* b = (const unsigned*)lanes[l].call.in[1];
            const float* c = (const float*)lanes[l].call.in[2];
            unsigned g = l / 4, t = l % 4;
            for (int h = 0; h < 2; ++h) {  // h: the low / high 16 bits of a register
                A[g][2 * t + h] = bf16_bits_to_float(a[0] >> (16 * h) & 0xffff);
                A[g + 8][2 * t + h] = bf16_bits_to_float(a[1] >> (16 * h) & 0xffff);
                A[g][2 * t + 8 + h] = bf16_bits_to_float(a[2] >> (16 * h) & 0xffff);
                A[g + 8][2 * t + 8 + h] = bf16_bits_to_float(a[3] >> (16 * h) & 0xffff);
                B[2 * t + h][g] = bf16_bits_to_float(b[0] >> (16 * h) & 0xffff);
                B[2 * t + 8 + h][g] = bf16_bits_to_float(b[1] >> (16 * h) & 0xffff);
                C[g][2 * t + h] = c[h];
                C[g + 8][2 * t + h] = c[2 + h];
            }
        }
        for (unsigned l = 0; l < 32; ++l) {  // after every C was read: d may be c
            float* d = (float*)lanes[l].call.out;
            unsigned g = l / 4, t = l % 4;
            for (int i = 0; i < 4; ++i) {
                unsigned row = i < 2 ? g : g + 8, col = 2 * t + i % 2;
                double sum = 0.0;  // the products of bf16 values are exact in double
                for (int k = 0; k < 16; ++k) sum += (double)A[row][k] * (double)B[k][col];
                d[i] = (float)sum + C[row][col];
            }
        }
        break;
    }
    case LDMATRIX: case LDMATRIX_TRANS: {
        // lanes 8j .. 8j+7 give the rows of matrix j; lane l receives, in register j, row l / 4,
        // columns 2 (l % 4) and + 1 of matrix j (of its transpose with .trans), low half first
        unsigned regs[32][4];
        for (unsigned l = 0; l < 32; ++l) {
            unsigned g = l / 4, t = l % 4;
            for (unsigned j = 0; j < 4; ++j) {
                unsigned short lo, hi;
                if (first.kind == LDMATRIX) {
                    const unsigned short* row = (const unsigned short*)lanes[8 * j + g].call.in[0];
                    lo = row[2 * t];
                    hi = row[2 * t + 1];
                } else {
                    lo = ((const unsigned short*)lanes[8 * j + 2 * t].call.in[0])[g];
                    hi = ((const unsigned short*)lanes[8 * j + 2 * t + 1].call.in[0])[g];
                }
                regs[l][j] = (unsigned)lo | (unsigned)hi << 16;
            }
        }
        for (unsigned l = 0; l < 32; ++l) memcpy(lanes[l].call.out, regs[l], sizeof regs[l]);
        break;
    }
    }
    for (unsigned l = 0; l < 32; ++l)
        if (mask >> l & 1) {
            lanes[l].call.value = results[l];
            lanes[l].state = READY;
        }
}

// Whether every lane that call `c`'s mask names waits in the same call (function, mask; for mma
// and ldmatrix the same line too).
inline bool group_complete(unsigned warp, const WarpCall& c) {
    const Fiber* lanes = fibers + warp * 32;
    for (unsigned k = 0; k < 32; ++k) {
        if (!(c.mask >> k & 1)) continue;
        const Fiber& o = lanes[k];
        if (!(o.state == AT_WARP && o.call.kind == c.kind && o.call.mask == c.mask &&
              (!aligned_call(c.kind) || o.call.line == c.line)))
            return false;
    }
    return true;
}

// Where a lane is, for a message: "had returned", "waits at the __syncthreads() of line 12", ...
inline void lane_state_text(const Fiber& f, char* out, size_t size) {
    if (f.state == DONE) snprintf(out, size, "had returned");
    else if (f.state == AT_BARRIER)
        snprintf(out, size, "wait%%s at the __syncthreads() of line %d", f.barrier_line);
    else
        snprintf(out, size, "wait%%s in the %s of line %d (mask 0x%08x)", warp_names[f.call.kind],
                 f.call.line, f.call.mask);
}

// Complete every warp call whose lanes are all there; true if any was. With none complete and
// a lane still waiting in one, report the first such call that cannot complete. (The scheduler
// completes a call as soon as its last lane arrives; this is the check when no fiber can run.)
inline bool settle_warps() {
    bool progressed = false, waiting = false;
    unsigned warps = (fiber_count + 31) / 32;
    for (unsigned w = 0; w < warps; ++w) {
        Fiber* lanes = fibers + w * 32;
        unsigned n = fiber_count - w * 32 >= 32 ? 32 : fiber_count - w * 32, seen = 0;
        for (unsigned l = 0; l < n; ++l) {
            if (lanes[l].state != AT_WARP || (seen >> l & 1)) continue;
            const WarpCall& c = lanes[l].call;
            if (group_complete(w, c)) {
                seen |= c.mask;
                complete_warp_call(w, c.mask);
                progressed = true;
            } else {
                seen |= 1u << l;
                waiting = true;
            }
        }
    }
    if (progressed || !waiting) return progressed;
    for (unsigned w = 0; w < warps; ++w) {
        Fiber* lanes = fibers + w * 32;
        unsigned n = fiber_count - w * 32 >= 32 ? 32 : fiber_count - w * 32;
        for (unsigned l = 0; l < n; ++l) {
            if (lanes[l].state != AT_WARP) continue;
            const WarpCall& c = lanes[l].call;
            // the lanes of the mask grouped by where they are
            unsigned arrived = 0, grouped = 0;
            for (unsigned k = 0; k < 32; ++k)
                if ((c.mask >> k & 1) && lanes[k].state == AT_WARP && lanes[k].call.kind == c.kind &&
                    lanes[k].call.mask == c.mask &&
                    (!aligned_call(c.kind) || lanes[k].call.line == c.line))
                    arrived |= 1u << k;
            char message[1400], who[200], lanes_a[200];
            warp_where(who, sizeof who, w);
            lanes_text(arrived, lanes_a, sizeof lanes_a);
            int used = snprintf(message, sizeof message,
                                "%s: the %s at line %d (mask 0x%08x) was reached by lane%s %s",
                                who, warp_names[c.kind], c.line, c.mask,
                                __builtin_popcount(arrived) > 1 ? "s" : "", lanes_a);
            grouped = arrived;
            for (unsigned k = 0; k < 32 && used < (int)sizeof message - 200; ++k) {
                if (!(c.mask >> k & 1) || (grouped >> k & 1)) continue;
                char state[160], lanes_b[200], format[200];
                lane_state_text(lanes[k], format, sizeof format);
                unsigned same = 0;  // the other lanes of the mask in the same place
                for (unsigned q = k; q < 32; ++q) {
                    if (!(c.mask >> q & 1) || (grouped >> q & 1)) continue;
                    char other[200];
                    lane_state_text(lanes[q], other, sizeof other);
                    if (strcmp(other, format) == 0) same |= 1u << q;
                }
                grouped |= same;
                lanes_text(same, lanes_b, sizeof lanes_b);
                bool many = __builtin_popcount(same) > 1;
                snprintf(state, sizeof state, format, many ? "" : "s");
                used += snprintf(message + used, sizeof message - used, "; lane%s %s %s",
                                 many ? "s" : "", lanes_b, state);
            }
            snprintf(message + used, sizeof message - used,
                     ". Every lane its mask names must call the same warp function with the same "
                     "mask%s: a warp function inside a branch that only part of the warp takes, "
                     "or a return before it?",
                     aligned_call(c.kind) ? " (mma and ldmatrix: all 32 lanes, the same line)"
                                          : "");
            fail("warp", message);
        }
    }
    return false;
}

inline void run_block(size_t dynamic_bytes) {
    poison_shared(dynamic_bytes);
    unsigned t = 0;
    for (unsigned z = 0; z < block_size.z; ++z)
        for (unsigned y = 0; y < block_size.y; ++y)
            for (unsigned x = 0; x < block_size.x; ++x, ++t) {
                Fiber& f = fibers[t];
                f.index = {x, y, z};
                f.state = READY;
                getcontext(&f.context);
                f.context.uc_stack.ss_sp = f.stack + page;
                f.context.uc_stack.ss_size = STACK_BYTES;
                f.context.uc_link = &scheduler;
                f.started = false;
                f.copy_count = f.groups = 0;  // copies a thread never waited for are dropped
                makecontext(&f.context, trampoline, 0);
            }
    for (;;) {
        for (unsigned k = 0; k < fiber_count; ++k) {
            unsigned i = reverse_order ? fiber_count - 1 - k : k;
            if (fibers[i].state != READY) continue;
            current = &fibers[i];
            if (_setjmp(scheduler_resume) == 0) {  // back here when the fiber yields or ends
                if (current->started) _longjmp(current->resume, 1);
                current->started = true;
                swapcontext(&scheduler, &current->context);
            }
            // A warp call completes when its last lane arrives, and the scan starts again from
            // the first fiber (in this order) that can run: a warp goes on as far as it can
            // before the warps after it run at all, so a warp that reads a tile other warps
            // have not stored yet (a missing barrier) reads NaN, in one order or the other.
            if (current->state == AT_WARP && group_complete(i / 32, current->call)) {
                complete_warp_call(i / 32, current->call.mask);
                k = (unsigned)-1;
            }
        }
        current = nullptr;
        if (settle_warps()) continue;  // warp functions whose lanes have all arrived
        unsigned waiting = 0, done = 0, first_done = fiber_count, other_line = 0;
        int line = 0;
        unsigned at_line = 0;
        for (unsigned i = 0; i < fiber_count; ++i) {
            if (fibers[i].state == DONE) {
                ++done;
                if (first_done == fiber_count) first_done = i;
            } else {
                ++waiting;
                if (line == 0) line = fibers[i].barrier_line;
                if (fibers[i].barrier_line == line) ++at_line;
                else other_line = fibers[i].barrier_line;
            }
        }
        if (waiting == 0) return;
        char message[600];
        if (done) {
            const Fiber& f = fibers[first_done];
            snprintf(message, sizeof message,
                     "block (%u, %u, %u): the __syncthreads() at line %d was reached by %u of "
                     "the block's %u threads; the other %u had returned (the first: thread "
                     "(%u, %u, %u)): an early return before __syncthreads",
                     block_index.x, block_index.y, block_index.z, line, waiting, fiber_count, done,
                     f.index.x, f.index.y, f.index.z);
            fail("barrier", message);
        }
        if (at_line != waiting) {
            snprintf(message, sizeof message,
                     "block (%u, %u, %u): threads wait at different barriers, %u at the "
                     "__syncthreads() of line %d and %u at line %u: a barrier inside a branch "
                     "that not every thread of the block takes",
                     block_index.x, block_index.y, block_index.z, at_line, line, waiting - at_line,
                     other_line);
            fail("barrier", message);
        }
        for (unsigned i = 0; i < fiber_count; ++i) fibers[i].state = READY;
    }
}

// ------------------------------------------------------------------ faults
inline void on_signal(int sig, siginfo_t* info, void*) {
    char who[160], message[700];
    where(who, sizeof who);
    if (sig == SIGALRM) {
        snprintf(message, sizeof message,
                 "the kernel did not finish within %u s (%s was running): a loop that never "
                 "ends?", timeout_s, who);
        fail("timeout", message);
    }
    if (sig == SIGFPE) {
        snprintf(message, sizeof message, "%s divided an integer by zero", who);
        fail("crash", message);
    }
    char* address = (char*)info->si_addr;
    for (int b = 0; b < buffer_count; ++b) {
        const Buffer& buf = buffers[b];
        if (address >= buf.end_page && address < buf.end_page + page) {
            long element = (long)((address - buf.data) / (long)buf.element_bytes);
            snprintf(message, sizeof message,
                     "%s accessed %s[%ld], past its last element %s[%ld] (it holds %zu)", who,
                     buf.name, element, buf.name, (long)buf.count - 1, buf.count);
            fail("out of bounds", message);
        }
        if (address >= buf.mapping && address < buf.mapping + page) {
            long element = (long)((address - buf.data) / (long)buf.element_bytes);
            snprintf(message, sizeof message, "%s accessed %s[%ld], before its first element",
                     who, buf.name, element);
            fail("out of bounds", message);
        }
    }
    if (dynamic_shared_end && address >= dynamic_shared_end && address < dynamic_shared_end + page) {
        snprintf(message, sizeof message,
                 "%s accessed shared memory %ld bytes past the end of the dynamic shared memory "
                 "(the launch gives %zu bytes: extern __shared__ holds less than the tiles need)",
                 who, (long)(address - dynamic_shared_end), dynamic_shared_bytes);
        fail("out of bounds", message);
    }
    for (unsigned i = 0; i < fiber_count; ++i)
        if (address >= fibers[i].stack && address < fibers[i].stack + page) {
            snprintf(message, sizeof message,
                     "%s overflowed its stack (%zu KiB in this emulation): a local array too "
                     "large, or a recursion", who, STACK_BYTES / 1024);
            fail("crash", message);
        }
    snprintf(message, sizeof message,
             "%s accessed memory at %p, which belongs to no buffer of the launch (signal %d): an "
             "index far out of range, or a pointer not from the kernel's arguments", who,
             (void*)address, sig);
    fail("out of bounds", message);
}

inline void install_handlers() {
    static char alternate[64 * 1024];
    stack_t ss{};
    ss.ss_sp = alternate;
    ss.ss_size = sizeof alternate;
    sigaltstack(&ss, nullptr);
    struct sigaction sa{};
    sa.sa_sigaction = on_signal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);
    sigaction(SIGFPE, &sa, nullptr);
    sigaction(SIGALRM, &sa, nullptr);
}

// ------------------------------------------------------------------ buffers and the launch
inline char* map_or_fail(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) fail("setup", "could not map memory for the launch");
    return (char*)p;
}

inline char* add_buffer(const char* name, size_t count, size_t element_bytes) {
    if (buffer_count == 64) fail("setup", "more than 64 buffers");
    Buffer& b = buffers[buffer_count++];
    size_t bytes = count * element_bytes;
    size_t body_pages = (GUARD_BYTES + bytes + page - 1) / page;
    b.mapping_bytes = (body_pages + 2) * page;
    b.mapping = map_or_fail(b.mapping_bytes);
    b.end_page = b.mapping + (body_pages + 1) * page;
    b.data = b.end_page - bytes;
    b.name = name;
    b.count = count;
    b.element_bytes = element_bytes;
    memset(b.data - GUARD_BYTES, 0xFF, GUARD_BYTES);
    mprotect(b.mapping, page, PROT_NONE);
    mprotect(b.end_page, page, PROT_NONE);
    return b.data;
}

inline void check_guards() {
    for (int i = 0; i < buffer_count; ++i) {
        const Buffer& b = buffers[i];
        const unsigned char* band = (const unsigned char*)(b.data - GUARD_BYTES);
        for (size_t k = 0; k < GUARD_BYTES; ++k)
            if (band[k] != 0xFF) {
                char message[300];
                long element = -(long)((GUARD_BYTES - k + b.element_bytes - 1) / b.element_bytes);
                snprintf(message, sizeof message,
                         "a thread stored into %s[%ld], before its first element", b.name,
                         element);
                fail("out of bounds", message);
            }
    }
}

inline void launch(dim3 grid, dim3 block, size_t dynamic_bytes, void (*kernel_body)()) {
    grid_size = grid;
    block_size = block;
    body = kernel_body;
    fiber_count = block.x * block.y * block.z;
    if (fiber_count == 0 || fiber_count > 1024 || block.z > 64)
        fail("setup", "a block has 1 to 1024 threads (and blockDim.z <= 64)");
    if (dynamic_bytes) {  // ends (16-byte aligned) at a page that cannot be touched
        size_t padded = (dynamic_bytes + 15) / 16 * 16, pages = (padded + page - 1) / page;
        char* mapping = map_or_fail((pages + 1) * page);
        dynamic_shared_end = mapping + pages * page;
        mprotect(dynamic_shared_end, page, PROT_NONE);
        dynamic_shared_memory = dynamic_shared_end - padded;
    }
    dynamic_shared_bytes = dynamic_bytes;
    fibers = new Fiber[fiber_count];
    for (unsigned i = 0; i < fiber_count; ++i) {
        fibers[i].stack = map_or_fail(STACK_BYTES + page);
        mprotect(fibers[i].stack, page, PROT_NONE);
    }
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                block_index = {x, y, z};
                run_block(dynamic_bytes);
            }
    check_guards();
}

}  // namespace cuda_cpu

#define threadIdx (::cuda_cpu::thread_index())
#define blockIdx (static_cast<const uint3&>(::cuda_cpu::block_index))
#define blockDim (static_cast<const dim3&>(::cuda_cpu::block_size))
#define gridDim (static_cast<const dim3&>(::cuda_cpu::grid_size))
constexpr int warpSize = 32;

// ------------------------------------------------------------------ device functions
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __exp2f(float x) { return exp2f(x); }
inline float exp10f(float x) { return powf(10.0f, x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}
inline int __float_as_int(float f) {
    int i;
    memcpy(&i, &f, sizeof i);
    return i;
}
inline float __uint_as_float(unsigned int i) {
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int i;
    memcpy(&i, &f, sizeof i);
    return i;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
template <class T>
inline T __ldg(const T* p) { return *p; }

// ------------------------------------------------------------------ warp functions (the API)
// Shuffles of any value of 1 to 8 bytes (float, int, unsigned, double, long long, ...); the
// source_location parameter is the emulator's: it gives the caller's line to the messages.
namespace cuda_cpu {
template <class T>
inline T shuffle(WarpKind kind, unsigned mask, T var, int arg, int width, int line) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>,
                  "a shuffle moves a value of at most 8 bytes");
    unsigned long long bits = 0;
    memcpy(&bits, &var, sizeof var);
    bits = warp_call(kind, line, mask, bits, arg, width);
    T out;
    memcpy(&out, &bits, sizeof out);
    return out;
}
}  // namespace cuda_cpu

template <class T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = 32,
                     std::source_location at = std::source_location::current()) {
    return ::cuda_cpu::shuffle(::cuda_cpu::SHFL, mask, var, srcLane, width, (int)at.line());
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32,
                        std::source_location at = std::source_location::current()) {
    return ::cuda_cpu::shuffle(::cuda_cpu::SHFL_UP, mask, var, (int)delta, width, (int)at.line());
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32,
                          std::source_location at = std::source_location::current()) {
    return ::cuda_cpu::shuffle(::cuda_cpu::SHFL_DOWN, mask, var, (int)delta, width,
                               (int)at.line());
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = 32,
                         std::source_location at = std::source_location::current()) {
    return ::cuda_cpu::shuffle(::cuda_cpu::SHFL_XOR, mask, var, laneMask, width, (int)at.line());
}
inline void __syncwarp(unsigned mask = 0xffffffffu,
                       std::source_location at = std::source_location::current()) {
    ::cuda_cpu::warp_call(::cuda_cpu::SYNCWARP, (int)at.line(), mask, 0);
}
inline unsigned __ballot_sync(unsigned mask, int predicate,
                              std::source_location at = std::source_location::current()) {
    return (unsigned)::cuda_cpu::warp_call(::cuda_cpu::BALLOT, (int)at.line(), mask,
                                           predicate != 0);
}
inline int __any_sync(unsigned mask, int predicate,
                      std::source_location at = std::source_location::current()) {
    return (int)::cuda_cpu::warp_call(::cuda_cpu::ANY, (int)at.line(), mask, predicate != 0);
}
inline int __all_sync(unsigned mask, int predicate,
                      std::source_location at = std::source_location::current()) {
    return (int)::cuda_cpu::warp_call(::cuda_cpu::ALL, (int)at.line(), mask, predicate != 0);
}
// The lanes of the caller's warp that have not returned (a GPU gives the lanes that execute
// the call together, which after a divergent branch may be fewer).
inline unsigned __activemask() {
    using namespace ::cuda_cpu;
    unsigned first = fiber_number(current) / 32 * 32, mask = 0;
    for (unsigned l = 0; l < 32 && first + l < fiber_count; ++l)
        if (fibers[first + l].state != DONE) mask |= 1u << l;
    return mask;
}

// ------------------------------------------------------------------ bfloat16
// The storage type and its conversions (round to nearest even; a NaN stays a NaN), enough to
// pass bf16 arrays to a kernel and move them; no bf16 arithmetic.
struct __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f);
    operator float() const { return ::cuda_cpu::bf16_bits_to_float(__x); }
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
inline unsigned short cuda_cpu_bf16_bits(float f) {
    unsigned u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40);  // quiet NaN
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline __nv_bfloat16::__nv_bfloat16(float f) : __x(cuda_cpu_bf16_bits(f)) {}
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return (float)b; }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) { return {lo, hi}; }
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return {v.x, v.y}; }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {(float)v.x, (float)v.y}; }
inline float __low2float(__nv_bfloat162 v) { return (float)v.x; }
inline float __high2float(__nv_bfloat162 v) { return (float)v.y; }

// ------------------------------------------------------------------ mma_helpers.cuh, emulated
// The CPU side of course_utils/library/kernels/mma_helpers.cuh (its GPU side is inline PTX): a kernel
// that includes that header gets these names (a `using` in the header the emulation builds
// with). mma and ldmatrix are warp collectives of all 32 lanes, called from the same line.
namespace cuda_cpu::mma_helpers {

// bits 0-15: lo as bf16, bits 16-31: hi (as cvt.rn.bf16x2.f32 and __floats2bfloat162_rn)
inline unsigned pack_bf16(float lo, float hi) {
    return (unsigned)cuda_cpu_bf16_bits(lo) | (unsigned)cuda_cpu_bf16_bits(hi) << 16;
}
inline float unpack_bf16_lo(unsigned r) { return bf16_bits_to_float(r & 0xffffu); }
inline float unpack_bf16_hi(unsigned r) { return bf16_bits_to_float(r >> 16); }

inline void mma_m16n8k16_bf16(float d[4], const unsigned a[4], const unsigned b[2],
                              const float c[4],
                              std::source_location at = std::source_location::current()) {
    warp_call(MMA, (int)at.line(), 0xffffffffu, 0, 0, 32, a, b, c, d);
}

inline void check_shared_row(const char* what, const void* p, int line) {
    const char* q = (const char*)p;
    bool in_static = __start_cuda_cpu_shared && q >= __start_cuda_cpu_shared &&
                     q + 16 <= __stop_cuda_cpu_shared;
    bool in_dynamic = dynamic_shared_memory && q >= dynamic_shared_memory &&
                      q + 16 <= dynamic_shared_memory + dynamic_shared_bytes;
    char who[160], message[600];
    if (!in_static && !in_dynamic) {
        where(who, sizeof who);
        snprintf(message, sizeof message,
                 "%s gave %s at line %d the address %p, which is not a 16-byte row inside "
                 "shared memory (%s)", who, what, line, p,
                 what[0] == 'l' ? "ldmatrix reads __shared__ tiles only"
                                : "cp.async copies into __shared__ memory");
        fail("out of bounds", message);
    }
    if ((uintptr_t)p % 16) {
        where(who, sizeof who);
        snprintf(message, sizeof message,
                 "%s gave %s at line %d the address %p, which is not a multiple of 16 bytes "
                 "(%s)", who, what, line, p,
                 what[0] == 'l' ? "each lane points at a row of 8 bf16 values that starts on a "
                                  "16-byte boundary"
                                : "cp.async moves 16 aligned bytes");
        fail("misaligned", message);
    }
}

inline void ldmatrix_x4(unsigned r[4], const void* smem_row,
                        std::source_location at = std::source_location::current()) {
    check_shared_row(warp_names[LDMATRIX], smem_row, (int)at.line());
    warp_call(LDMATRIX, (int)at.line(), 0xffffffffu, 0, 0, 32, smem_row, nullptr, nullptr, r);
}
inline void ldmatrix_x4_trans(unsigned r[4], const void* smem_row,
                              std::source_location at = std::source_location::current()) {
    check_shared_row(warp_names[LDMATRIX_TRANS], smem_row, (int)at.line());
    warp_call(LDMATRIX_TRANS, (int)at.line(), 0xffffffffu, 0, 0, 32, smem_row, nullptr, nullptr,
              r);
}


// cp.async.cg.shared.global [dst], [src], 16, src_bytes: 16 bytes, src_bytes of them read from
// src, the rest zero. Deferred: the copy lands in shared memory at the cp_async_wait<N>() that
// covers its group (committed by cp_async_commit()), so a read before the wait sees the NaN the
// slot was filled with, as on a GPU it may see the old value.
inline void cp_async16(void* smem_dst, const void* src, int src_bytes,
                       std::source_location at = std::source_location::current()) {
    check_shared_row("cp_async16", smem_dst, (int)at.line());
    char who[160], message[500];
    if (src_bytes < 0 || src_bytes > 16 || (src_bytes && (uintptr_t)src % 16)) {
        where(who, sizeof who);
        snprintf(message, sizeof message,
                 "%s called cp_async16 at line %d with the source %p and src_bytes %d: the "
                 "source must be 16-byte aligned and src_bytes 0 to 16", who, (int)at.line(),
                 src, src_bytes);
        fail(src_bytes < 0 || src_bytes > 16 ? "arguments" : "misaligned", message);
    }
    Fiber* self = current;
    if (self->copy_count == sizeof self->copies / sizeof self->copies[0]) {
        where(who, sizeof who);
        snprintf(message, sizeof message,
                 "%s has %u cp_async16 copies in flight at line %d: a cp_async_wait is missing",
                 who, self->copy_count, (int)at.line());
        fail("crash", message);
    }
    self->copies[self->copy_count++] = {(char*)smem_dst, (const char*)src, src_bytes, 0};
}

inline void cp_async_commit() {
    Fiber* self = current;
    ++self->groups;
    for (unsigned i = 0; i < self->copy_count; ++i)
        if (self->copies[i].group == 0) self->copies[i].group = self->groups;
}

// cp.async.wait_group N: every committed group but the N most recent has landed
template <int N>
inline void cp_async_wait() {
    static_assert(N >= 0, "cp_async_wait<N>: N >= 0");
    Fiber* self = current;
    unsigned kept = 0;
    for (unsigned i = 0; i < self->copy_count; ++i) {
        Fiber::Copy& c = self->copies[i];
        if (c.group != 0 && c.group + (unsigned)N <= self->groups) {
            if (c.bytes) memcpy(c.dst, c.src, (size_t)c.bytes);
            memset(c.dst + c.bytes, 0, (size_t)(16 - c.bytes));
        } else {
            self->copies[kept++] = c;
        }
    }
    self->copy_count = kept;
}

}  // namespace cuda_cpu::mma_helpers

// atomics: the fibers of the emulation never run at the same time, so a plain update is atomic
#define CUDA_CPU_ATOMICS(T)                                                                   \
    inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }                   \
    inline T atomicSub(T* p, T v) { T old = *p; *p = old - v; return old; }                   \
    inline T atomicMax(T* p, T v) { T old = *p; *p = old > v ? old : v; return old; }         \
    inline T atomicMin(T* p, T v) { T old = *p; *p = old < v ? old : v; return old; }         \
    inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
CUDA_CPU_ATOMICS(int)
CUDA_CPU_ATOMICS(unsigned int)
CUDA_CPU_ATOMICS(unsigned long long)
CUDA_CPU_ATOMICS(float)
CUDA_CPU_ATOMICS(double)
inline int atomicCAS(int* p, int compare, int v) { int old = *p; if (old == compare) *p = v; return old; }
inline unsigned int atomicCAS(unsigned int* p, unsigned int compare, unsigned int v) {
    unsigned int old = *p;
    if (old == compare) *p = v;
    return old;
}

// ------------------------------------------------------------------ the launcher's main
// The launch file (little-endian), written by course_utils.toolbox.cuda_cpu:
//   "CUDACPU1", u32 grid[3], u32 block[3], u32 dynamic shared bytes, u32 timeout (s), u32 order
//   (0: thread 0 first, 1: the last thread first), u32 nargs,
//   then per argument a u32 kind: 0 a buffer (u32 element bytes, u64 count, u32 name length,
//   the name, the data), 1 an integer (i64), 2 a float (f64).
// The output file: every buffer's data, in order. Errors: "CUDA_CPU_ERROR kind: ..." on stderr.
namespace cuda_cpu {

inline char* arg_pointer[64];
inline long long arg_integer[64];
inline double arg_float[64];

inline void read_exact(FILE* f, void* out, size_t bytes) {
    if (bytes && fread(out, 1, bytes, f) != bytes) fail("setup", "the launch file is truncated");
}

template <class T>
inline T read_value(FILE* f) {
    T v;
    read_exact(f, &v, sizeof v);
    return v;
}

inline int main(int argc, char** argv, void (*call)()) {
    if (argc != 3) fail("setup", "usage: launcher <launch file> <output file>");
    page = (size_t)sysconf(_SC_PAGESIZE);
    FILE* in = fopen(argv[1], "rb");
    if (!in) fail("setup", "cannot open the launch file");
    char magic[8];
    read_exact(in, magic, 8);
    if (memcmp(magic, "CUDACPU1", 8) != 0) fail("setup", "not a launch file");
    unsigned g[3], b[3];
    for (unsigned& v : g) v = read_value<unsigned>(in);
    for (unsigned& v : b) v = read_value<unsigned>(in);
    unsigned dynamic_bytes = read_value<unsigned>(in);
    timeout_s = read_value<unsigned>(in);
    reverse_order = read_value<unsigned>(in) != 0;
    unsigned nargs = read_value<unsigned>(in);
    if (nargs > 64) fail("setup", "more than 64 arguments");
    static char names[64][64];
    for (unsigned i = 0; i < nargs; ++i) {
        unsigned kind = read_value<unsigned>(in);
        if (kind == 0) {
            unsigned element_bytes = read_value<unsigned>(in);
            unsigned long long count = read_value<unsigned long long>(in);
            unsigned length = read_value<unsigned>(in);
            if (length >= sizeof names[i]) fail("setup", "a buffer name is too long");
            read_exact(in, names[i], length);
            names[i][length] = 0;
            arg_pointer[i] = add_buffer(names[i], count, element_bytes);
            read_exact(in, arg_pointer[i], count * element_bytes);
        } else if (kind == 1) {
            arg_integer[i] = read_value<long long>(in);
        } else {
            arg_float[i] = read_value<double>(in);
        }
    }
    fclose(in);
    install_handlers();
    alarm(timeout_s);
    launch(dim3(g[0], g[1], g[2]), dim3(b[0], b[1], b[2]), dynamic_bytes, call);
    alarm(0);
    fflush(stdout);
    FILE* out = fopen(argv[2], "wb");
    if (!out) fail("setup", "cannot write the output file");
    for (int i = 0; i < buffer_count; ++i)
        if (fwrite(buffers[i].data, buffers[i].element_bytes, buffers[i].count, out) !=
            buffers[i].count)
            fail("setup", "cannot write the output file");
    fclose(out);
    // what the build and the run show: static shared memory, the barriers reached
    FILE* stats = fopen("stats.txt", "w");
    if (stats) {
        size_t shared = __start_cuda_cpu_shared && __stop_cuda_cpu_shared
                            ? (size_t)(__stop_cuda_cpu_shared - __start_cuda_cpu_shared) : 0;
        fprintf(stats, "shared_bytes %zu\nbarriers %d\n", shared, barrier_line_count);
        fclose(stats);
    }
    return 0;
}

}  // namespace cuda_cpu
