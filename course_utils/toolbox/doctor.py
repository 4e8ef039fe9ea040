"""``python -m course_utils doctor``: what this machine can run, one row per capability.

Each probe runs in a fresh Python process, because Numba and Triton choose between GPU and
simulator when they are imported: the simulator rows force ``COURSE_DEVICE=cpu``, the GPU rows
run only where there is a GPU. A failing row says the exact fix. The exit code is non-zero only
when the CPU simulator path itself is broken, since every notebook needs it on a machine
without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "-"
PROBE_TIMEOUT = 300  # seconds: a CUDA load_inline build takes ~30 s on a fast machine


@dataclass
class Row:
    name: str
    status: str
    detail: str
    fix: str = ""
    critical: bool = False  # a failure here breaks the CPU simulator path


def _probe(code: str, cpu: bool = False) -> tuple[bool, str]:
    """Run ``code`` in a fresh interpreter; it prints one line of detail. Returns (ok, text)."""
    env = dict(os.environ)
    env.pop("COURSE_DEVICE", None)  # GPU rows probe the GPU even under COURSE_DEVICE=cpu
    if cpu:
        env["COURSE_DEVICE"] = "cpu"
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    # A file, not `python -c`: Triton's @jit reads the source of the functions it compiles.
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "probe.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(textwrap.dedent(code))
        try:
            proc = subprocess.run(
                [sys.executable, script],
                capture_output=True, text=True, timeout=PROBE_TIMEOUT, env=env,
            )
        except subprocess.TimeoutExpired:
            return False, f"timed out after {PROBE_TIMEOUT} s"
    if proc.returncode == 0:
        return True, proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return False, lines[-1] if lines else f"exit code {proc.returncode}"


_GPU_INFO = """
import json, torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": None}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info["gpu"] = {"name": p.name, "cc": f"{p.major}.{p.minor}",
                   "sms": p.multi_processor_count, "mem": p.total_memory / 2**30}
print(json.dumps(info))
"""

_NUMBA = """
import course_utils as cu
cu.setup(verbose=False)
import torch
from numba import cuda
# numba-cuda replaces numba's old built-in CUDA target through a .pth file; when that file is not
# run (a venv that reaches the package through a plain path in its own .pth), the old target
# loads, and the course's kernels fail later on keywords it lacks (launch_bounds)
assert "numba_cuda" in cuda.__file__, ("numba.cuda is numba's built-in target "
    f"({cuda.__file__}), not the numba-cuda package")
@cuda.jit
def add_one(x):
    i = cuda.grid(1)
    if i < x.size:
        x[i] += 1
x = torch.zeros(40, device=cu.device())
add_one[2, 32](cu.kernel_array(x))
cu.synchronize()
assert float(x.sum()) == 40, x
import numba
where = "" if cu.on_gpu() else " in the simulator"
print(f"numba {numba.__version__}: kernel compiled and ran{where}")
"""

_TRITON = """
import course_utils as cu
cu.setup(verbose=False)
import torch, triton, triton.language as tl
@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)
x = torch.zeros(40, device=cu.device())
add_one[(2,)](x, 40, BLOCK=32)
assert float(x.sum()) == 40, x
print(f"triton {triton.__version__}: kernel ran" + ("" if cu.on_gpu() else " in the interpreter"))
"""

_NVCC = """
from course_utils import cuda as cc
path = cc.nvcc_path()
if path is None:
    raise SystemExit("nvcc not found")
r = cc.resource_usage("__global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }", "k")
print(f"{path}: compiled for sm_90 (compile-only), {r.registers} registers")
"""

_CUDA_CPU = """
import tempfile
import numpy as np
from course_utils import cuda_cpu
src = '''
__global__ void add_one(float* x, int n) {
    __shared__ float tile[32];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    tile[threadIdx.x] = i < n ? x[i] : 0.0f;
    __syncthreads();
    if (i < n) x[i] = tile[threadIdx.x] + 1.0f;
}
'''
x = np.zeros(40, dtype=np.float32)
with tempfile.TemporaryDirectory() as tmp:
    cuda_cpu.launch(src, "add_one", (2,), (32,), x, 40, folder=tmp)
assert float(x.sum()) == 40, x
print("g++ ran a CUDA kernel under the thread-model emulation (2 blocks of 32 fibers)")
"""

_NVRTC = """
import course_utils as cu
cu.setup(verbose=False)
from course_utils import cuda as cc
src = '''
extern "C" __global__ void add_one(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
'''
k = cc.compile_kernel(src, "add_one")
if cu.on_gpu():
    import torch
    x = torch.zeros(40, device="cuda")
    k(2, 32, x, 40)
    torch.cuda.synchronize()
    assert float(x.sum()) == 40
    print("NVRTC compiled and launched a kernel through cuda.core")
else:
    print(f"NVRTC compiled a cubin ({len(k.cubin)} bytes); launching needs a GPU")
"""

_LOAD_INLINE = """
import course_utils as cu
cu.setup(verbose=False)
import shutil
if shutil.which("ninja") is None:
    import ninja  # the pip package puts its binary next to it
if cu.on_gpu():
    import torch
    from course_utils.toolbox.cuda import load_cuda
    src = '''#include <torch/types.h>
__global__ void add_one_kernel(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
torch::Tensor add_one(torch::Tensor x) {
    int n = x.numel();
    add_one_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), n);
    return x;
}
'''
    m = load_cuda(src, ["add_one"])
    x = m.add_one(torch.zeros(40, device="cuda"))
    assert float(x.sum()) == 40
    print("load_inline built and ran a CUDA extension")
else:  # CPU mode builds no extension (CUDA C++ is compiled by nvcc -cubin): ninja and g++ only
    import subprocess
    from torch.utils.cpp_extension import get_cxx_compiler, verify_ninja_availability
    verify_ninja_availability()
    cxx = get_cxx_compiler()
    subprocess.run([cxx, "-x", "c++", "-std=c++17", "-fsyntax-only", "-"], check=True,
                   input="int twice(int x) { return 2 * x; }", text=True, capture_output=True)
    print(f"ninja and {cxx} work; extensions are built on a GPU machine (a CUDA build of torch)")
"""


def rows() -> list[Row]:
    out: list[Row] = []
    py = sys.version_info
    out.append(Row("Python", OK if py >= (3, 10) else FAIL, sys.version.split()[0],
                   "" if py >= (3, 10) else "use Python 3.10 or newer", critical=True))
    ok, text = _probe(_GPU_INFO)
    info = json.loads(text) if ok else None
    if info is None:
        out.append(Row("torch", FAIL, text, "pip install torch", critical=True))
        return out
    build = f"CUDA {info['cuda']} build" if info["cuda"] else "CPU build"
    out.append(Row("torch", OK, f"{info['torch']} ({build})"))
    gpu = info["gpu"]
    if gpu:
        out.append(Row("GPU", OK, f"{gpu['name']}, compute capability {gpu['cc']}, "
                                  f"{gpu['sms']} SMs, {gpu['mem']:.0f} GiB"))
    else:
        fix = "" if info["cuda"] else "for a GPU: install a CUDA build of torch (pytorch.org)"
        out.append(Row("GPU", SKIP, "none: notebooks run in CPU simulator mode", fix))

    np_fix = "pip install 'numpy<2.5' (numba's CUDA compiler fails with numpy 2.5)"
    ok, text = _probe(_NUMBA, cpu=True)
    numba_fix = ("pip install numba numba-cuda (installed already? its numba_cuda redirect .pth "
                 "must be in a site-packages folder Python processes, not reached by a path)"
                 if "built-in target" in text else "pip install numba numba-cuda")
    out.append(Row("Numba CUDA simulator", OK if ok else FAIL, text,
                   "" if ok else numba_fix, critical=True))
    if gpu:
        ok, text = _probe(_NUMBA)
        fix = np_fix if "row_stack" in text else "pip install -U numba-cuda; check the driver"
        out.append(Row("Numba CUDA on the GPU", OK if ok else FAIL, text, "" if ok else fix))
    ok, text = _probe(_TRITON, cpu=True)
    out.append(Row("Triton interpreter", OK if ok else FAIL, text,
                   "" if ok else "pip install triton (Linux)", critical=True))
    if gpu:
        ok, text = _probe(_TRITON)
        out.append(Row("Triton on the GPU", OK if ok else FAIL, text,
                       "" if ok else "pip install triton matching your torch"))
    ok, text = _probe(_NVCC)
    out.append(Row("nvcc (compile-only)", OK if ok else WARN, text, "" if ok else
                   "install the CUDA toolkit, or: conda install -c nvidia cuda-nvcc "
                   "(only register reports and CPU compile checks need it)"))
    ok, text = _probe(_CUDA_CPU, cpu=True)
    out.append(Row("CUDA C++ on the CPU (cuda_cpu)", OK if ok else (WARN if gpu else FAIL), text,
                   "" if ok else "install g++ 10 or newer (apt install g++, or conda install "
                   "gxx): without a GPU, the CUDA C++ exercises run on this emulation",
                   critical=not gpu))
    ok, text = _probe(_NVRTC, cpu=not gpu)
    out.append(Row("NVRTC via cuda.core", OK if ok else WARN, text, "" if ok else
                   "pip install cuda-core cuda-bindings nvidia-cuda-nvrtc"))
    ok, text = _probe(_LOAD_INLINE, cpu=not gpu)
    out.append(Row("ninja + load_inline", OK if ok else WARN, text, "" if ok else
                   "pip install ninja; a C++ compiler (g++) must be on PATH"))
    return out


def format_rows(table: list[Row]) -> str:
    w0 = max(len(r.name) for r in table)
    lines = []
    for r in table:
        lines.append(f"{r.status:>4}  {r.name:<{w0}}  {r.detail}")
        if r.fix and r.status != OK:
            lines.append(f"{'':>4}  {'':<{w0}}  fix: {r.fix}")
    return "\n".join(lines)


def main() -> int:
    table = rows()
    print(format_rows(table))
    broken = [r.name for r in table if r.critical and r.status == FAIL]
    if broken:
        print(f"\nThe CPU simulator path is broken ({', '.join(broken)}): see the fixes above.")
        return 1
    print("\nThe CPU simulator path works: every notebook can run here.")
    return 0
