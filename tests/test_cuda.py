"""Tests of course_utils.toolbox.cuda: prototypes read off CUDA source, compile errors shown at the
student's line, ptxas reports, NVRTC kernels and their argument checks.

Most tests run on a CPU machine: nvcc and NVRTC compile without a GPU (tests that need one of
them skip, saying which, when it is missing). The tests marked ``gpu`` build and launch for
real and run only where torch sees a CUDA device. Compiled results go to a fresh cache
directory per test module, so every compile here really happens once and is then reused.
"""

from __future__ import annotations

import os
import re
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from course_utils import cuda as C
from course_utils import paths, runtime
from course_utils.toolbox import cuda_tools  # every cuda room asks it for nvcc and NVRTC

HAS_NVCC = C.nvcc_path() is not None
HAS_NVRTC = C.nvrtc_available()
HAS_GPU = runtime.on_gpu()  # False with COURSE_DEVICE=cpu, even on a GPU machine
# NVRTC 13.0 (seen on an H100 machine) returns no ptxas report when it reuses a result from the
# CUDA compute cache, i.e. from the second run on; NVRTC 13.5 without a driver always returns it.
NVRTC_REPORTS_RELIABLY = HAS_NVRTC and C._nvrtc_version() >= C.BUNDLED_HEADERS_MIN_NVRTC

needs_nvcc = pytest.mark.skipif(
    not HAS_NVCC, reason="nvcc not found (install the CUDA toolkit or conda's cuda-nvcc)"
)
needs_nvrtc = pytest.mark.skipif(
    not HAS_NVRTC, reason="NVRTC not available (pip install nvidia-cuda-nvrtc cuda-core)"
)
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs GPU mode (no COURSE_DEVICE=cpu)")

# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------

# A load_cuda source as the course writes them: torch/types.h, a kernel, a host wrapper whose
# signature spans lines and takes const references, and a template elsewhere in the file.
VECTOR_ADD_SRC = r"""#include <torch/types.h>
#include <c10/cuda/CUDAStream.h>

constexpr int THREADS_PER_BLOCK = 256;

template <typename T>
__device__ T twice(T v) { return v + v; }  // a template, not bound: must not confuse the parser

__global__ void add_kernel(const float* __restrict__ x, const float* __restrict__ y,
                           float* __restrict__ out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] + y[i];  // bounds check: the last block may be partly outside
}

torch::Tensor
vector_add(const torch::Tensor& x,
           const torch::Tensor& y) {
  TORCH_CHECK(x.is_cuda() && y.is_cuda(), "vector_add: x and y must be CUDA tensors {(");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && y.scalar_type() == torch::kFloat32,
              "vector_add: float32 only");
  TORCH_CHECK(x.sizes() == y.sizes(), "vector_add: x and y differ in shape");
  auto xc = x.contiguous();
  auto yc = y.contiguous();
  auto out = torch::empty_like(xc);
  int n = static_cast<int>(xc.numel());
  int blocks = (n + THREADS_PER_BLOCK - 1) / THREADS_PER_BLOCK;
  add_kernel<<<blocks, THREADS_PER_BLOCK, 0, c10::cuda::getCurrentCUDAStream()>>>(
      xc.data_ptr<float>(), yc.data_ptr<float>(), out.data_ptr<float>(), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}
"""
BAD_LINE = "  if (i < n) out[idx] = x[i] + y[i];"
BAD_VECTOR_ADD_SRC = VECTOR_ADD_SRC.replace(
    "  if (i < n) out[i] = x[i] + y[i];  // bounds check: the last block may be partly outside",
    BAD_LINE,
)
BAD_LINE_NO = BAD_VECTOR_ADD_SRC.splitlines().index(BAD_LINE) + 1

# Kernels for ptxas reports: no torch headers, so nvcc takes about a second.
KERNELS_SRC = r"""
constexpr int TILE = 32;
constexpr int LOCAL_N = 256;

__global__ void add_kernel(const float* x, const float* y, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] + y[i];
}

// An array indexed at run time cannot live in registers: it goes to the stack (local memory).
__global__ void local_array_kernel(const float* in, float* out, int k) {
  float a[LOCAL_N];
  for (int i = 0; i < LOCAL_N; ++i) a[i] = in[i];
  out[threadIdx.x] = a[k];
}

__global__ void transpose_tile(const float* in, float* out, int n) {
  __shared__ float tile[TILE][TILE + 1];
  int x = blockIdx.x * TILE + threadIdx.x, y = blockIdx.y * TILE + threadIdx.y;
  if (x < n && y < n) tile[threadIdx.y][threadIdx.x] = in[y * n + x];
  __syncthreads();  // every tile element is written before any thread reads its transpose
  x = blockIdx.y * TILE + threadIdx.x;
  y = blockIdx.x * TILE + threadIdx.y;
  if (x < n && y < n) out[y * n + x] = tile[threadIdx.x][threadIdx.y];
}

template <int N>
__global__ void fill(float* x) { x[threadIdx.x] = N; }
template __global__ void fill<64>(float*);
"""

# 32 accumulators live across a loop: 40 registers and no spill unconstrained (nvcc 13, sm_90);
# capped at 32 registers (__launch_bounds__(1024, 2)) or 24 (-maxrregcount=16) they spill.
SPILL_SRC = r"""
#define N_ACC 32
__global__ void many_live_values(const float* in, float* out, int n) {
  float acc[N_ACC];
#pragma unroll
  for (int i = 0; i < N_ACC; ++i) acc[i] = in[threadIdx.x + i * n];
  for (int k = 0; k < n; ++k) {
#pragma unroll
    for (int i = 0; i < N_ACC; ++i) acc[i] = acc[i] * in[k] + acc[(i + 1) % N_ACC];
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N_ACC; ++i) s += acc[i] * (i + 1);
  out[threadIdx.x] = s;
}
"""

# NVRTC sources (no torch): a plain kernel, a template, and one with dynamic shared memory.
NVRTC_SRC = r"""#include <cuda_fp16.h>

extern "C" __global__ void add_kernel(const float* x, const float* y, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] + y[i];
}

template <typename T>
__global__ void scale(T* x, T a, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] * a;
}

// Reverses each block's slice of x through dynamic shared memory of blockDim.x * REPEAT floats.
__global__ void reverse_blocks(const float* x, float* out, int repeat) {
  extern __shared__ float buf[];
  int base = blockIdx.x * blockDim.x;
  for (int r = 0; r < repeat; ++r) buf[r * blockDim.x + threadIdx.x] = x[base + threadIdx.x];
  __syncthreads();  // the whole slice is in shared memory before anyone reads it reversed
  int last = (repeat - 1) * blockDim.x;
  out[base + threadIdx.x] = buf[last + blockDim.x - 1 - threadIdx.x];
}
"""

EXERCISE_STUB = r"""#include <torch/types.h>
__global__ void add_kernel(const float* x, const float* y, float* out, int n) {
  // YOUR CODE HERE
}
torch::Tensor vector_add(torch::Tensor x, torch::Tensor y) { return x; }
"""


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


_USER_CACHE = os.environ.get("COURSE_CACHE_DIR")  # before fresh_cache replaces it


@pytest.fixture(scope="module", autouse=True)
def fresh_cache(tmp_path_factory):
    """A cache directory of this module's own: compiles happen for real, once."""
    patch = pytest.MonkeyPatch()
    patch.setenv("COURSE_CACHE_DIR", str(tmp_path_factory.mktemp("course_cache")))
    yield
    patch.undo()


@pytest.fixture
def cpu_mode(monkeypatch):
    """Pretend there is no GPU (also on a GPU machine), as in the CPU simulator mode."""
    monkeypatch.setattr(runtime, "on_gpu", lambda: False)


@pytest.fixture(scope="module")
def compile_only_module():
    """VECTOR_ADD_SRC through load_cuda's no-GPU path (nvcc -cubin, ~15 s), built once."""
    if not HAS_NVCC:
        pytest.skip("nvcc not found (install the CUDA toolkit or conda's cuda-nvcc)")
    patch = pytest.MonkeyPatch()
    patch.setattr(runtime, "on_gpu", lambda: False)
    try:
        return C.load_cuda(VECTOR_ADD_SRC, ["vector_add"])
    finally:
        patch.undo()  # only for this call: the GPU tests of this module need the real mode


@pytest.fixture(scope="module")
def kernel_report():
    if not HAS_NVCC:
        pytest.skip("nvcc not found (install the CUDA toolkit or conda's cuda-nvcc)")
    return C.resource_usage(KERNELS_SRC)


def fake_cuda(*shape, dtype=torch.float32):
    """A tensor that claims to live on cuda:0, with no memory: argument checks without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(*shape, device="cuda", dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Prototypes read off the source
# ---------------------------------------------------------------------------------------------


def test_prototype_of_multiline_signature_with_const_refs():
    assert C.cpp_prototypes(VECTOR_ADD_SRC, ["vector_add"]) == [
        "torch::Tensor vector_add(const torch::Tensor& x, const torch::Tensor& y);"
    ]


def test_prototypes_skip_comments_strings_and_namespaces():
    src = r"""
#include <torch/types.h>
#define UNUSED(x) (void)(x)
// torch::Tensor commented(torch::Tensor x) { return x; }
/* torch::Tensor also_commented(torch::Tensor x) { return x; } */
namespace detail { inline int helper(int a) { return a; } }
struct Params { int n; float* x; };
std::vector<torch::Tensor> split_two(torch::Tensor a,
                                     int64_t k) { return {a, a}; }
extern "C" __global__ void k(float* x) { const char* s = "f(int x) {"; UNUSED(s); }
void launch(torch::Tensor a) noexcept { }
"""
    assert C.cpp_prototypes(src, ["split_two", "launch"]) == [
        "std::vector<torch::Tensor> split_two(torch::Tensor a, int64_t k);",
        "void launch(torch::Tensor a);",
    ]


def test_missing_function_lists_the_defined_ones():
    with pytest.raises(ValueError) as e:
        C.cpp_prototypes(VECTOR_ADD_SRC, ["vector_sum"])
    msg = str(e.value)
    assert "function 'vector_sum' is not defined in the CUDA source" in msg
    assert "defined host functions are: vector_add" in msg
    assert "twice" not in msg and "add_kernel" not in msg  # device code is not listed


def test_default_argument_is_refused():
    src = "torch::Tensor scale(torch::Tensor x,\n    double factor = 2.0) { return x; }"
    with pytest.raises(ValueError, match=r"default argument \(`double factor = 2.0`\)"):
        C.cpp_prototypes(src, ["scale"])


def test_kernel_or_template_named_as_host_function_is_refused():
    with pytest.raises(ValueError, match="is a __global__ kernel"):
        C.cpp_prototypes(VECTOR_ADD_SRC, ["add_kernel"])
    with pytest.raises(ValueError, match="__device__ function"):
        C.cpp_prototypes(VECTOR_ADD_SRC, ["twice"])
    src = "template <int N> torch::Tensor f(torch::Tensor x) { return x; }"
    with pytest.raises(ValueError, match="is a template"):
        C.cpp_prototypes(src, ["f"])


# ---------------------------------------------------------------------------------------------
# The exercise placeholder
# ---------------------------------------------------------------------------------------------


def test_placeholder_raises_not_implemented_everywhere(cpu_mode):
    msg = r"fill in the `// YOUR CODE HERE` part of the CUDA source \(line 3\)"
    with pytest.raises(NotImplementedError, match=msg):
        C.load_cuda(EXERCISE_STUB, ["vector_add"])
    with pytest.raises(NotImplementedError, match=msg):
        C.compile_kernel(EXERCISE_STUB, "add_kernel")
    with pytest.raises(NotImplementedError, match=msg):
        C.resource_usage(EXERCISE_STUB)


# ---------------------------------------------------------------------------------------------
# ptxas reports
# ---------------------------------------------------------------------------------------------


@needs_nvcc
def test_small_kernel_does_not_spill(kernel_report):
    add = C.resource_usage(KERNELS_SRC, "add_kernel")
    assert add in kernel_report
    assert add.name == "add_kernel" and add.arch == "sm_90"
    assert 4 <= add.registers <= 64
    assert add.spills == 0 and add.stack_bytes == 0 and add.shared_bytes == 0


@needs_nvcc
def test_runtime_indexed_local_array_needs_a_stack_frame(kernel_report):
    local = C.resource_usage(KERNELS_SRC, "local_array_kernel")
    assert local.stack_bytes >= 256 * 4  # the whole float[256] array


@needs_nvcc
def test_shared_memory_barriers_and_template_names(kernel_report):
    assert [k.name for k in kernel_report] == [
        "add_kernel",
        "local_array_kernel",
        "transpose_tile",
        "fill<64>",
    ]  # source order, demangled
    tile = C.resource_usage(KERNELS_SRC, "transpose_tile")
    assert tile.shared_bytes == 32 * 33 * 4
    assert tile.barriers == 1
    assert C.resource_usage(KERNELS_SRC, "fill").name == "fill<64>"
    assert C.resource_usage(KERNELS_SRC, "fill<64>").mangled.startswith("_Z")
    with pytest.raises(ValueError, match="no kernel named 'nope'"):
        C.resource_usage(KERNELS_SRC, "nope")


@needs_nvcc
def test_maxrregcount_forces_spills():
    free = C.resource_usage(SPILL_SRC, "many_live_values")
    capped = C.resource_usage(SPILL_SRC, "many_live_values", extra_flags=["-maxrregcount=16"])
    assert free.spills == 0
    assert capped.registers < free.registers
    assert capped.spill_store_bytes > 0 and capped.spill_load_bytes > 0 and capped.spills > 0
    assert "spill stores" in str(capped) and str(capped).startswith("many_live_values")


@needs_nvcc
def test_launch_bounds_force_spills():
    # 1024 threads x 2 blocks per SM share 64K registers: at most 32 per thread
    bounds = "__launch_bounds__(1024, 2)"
    bounded = SPILL_SRC.replace("void many_live_values", f"void {bounds} many_live_values")
    usage = C.resource_usage(bounded, "many_live_values")
    assert usage.registers <= 32 and usage.spills > 0


@pytest.mark.skipif(
    not NVRTC_REPORTS_RELIABLY, reason="this NVRTC omits ptxas reports on compute-cache hits"
)
def test_nvrtc_fallback_gives_the_same_report(monkeypatch):
    monkeypatch.setattr(cuda_tools, "nvcc_path", lambda: None)
    capped = C.resource_usage(SPILL_SRC, "many_live_values", extra_flags=["-maxrregcount=16"])
    assert capped.spills > 0
    local = C.resource_usage(KERNELS_SRC, "local_array_kernel")
    assert local.stack_bytes >= 256 * 4


@needs_nvrtc
def test_nvrtc_fallback_without_a_report_says_so(monkeypatch):
    monkeypatch.setattr(cuda_tools, "nvcc_path", lambda: None)
    monkeypatch.setattr(C, "_nvrtc_compile", lambda *a, **k: (None, ""))  # as on a cache hit
    with pytest.raises(RuntimeError, match="no ptxas report.*CUDA_CACHE_DISABLE=1"):
        C.resource_usage(SPILL_SRC)


def test_no_compiler_at_all_says_what_to_install(monkeypatch):
    monkeypatch.setattr(cuda_tools, "nvcc_path", lambda: None)
    monkeypatch.setattr(cuda_tools, "nvrtc_available", lambda: False)
    with pytest.raises(RuntimeError, match="cuda-nvcc.*nvidia-cuda-nvrtc"):
        C.resource_usage(SPILL_SRC)


def test_parse_ptxas_log_with_constant_memory_and_table():
    log = """ptxas info    : 16 bytes gmem, 256 bytes cmem[3]
ptxas info    : Compiling entry function '_Z2ckPfi' for 'sm_80'
ptxas info    : Function properties for _Z2ckPfi
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 10 registers, used 2 barriers, 2048 bytes smem, 364 bytes cmem[0]
"""
    (k,) = C.parse_ptxas_log(log)
    assert (k.name, k.arch, k.registers, k.barriers) == ("ck", "sm_80", 10, 2)
    assert (k.shared_bytes, k.constant_bytes, k.stack_bytes) == (2048, 364, 8)
    assert (k.spill_store_bytes, k.spill_load_bytes, k.spills) == (4, 12, 16)
    table = C.format_resources([k]).splitlines()
    assert table[0].split() == [
        "kernel",
        "regs",
        "smem",
        "B",
        "cmem",
        "B",
        "stack",
        "B",
        "spill",
        "st",
        "B",
        "spill",
        "ld",
        "B",
        "barriers",
    ]
    assert table[2].split() == ["ck", "10", "2048", "364", "8", "4", "12", "2"]


# ---------------------------------------------------------------------------------------------
# load_cuda without a GPU: nvcc compile-only
# ---------------------------------------------------------------------------------------------


@needs_nvcc
def test_load_cuda_compiles_without_gpu(compile_only_module, cpu_mode, capsys):
    m = compile_only_module
    assert m.compiled and m.functions == ["vector_add"]
    (add,) = m.resource_usage
    assert add.name == "add_kernel" and add.registers > 0 and add.spills == 0
    assert "compile-only" in repr(m) and "\n" not in repr(m)
    with pytest.raises(RuntimeError, match="vector_add was compiled with nvcc .* needs a GPU"):
        m.vector_add(torch.ones(3), torch.ones(3))
    again = C.load_cuda(VECTOR_ADD_SRC, ["vector_add"])  # from the disk cache: instant
    out = capsys.readouterr().out
    assert "compiled with nvcc for sm_90 (compile-only, no GPU): add_kernel:" in out
    assert "0 bytes spilled" in out
    assert again.resource_usage == m.resource_usage


@needs_nvcc
def test_load_cuda_compile_error_points_at_the_line(cpu_mode):
    with pytest.raises(C.CudaCompileError) as e:
        C.load_cuda(BAD_VECTOR_ADD_SRC, ["vector_add"])
    msg = str(e.value)
    assert 'identifier "idx" is undefined' in msg
    assert f"line {BAD_LINE_NO} of your source" in msg
    assert f"> {BAD_LINE_NO} | {BAD_LINE}" in msg  # the offending line, marked and numbered
    assert f"{BAD_LINE_NO - 2} | " in msg and f"{BAD_LINE_NO + 2} | " in msg  # context
    assert "end of the compiler log" in msg
    assert e.value.errors == [(BAD_LINE_NO, 'identifier "idx" is undefined')]


def test_load_cuda_without_nvcc_or_gpu_prints_one_line(cpu_mode, monkeypatch, capsys):
    monkeypatch.setattr(cuda_tools, "nvcc_path", lambda: None)
    m = C.load_cuda(VECTOR_ADD_SRC, ["vector_add"])
    out = capsys.readouterr().out.strip()
    assert "\n" not in out and "no GPU and no nvcc" in out and "cuda-nvcc" in out
    assert not m.compiled and m.resource_usage is None
    with pytest.raises(RuntimeError, match="needs a GPU"):
        m.vector_add(torch.ones(3), torch.ones(3))


def test_load_cuda_reads_a_cu_file(cpu_mode, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cuda_tools, "nvcc_path", lambda: None)  # only the reading is tested here
    path = tmp_path / "vector_add.cu"
    path.write_text(VECTOR_ADD_SRC)
    assert C.load_cuda(path, ["vector_add"]).functions == ["vector_add"]
    assert C.load_cuda(str(path), ["vector_add"]).functions == ["vector_add"]
    with pytest.raises(FileNotFoundError, match="missing.cu"):
        C.load_cuda(str(tmp_path / "missing.cu"), ["vector_add"])


def test_torch_build_log_is_mapped_back_through_the_prepended_includes(tmp_path):
    """load_inline writes 3 #include lines before the source in its cuda.cu: line 12 there is
    line 9 of the student's source; a g++ error in main.cpp is reported as the bindings'."""
    written = tmp_path / "cuda.cu"
    prefix = "#include <torch/types.h>\n#include <cuda.h>\n#include <cuda_runtime.h>\n"
    written.write_text(prefix + BAD_VECTOR_ADD_SRC)
    log = (
        "Error building extension 'vector_add_abc': [1/3] nvcc ... -c cuda.cu\nFAILED: cuda.o\n"
        f'{written}({BAD_LINE_NO + 3}): error: identifier "idx" is undefined\n'
        f"{tmp_path}/main.cpp:2:15: error: 'Tensr' in namespace 'torch' does not name a type\n"
    )
    err = C._compile_error(log, BAD_VECTOR_ADD_SRC, tool="torch", display_name="<source>")
    assert err.errors[0] == (BAD_LINE_NO, 'identifier "idx" is undefined')
    assert f"> {BAD_LINE_NO} | {BAD_LINE}" in str(err)
    assert "generated bindings (main.cpp line 2)" in str(err)


# ---------------------------------------------------------------------------------------------
# compile_kernel (NVRTC) and kernel arguments
# ---------------------------------------------------------------------------------------------


@needs_nvrtc
def test_compile_kernel_without_gpu(cpu_mode):
    k = C.compile_kernel(NVRTC_SRC, "add_kernel")
    assert k.cubin[:4] == b"\x7fELF" and k.arch == "sm_90"
    if NVRTC_REPORTS_RELIABLY or k.resource_usage is not None:
        assert "ptxas info" in k.log
        assert k.resource_usage.name == "add_kernel"
        assert k.resource_usage.registers > 0 and k.resource_usage.spills == 0
    assert C.compile_kernel(NVRTC_SRC, "add_kernel") is k  # cached in this process
    with pytest.raises(RuntimeError, match="needs a GPU to launch"):
        k(1, 32, fake_cuda(8), fake_cuda(8), fake_cuda(8), 8)


@needs_nvrtc
def test_compile_kernel_error_points_at_the_line():
    bad = NVRTC_SRC.replace("x[i] + y[i]", "x[i] + y[j]")
    line_no = next(i for i, s in enumerate(bad.splitlines(), 1) if "y[j]" in s)
    with pytest.raises(C.CudaCompileError) as e:
        C.compile_kernel(bad, "add_kernel")
    msg = str(e.value)
    assert 'identifier "j" is undefined' in msg
    assert f"line {line_no} of your source" in msg
    assert f"> {line_no} |   if (i < n) out[i] = x[i] + y[j];" in msg
    assert e.value.errors[0][0] == line_no


@needs_nvrtc
def test_template_kernel_needs_an_instantiation(cpu_mode):
    with pytest.raises(ValueError, match=r"template kernel.*scale<float>"):
        C.compile_kernel(NVRTC_SRC, "scale")
    k = C.compile_kernel(NVRTC_SRC, "scale", name_expressions=["scale<__half>"])
    assert k.expression == "scale<__half>" and k.lowered_name.startswith("_Z5scale")
    assert [p.base for p in k.params] == ["__half", "__half", "long long"]


def test_kernel_params_parsing():
    params = C.kernel_params(
        "template <int BLOCK, typename T>\n"
        "__global__ void __launch_bounds__(256) k(const T* __restrict__ q, float *out,\n"
        "    unsigned n, const int64_t stride, T scale, bool causal, int table[]) {}",
        "k<64, __nv_bfloat16>",
    )
    assert [(p.name, p.ctype, p.base, p.pointer) for p in params] == [
        ("q", "const T* __restrict__", "__nv_bfloat16", True),
        ("out", "float*", "float", True),
        ("n", "unsigned", "unsigned int", False),
        ("stride", "const int64_t", "int64_t", False),
        ("scale", "T", "__nv_bfloat16", False),
        ("causal", "bool", "bool", False),
        ("table", "int*", "int", True),
    ]
    open_t = C.kernel_params("template <typename T> __global__ void k(T* x) {}", "k")
    assert open_t[0].template  # no instantiation given: no dtype check possible
    with pytest.raises(ValueError, match="no __global__ kernel named 'nope'"):
        C.kernel_params("__global__ void k(float* x) {}", "nope")


def test_argument_conversion_and_checks():
    import numpy as np

    params = C.kernel_params(NVRTC_SRC, "add_kernel")
    x, h = fake_cuda(8), fake_cuda(8, dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FakeTensor.data_ptr() warns; it is 0, fine here
        args = C.convert_kernel_args(params, [x, x, x, 8], kernel="add_kernel")
        assert args[:3] == [0, 0, 0]
        assert type(args[3]) is np.int32 and args[3] == 8
        scale = C.kernel_params(NVRTC_SRC, "scale<float>")
        converted = C.convert_kernel_args(scale, [x, 2, 10])
        assert type(converted[1]) is np.float32 and type(converted[2]) is np.int64

    with pytest.raises(TypeError, match=r"takes 4 argument\(s\) but got 3.*const float\* x"):
        C.convert_kernel_args(params, [x, x, x], kernel="add_kernel")
    with pytest.raises(TypeError, match=r"'out' .*`float\*`.*torch.float32.*torch.float16"):
        C.convert_kernel_args(params, [x, x, h, 8], kernel="add_kernel")
    with pytest.raises(ValueError, match=r"'x' .*tensor on cpu.*move it to CUDA"):
        C.convert_kernel_args(params, [torch.zeros(8), x, x, 8], kernel="add_kernel")
    with pytest.raises(ValueError, match="not contiguous|non-contiguous"):
        C.convert_kernel_args(params, [x, x, fake_cuda(4, 2).t(), 8])
    with pytest.raises(TypeError, match="'n' .*integer, but got the float"):
        C.convert_kernel_args(params, [x, x, x, 8.5])
    with pytest.raises(ValueError, match="does not fit in int"):
        C.convert_kernel_args(params, [x, x, x, 2**40])
    with pytest.raises(TypeError, match="scalar, but got a tensor"):
        C.convert_kernel_args(params, [x, x, x, torch.tensor(8)])


# ---------------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------------


@needs_gpu
def test_load_cuda_vector_add_on_gpu():
    m = C.load_cuda(VECTOR_ADD_SRC, ["vector_add"], name="test_vector_add")
    x = torch.randn(1000, device="cuda")
    y = torch.randn(1000, device="cuda")
    torch.testing.assert_close(m.vector_add(x, y), x + y)
    assert C.load_cuda(VECTOR_ADD_SRC, ["vector_add"], name="test_vector_add") is m


@needs_gpu
def test_load_cuda_compile_error_on_gpu():
    with pytest.raises(C.CudaCompileError) as e:
        C.load_cuda(BAD_VECTOR_ADD_SRC, ["vector_add"], name="test_bad_vector_add")
    assert f"> {BAD_LINE_NO} | {BAD_LINE}" in str(e.value)
    assert e.value.errors[0] == (BAD_LINE_NO, 'identifier "idx" is undefined')


@needs_gpu
@needs_nvrtc
def test_compile_kernel_launch_matches_torch():
    k = C.compile_kernel(NVRTC_SRC, "add_kernel")
    major, minor = torch.cuda.get_device_capability()
    assert k.arch == f"sm_{major}{minor}"
    n = 1000
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    out = torch.empty_like(x)
    k((n + 255) // 256, 256, x, y, out, n)
    torch.testing.assert_close(out, x + y)

    s = C.compile_kernel(NVRTC_SRC, "scale<float>")
    z = x.clone()
    s((n + 127) // 128, 128, z, 3.0, n)
    torch.testing.assert_close(z, 3 * x)


@needs_gpu
@needs_nvrtc
def test_compile_kernel_runs_on_the_current_torch_stream():
    from cuda.core import Device

    k = C.compile_kernel(NVRTC_SRC, "add_kernel")
    n = 1 << 20
    x = torch.zeros(n, device="cuda")
    y = torch.randn(n, device="cuda")
    out = torch.empty_like(x)
    # A non-blocking stream (cuda.core's default), so that no implicit synchronisation with the
    # legacy default stream can make a launch on the wrong stream look right.
    device = Device(torch.cuda.current_device())
    device.set_current()
    raw = device.create_stream()
    side = torch.cuda.ExternalStream(int(raw.handle))
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        # Keep `side` busy, then set x. A kernel launched on any other stream would run before
        # the fill and see x == 0 (checked on an H100: on the default stream, out == y); on
        # `side` it waits and sees x == 2.
        torch.cuda._sleep(200_000_000)
        x.fill_(2.0)
        k((n + 255) // 256, 256, x, y, out, n)
    side.synchronize()
    torch.testing.assert_close(out, y + 2.0)
    torch.cuda.synchronize()
    raw.close()


@needs_gpu
@needs_nvrtc
def test_compile_kernel_dynamic_shared_memory_over_48k():
    k = C.compile_kernel(NVRTC_SRC, "reverse_blocks")
    threads, repeat = 256, 64  # 256 * 64 * 4 B = 64 KiB of dynamic shared memory
    x = torch.arange(4 * threads, device="cuda", dtype=torch.float32)
    out = torch.empty_like(x)
    k(4, threads, x, out, repeat, shared_mem=threads * repeat * 4)
    torch.testing.assert_close(out, x.view(4, threads).flip(1).reshape(-1))


# ---------------------------------------------------------------------------------------------
# The course's FlashAttention .cu kernels (chapters 07, 08): grid limits and float4 alignment
# ---------------------------------------------------------------------------------------------

KERNELS_DIR = paths.KERNELS  # the chapters' .cu files (course_utils/library/kernels)


@pytest.fixture(scope="module")
def flash_modules():
    fwd = C.load_cuda(KERNELS_DIR / "flash_attention_forward.cu", ["flash_attention_forward"])
    bwd = C.load_cuda(KERNELS_DIR / "flash_attention_backward.cu", ["flash_attention_backward"])
    return fwd, bwd


def _flash_check(fwd, bwd, Q, K, V, dO, causal, case):
    from course_utils import checks
    from course_utils.grading.harness.ch09 import reference_gradients

    scale = Q.shape[-1] ** -0.5
    O, LSE = fwd.flash_attention_forward(Q, K, V, causal, scale)
    torch.cuda.synchronize()
    ref = reference_gradients(Q, K, V, dO, causal, scale)
    checks.compare("O", O, ref[0], case=case, atol=1e-4, rtol=1e-4)
    checks.compare("LSE", LSE, ref[1], case=case, atol=1e-4, rtol=1e-4)
    for det in (True, False):
        grads = bwd.flash_attention_backward(Q, K, V, O, LSE, dO, causal, scale, det)
        torch.cuda.synchronize()
        for name, got, want in zip(("dQ", "dK", "dV"), grads, ref[2:5], strict=True):
            checks.compare(name, got, want, case=f"{case}, deterministic={det}",
                           atol=1e-3, rtol=1e-3)


@pytest.mark.slow
@needs_nvcc
def test_flash_cu_host_checks_compile_without_gpu(cpu_mode, capsys, monkeypatch):
    # The (T, H, B) grids, the grid-limit and alignment checks (TORCH_CHECK_VALUE) compile with
    # torch's headers: nvcc parses the host functions too. No spill in any kernel. The build
    # cache is the one lectures 07 and 08 use (they compile these very files in CPU mode): each
    # file is compiled once per suite (about 25 s each), by whichever comes first.
    if _USER_CACHE is None:
        monkeypatch.delenv("COURSE_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("COURSE_CACHE_DIR", _USER_CACHE)
    kernels = []
    for stem in ("forward", "backward"):
        path = KERNELS_DIR / f"flash_attention_{stem}.cu"
        source = path.read_text()
        assert "blockIdx.z * gridDim.y + blockIdx.y" in source
        assert "is not 16-byte aligned" in source and "at most 65535" in source
        module = C.load_cuda(path, [f"flash_attention_{stem}"])
        assert "compile-only" in repr(module)
        kernels += module.resource_usage
    report = capsys.readouterr().out
    assert "registers" in report and "none spilling" in report, report  # many kernels: a summary
    assert len(kernels) == 4 + 13 and all(k.spill_store_bytes == 0 for k in kernels), kernels


@needs_gpu
@needs_nvcc
def test_gpu_flash_cu_b_times_h_70000(flash_modules):
    # B * H = 70000 > 65535: a (Tr, B * H) grid fails to launch ("invalid argument"); a
    # (Tr, H, B) grid needs only B, H <= 65535 each.
    fwd, bwd = flash_modules
    for B, H in ((700, 100), (35000, 2)):
        Q, K, V, dO = (torch.randn(B, H, 8, 16, device="cuda") for _ in range(4))
        for causal in (False, True):
            _flash_check(fwd, bwd, Q, K, V, dO, causal, f"B={B}, H={H}, N=8, d=16, {causal=}")


@needs_gpu
@needs_nvcc
def test_gpu_flash_cu_small_multi_batch_head_still_matches(flash_modules):
    fwd, bwd = flash_modules
    Q = torch.randn(3, 2, 77, 32, device="cuda")
    K, V = (torch.randn(3, 2, 100, 32, device="cuda") for _ in range(2))
    _flash_check(fwd, bwd, Q, K, V, torch.randn_like(Q), True, "B=3, H=2, Nq=77, Nk=100")


@needs_gpu
@needs_nvcc
def test_gpu_flash_cu_grid_limit_is_named(flash_modules):
    fwd, bwd = flash_modules
    Q = torch.zeros(65536, 1, 1, 16, device="cuda")
    with pytest.raises(ValueError, match=r"B=65536, H=1: .*at most 65535"):
        fwd.flash_attention_forward(Q, Q, Q, False, 0.25)
    lse = torch.zeros(65536, 1, 1, device="cuda")
    with pytest.raises(ValueError, match=r"B=65536, H=1: .*at most 65535"):
        bwd.flash_attention_backward(Q, Q, Q, Q, lse, Q, False, 0.25, True)


@needs_gpu
@needs_nvcc
def test_gpu_flash_cu_misaligned_view_is_a_clear_value_error(flash_modules):
    # A contiguous view one float into its storage: data_ptr % 16 == 4. Launched, its float4
    # loads would raise a sticky "misaligned address" that ends the CUDA context.
    fwd, bwd = flash_modules
    shape = (1, 2, 64, 32)
    n = 2 * 64 * 32
    base = torch.randn(n + 4, device="cuda")
    bad = base[1:n + 1].view(shape)
    assert bad.is_contiguous() and bad.data_ptr() % 16 == 4
    good = torch.randn(shape, device="cuda")
    for args, name in (((bad, good, good), "Q"), ((good, bad, good), "K"),
                       ((good, good, bad), "V")):
        with pytest.raises(ValueError, match=rf"{name}\.data_ptr\(\) is not 16-byte aligned .*"
                                             rf"call {name}\.clone\(\)"):
            fwd.flash_attention_forward(*args, False, 0.25)
    O, LSE = fwd.flash_attention_forward(good, good, good, False, 0.25)
    with pytest.raises(ValueError, match=r"dO\.data_ptr\(\) is not 16-byte aligned"):
        bwd.flash_attention_backward(good, good, good, O, LSE, bad, False, 0.25, True)
    with pytest.raises(ValueError, match=r"Q\.data_ptr\(\) is not 16-byte aligned"):
        bwd.flash_attention_backward(bad, good, good, O, LSE, good, False, 0.25, True)
    # The CUDA context is still usable, and the clone works.
    O2, _ = fwd.flash_attention_forward(bad.clone(), good, good, False, 0.25)
    torch.cuda.synchronize()
    assert torch.isfinite(O2).all()


@needs_gpu
@needs_nvcc
def test_gpu_flash_cu_errors_with_numbers_raise_not_crash(flash_modules):
    # A TORCH_CHECK message that streams a raw number segfaulted on the H100 machine (torch
    # 2.11.0+cu130, g++ 13); the kernels' messages format numbers with std::to_string.
    fwd, bwd = flash_modules
    Q = torch.zeros(1, 1, 4, 48, device="cuda")
    with pytest.raises(RuntimeError, match="d must be 16, 32, 64 or 128, got 48"):
        fwd.flash_attention_forward(Q, Q, Q, False, 0.25)
    lse = torch.zeros(1, 1, 4, device="cuda")
    with pytest.raises(RuntimeError, match="got 48"):
        bwd.flash_attention_backward(Q, Q, Q, Q, lse, Q, False, 0.25, True)


# ------------------------------------------------------------------ headers beside a .cu


def _write_sources(tmp_path, main_body):
    (tmp_path / "twice.cuh").write_text("__device__ int twice(int x) { return 2 * x; }\n")
    main = tmp_path / "main.cu"
    main.write_text('#include "twice.cuh"\n#include "twice.cuh"  // again\n' + main_body)
    return main


def test_a_header_beside_the_source_is_inlined_once_with_its_line_numbers(tmp_path):
    kernel = "__global__ void k(int* y) { y[0] = twice(1); }"
    main = _write_sources(tmp_path, f"#include <cuda_bf16.h>\n{kernel}\n")
    text, name = C._read_source(main)
    assert name == "main.cu"
    assert text.count("__device__ int twice") == 1  # the second include adds nothing
    assert "#include <cuda_bf16.h>" in text  # not a file beside it: left to the compiler
    assert C._file_lines(text, "main.cu")[3] == kernel
    assert C._file_lines(text, "twice.cuh") == ["__device__ int twice(int x) { return 2 * x; }"]
    # the header's text is part of what the build cache hashes: a changed header is rebuilt
    (tmp_path / "twice.cuh").write_text("__device__ int twice(int x) { return x + x; }\n")
    assert C._read_source(main)[0] != text


@pytest.mark.skipif(C.nvcc_path() is None, reason="nvcc not found")
def test_an_error_after_an_inlined_header_points_at_the_right_line(tmp_path):
    main = _write_sources(tmp_path, "__global__ void k(int* y) {\n    y[0] = twice(oops);\n}\n")
    with pytest.raises(C.CudaCompileError) as info:
        C.resource_usage(main)
    message = str(info.value)
    assert "main.cu, line 4" in message
    assert "> 4 |     y[0] = twice(oops);" in message


def test_a_killed_builds_lock_is_removed_and_a_fresh_one_is_left(tmp_path, capsys):
    """torch waits forever on the lock of a build that was killed; load_cuda removes a lock older
    than any build takes (and says so), and leaves a fresh one (another build may hold it)."""
    import os
    import time

    assert not C._clear_stale_build_lock(tmp_path)  # no lock
    lock = tmp_path / "lock"
    lock.touch()
    assert not C._clear_stale_build_lock(tmp_path) and lock.exists()
    assert "waiting for another build" in capsys.readouterr().out
    old = time.time() - C.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert C._clear_stale_build_lock(tmp_path) and not lock.exists()
    assert "a build that was killed" in capsys.readouterr().out
    # a module already built: torch holds its lock for a version check only, so a lock a few
    # minutes old was left by a process killed during that check (ranks timed out while loading)
    lock.touch()
    mid = time.time() - C.STALE_LOCK_BUILT_S - 30
    os.utime(lock, (mid, mid))
    assert not C._clear_stale_build_lock(tmp_path) and lock.exists()  # unbuilt: may be building
    assert C._clear_stale_build_lock(tmp_path, C.STALE_LOCK_BUILT_S) and not lock.exists()


# ---------------------------------------------------------------------------------------------
# A build that is not cached says so first, with the time it should take
# ---------------------------------------------------------------------------------------------

FAKE_PTXAS = (
    "ptxas info    : Compiling entry function '_Z10add_kernelPKfS0_Pfi' for 'sm_90'\n"
    "ptxas info    : Used 8 registers, 380 bytes cmem[0]\n"
)


def _fake_nvcc(monkeypatch, tmp_path):
    """nvcc replaced by a stand-in that writes an empty cubin at once; returns its call log."""
    calls = []
    real_run = subprocess.run

    def run(cmd, *args, **kwargs):
        if cmd[0] != "fake-nvcc":
            return real_run(cmd, *args, **kwargs)
        if "--version" in cmd:
            return subprocess.CompletedProcess(cmd, 0, "Cuda compilation tools, fake\n", "")
        calls.append(cmd)
        out = Path(kwargs["cwd"]) / cmd[cmd.index("-o") + 1]
        out.write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", FAKE_PTXAS)

    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cuda_tools, "nvcc_path", lambda: "fake-nvcc")
    monkeypatch.setattr(subprocess, "run", run)
    return calls


def test_a_first_compile_is_announced_and_a_cached_one_is_silent(cpu_mode, monkeypatch,
                                                                  tmp_path, capsys):
    calls = _fake_nvcc(monkeypatch, tmp_path)
    C.load_cuda(VECTOR_ADD_SRC, ["vector_add"], name="vector_add")
    lines = capsys.readouterr().out.splitlines()
    assert len(calls) == 1
    assert re.fullmatch(r"compiling vector_add \(first build, about \d+ s\)", lines[0]), lines
    assert lines[1].startswith("compiled with nvcc for sm_90")
    C.load_cuda(VECTOR_ADD_SRC, ["vector_add"], name="vector_add")  # cached: no word of it
    out = capsys.readouterr().out
    assert len(calls) == 1 and "compiling" not in out and "compiled with nvcc" in out
    # the next first build of that name expects the time the last one took
    (tmp_path / C.BUILD_TIMES_FILE).write_text('{"cubin:vector_add": 42.0}')
    C.load_cuda(VECTOR_ADD_SRC + "\n// changed\n", ["vector_add"], name="vector_add")
    assert "compiling vector_add (first build, about 42 s)" in capsys.readouterr().out


def test_a_first_extension_build_is_announced_on_a_gpu(monkeypatch, tmp_path, capsys):
    import torch.utils.cpp_extension as ext

    built = []

    def load_inline(name, **kwargs):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / f"{name}.so").write_bytes(b"")
        built.append(name)
        return f"module {name}"

    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(runtime, "on_gpu", lambda: True)
    monkeypatch.setattr(ext, "load_inline", load_inline)
    monkeypatch.setattr(ext, "_get_build_directory", lambda name, verbose: str(tmp_path / name))
    src = VECTOR_ADD_SRC + "\n// announce test\n"
    module = C.load_cuda(src, ["vector_add"], name="announce_test")
    assert module == f"module {built[0]}"
    assert re.match(r"compiling announce_test \(first build, about \d+ s\)",
                    capsys.readouterr().out)
    assert '"extension:announce_test"' in (tmp_path / "cache" / C.BUILD_TIMES_FILE).read_text()
    C._built_modules.pop(built[0])  # a new process: torch's built library is found, and loaded
    C.load_cuda(src, ["vector_add"], name="announce_test")
    assert len(built) == 2 and "compiling" not in capsys.readouterr().out
    C._built_modules.pop(built[0])
