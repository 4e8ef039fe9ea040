// cuda_cpu.h: the CUDA thread model on the CPU, for checking a kernel's *results* without a GPU.
//
// course_utils.cuda_cpu compiles a student's CUDA C++ source with the host g++ after this
// header, together with a small generated launcher, and runs the executable as a subprocess.
//
// What it emulates
//   * blocks run one after another; the threads of a block are fibers (ucontext), run in a fixed
//     order: thread 0 runs until its next __syncthreads() (or its end), then thread 1, ... A
//     barrier switches to the next fiber; when every thread of the block waits at it, all go on.
//     The launch can ask for the reverse order (the last thread first): a kernel without races
//     gives the same bits in both orders, one with a missing barrier does not.
//   * threadIdx, blockIdx, blockDim, gridDim are per fiber; __shared__ variables live in one
//     section, filled with 0xFF bytes (NaN as float, -1 as int) before each block, so a read of
//     a slot no thread stored this block shows.
//   * checks: a barrier reached by only part of the block (some threads returned, or waited at
//     another __syncthreads), an access past the end of a buffer (each buffer ends at a page that
//     cannot be touched: the faulting thread is named), a store before its start (a guard band
//     filled with 0xFF, checked after the run), a thread's stack overflow, a kernel that does
//     not finish (alarm).
// What it cannot show: speed; races between threads that the fixed order hides (two threads
// that need a barrier between them only at another interleaving); warp-level behaviour (shuffles,
// votes, __syncwarp, lockstep execution); the GPU's floating-point contractions (FMA).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <signal.h>
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
#define __syncwarp(...) ((void)0)
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

enum State { READY, AT_BARRIER, DONE };

struct Fiber {
    ucontext_t context;
    char* stack;  // its lowest page is a guard (PROT_NONE)
    uint3 index;
    State state;
    int barrier_line;
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

inline void barrier(int line) {
    bool known = false;
    for (int i = 0; i < barrier_line_count; ++i) known = known || barrier_lines[i] == line;
    if (!known && barrier_line_count < 64) barrier_lines[barrier_line_count++] = line;
    current->state = AT_BARRIER;
    current->barrier_line = line;
    swapcontext(&current->context, &scheduler);
}

inline void trampoline() {
    body();
    current->state = DONE;  // uc_link returns to the scheduler
}

extern "C" char __start_cuda_cpu_shared[] __attribute__((weak));
extern "C" char __stop_cuda_cpu_shared[] __attribute__((weak));

inline void poison_shared(size_t dynamic_bytes) {
    if (__start_cuda_cpu_shared && __stop_cuda_cpu_shared)
        memset(__start_cuda_cpu_shared, 0xFF, __stop_cuda_cpu_shared - __start_cuda_cpu_shared);
    if (dynamic_shared_memory) memset(dynamic_shared_memory, 0xFF, dynamic_bytes);
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
                makecontext(&f.context, trampoline, 0);
            }
    for (;;) {
        for (unsigned k = 0; k < fiber_count; ++k) {
            unsigned i = reverse_order ? fiber_count - 1 - k : k;
            if (fibers[i].state != READY) continue;
            current = &fibers[i];
            swapcontext(&scheduler, &current->context);
        }
        current = nullptr;
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
    if (dynamic_bytes) dynamic_shared_memory = map_or_fail(dynamic_bytes);
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
// The launch file (little-endian), written by course_utils.cuda_cpu:
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
