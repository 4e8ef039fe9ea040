"""What a GPU can do at most, and which kernels a call really ran.

Two facts make a performance comparison fair, and both are measured here rather than assumed:

- **the ceiling**: a kernel that multiplies with scalar FMA instructions ("CUDA cores", SIMT) can
  never beat ``SMs x FP32 lanes per SM x 2 FLOP x clock``, whatever the tensor cores next to it
  could do. ``fp32_fma_peak_tflops()`` computes that number from the device's own attributes
  (the H100 SXM: 132 x 128 x 2 x 1.98 GHz = 66.9 TFLOP/s).
- **the opponent**: ``kernel_names(fn)`` lists the GPU kernels a call launched (the PyTorch
  profiler), and ``ncu_metrics(code, kernel)`` counts the instructions one of them issued
  (Nsight Compute): tensor-core ``mma.sync`` (HMMA), Hopper's ``wgmma`` (GMMA) and scalar FFMA.
  SDPA on float32 inputs, for example, runs a CUTLASS kernel that computes on tensor cores.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

# FP32 FMA lanes ("CUDA cores") per SM, by compute capability (the CUDA programming guide's
# table of arithmetic throughput: 32-bit floating-point add, multiply, multiply-add).
FP32_LANES_PER_SM = {
    (7, 0): 64, (7, 2): 64, (7, 5): 64,
    (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128,
    (9, 0): 128, (10, 0): 128, (10, 3): 128, (12, 0): 128, (12, 1): 128,
}

# The datasheet's HBM bandwidth (TB/s) by a device's name. Decode only reads K and V, so this is
# its ceiling; a copy's "bandwidth" counts read + write traffic and is no ceiling for a read-only
# kernel.
NOMINAL_HBM_TBPS = (("H200", 4.8), ("H100", 3.35), ("A100", 2.0))


def nominal_hbm_tbps(device: str) -> float | None:
    """The datasheet HBM bandwidth of the GPU named ``device`` (TB/s), None when unknown."""
    return next((v for k, v in NOMINAL_HBM_TBPS if k in device), None)


# Nsight Compute metrics: warp-level tensor-core instructions and thread-level FFMAs.
TENSOR_METRICS = {
    "hmma": "sm__inst_executed_pipe_tensor_op_hmma.sum",  # every tensor-core instruction
    "gmma": "sm__inst_executed_pipe_tensor_op_gmma.sum",  # of which Hopper wgmma
    "ffma": "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum",  # scalar fp32 FMAs, per thread
}

_CU_ATTRIBUTE = {"clock_khz": 13, "sms": 16, "major": 75, "minor": 76}


@dataclass(frozen=True)
class DeviceFacts:
    name: str
    compute_capability: tuple[int, int]
    sms: int
    clock_mhz: float  # the boost clock the driver reports
    fp32_lanes_per_sm: int

    @property
    def fp32_fma_peak_tflops(self) -> float:
        """SMs x lanes x 2 FLOP (one FMA) x clock, in TFLOP/s."""
        return self.sms * self.fp32_lanes_per_sm * 2 * self.clock_mhz * 1e6 / 1e12

    def __str__(self) -> str:
        major, minor = self.compute_capability
        return (f"{self.name} (sm_{major}{minor}): {self.sms} SMs x {self.fp32_lanes_per_sm} FP32 "
                f"lanes x 2 FLOP x {self.clock_mhz:.0f} MHz = "
                f"{self.fp32_fma_peak_tflops:.1f} TFLOP/s FP32 FMA peak")


def _cuda_driver():
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("no CUDA driver (libcuda) on this machine: the device facts need a GPU. "
                       "On a CPU-only machine read the recorded results instead.")


def device_facts(index: int = 0) -> DeviceFacts:
    """Name, compute capability, SM count and clock of GPU ``index``, read from the driver."""
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise TypeError(f"index must be a GPU number (0, 1, ...), got {index!r}")
    lib = _cuda_driver()

    def call(what, *args):
        status = what(*args)
        if status != 0:
            raise RuntimeError(f"CUDA driver call {what.__name__} failed with status {status} "
                               f"(is GPU {index} visible? check nvidia-smi)")

    call(lib.cuInit, 0)
    device = ctypes.c_int()
    call(lib.cuDeviceGet, ctypes.byref(device), index)
    values = {}
    for key, attribute in _CU_ATTRIBUTE.items():
        out = ctypes.c_int()
        call(lib.cuDeviceGetAttribute, ctypes.byref(out), attribute, device)
        values[key] = out.value
    name = ctypes.create_string_buffer(256)
    call(lib.cuDeviceGetName, name, 256, device)
    cc = (values["major"], values["minor"])
    if cc not in FP32_LANES_PER_SM:
        raise ValueError(f"no FP32 lane count known for compute capability {cc[0]}.{cc[1]}: add "
                         "it to hardware.FP32_LANES_PER_SM from NVIDIA's throughput table")
    return DeviceFacts(name.value.decode(), cc, values["sms"], values["clock_khz"] / 1000,
                       FP32_LANES_PER_SM[cc])


def fp32_fma_peak_tflops(index: int = 0) -> float:
    """The most TFLOP/s a kernel of scalar fp32 FMAs can reach on GPU ``index``."""
    return device_facts(index).fp32_fma_peak_tflops


def kernel_names(fn, *args, **kwargs) -> list[str]:
    """The GPU kernels ``fn(*args, **kwargs)`` launches (run once to warm up, then profiled)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not callable(fn):
        raise TypeError(f"kernel_names needs a function to call, got {type(fn).__name__}")
    if not torch.cuda.is_available():
        raise RuntimeError("kernel_names profiles GPU kernels: no GPU here")
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args, **kwargs)
        torch.cuda.synchronize()
    names = []
    for event in prof.events():
        if event.device_type.name == "CUDA" and not event.name.startswith("Memset") \
                and not event.name.startswith("Memcpy") and event.name not in names:
            names.append(event.name)
    return names


def ncu_metrics(code: str, kernel: str, metrics: dict[str, str] | None = None,
                timeout: float = 300) -> dict:
    """Run ``python -c code`` under Nsight Compute; the metrics of the first kernel matching
    the regular expression ``kernel``, as ``{"kernel": name, key: value, ...}``.

    ``metrics`` maps your names to Nsight Compute metric names (default: ``TENSOR_METRICS``).
    Raises a RuntimeError that says why when ncu is missing, cannot read the GPU's performance
    counters (a permission the administrator grants), or profiled nothing.
    """
    if not isinstance(code, str) or not code.strip():
        raise TypeError("code must be the Python source (a str) that launches the kernel to count")
    if not isinstance(kernel, str) or not kernel:
        raise TypeError("kernel must be a regular expression (a str) matching the kernel's name")
    metrics = dict(TENSOR_METRICS if metrics is None else metrics)
    ncu = shutil.which("ncu")
    if ncu is None:
        raise RuntimeError("Nsight Compute (ncu) is not on PATH: install the CUDA toolkit's ncu, "
                           "or read the recorded counts")
    command = [ncu, "--launch-count", "1", "--kernel-name", f"regex:{kernel}",
               "--print-units", "base",  # bytes as bytes, not "MB" or "GB" with the unit dropped
               "--metrics", ",".join(metrics.values()), sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ))
    text = done.stdout + done.stderr
    if "ERR_NVGPUCTRPERM" in text:
        raise RuntimeError("ncu may not read this GPU's performance counters (ERR_NVGPUCTRPERM): "
                           "an administrator must allow it (NVreg_RestrictProfilingToAdminUsers=0)")
    if done.returncode != 0:
        raise RuntimeError(f"ncu failed (exit {done.returncode}):\n{text[-2000:]}")
    result = {}
    for line in text.splitlines():
        if re.search(r"\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", line) and "kernel" not in result:
            result["kernel"] = line.strip().split(" (")[0]
        for key, metric in metrics.items():
            if line.strip().startswith(metric) and key not in result:
                value = line.split()[-1].replace(",", "")
                try:
                    result[key] = float(value) if "." in value else int(value)
                except ValueError:
                    result[key] = value
    missing = [k for k in metrics if k not in result]
    if "kernel" not in result or missing:
        raise RuntimeError(f"ncu profiled no kernel matching {kernel!r} (or lacked {missing}):\n"
                           f"{text[-2000:]}")
    return result
