"""Run chapter 07's CUDA kernel on a tile-aligned and a ragged size, for compute-sanitizer.

On the GPU machine, from the repository root:

    compute-sanitizer --tool racecheck python course_utils/grading/sanitize/flash_forward.py
    compute-sanitizer --tool memcheck  python course_utils/grading/sanitize/flash_forward.py

Both ways in (load_cuda and NVRTC) run, causal and not; each result is also checked against the
float64 reference, so a run that prints "all ok" and a sanitizer summary of 0 errors is clean.
"""

import math

import torch

import course_utils as cu

cu.setup()

from course_utils import paths  # noqa: E402
from course_utils.grading import checks  # noqa: E402
from course_utils.toolbox.cuda import compile_kernel, load_cuda  # noqa: E402

KERNEL = paths.KERNELS / "flash_attention_forward.cu"
BR, THREADS, PAD = 64, 256, 4


def main():
    module = load_cuda(KERNEL, ["flash_attention_forward"])
    for B, H, Nq, Nk, d in ((2, 2, 128, 128, 64), (1, 3, 100, 77, 128), (1, 1, 17, 200, 16)):
        kernel = compile_kernel(KERNEL, f"flash_attention_forward_kernel<{d}>")
        smem = 4 * (BR * (d + PAD) + BR * (d + PAD) + BR * (BR + PAD))
        Q = torch.randn(B, H, Nq, d, device="cuda")
        K, V = (torch.randn(B, H, Nk, d, device="cuda") for _ in range(2))
        for causal in (False, True):
            scale = 1 / math.sqrt(d)
            O_ref, LSE_ref = checks.reference.attention(Q, K, V, causal=causal, scale=scale)
            O1, LSE1 = module.flash_attention_forward(Q, K, V, causal, scale)
            O2 = torch.full_like(Q, math.nan)
            LSE2 = torch.full((B, H, Nq), math.nan, device="cuda")
            kernel((math.ceil(Nq / BR), H, B), THREADS, Q, K, V, O2, LSE2, Nq, Nk, scale,
                   int(causal), shared_mem=smem)  # fmt: skip
            torch.cuda.synchronize()
            case = f"B={B}, H={H}, Nq={Nq}, Nk={Nk}, d={d}, causal={causal}"
            for O, LSE in ((O1, LSE1), (O2, LSE2)):
                checks.compare("O", O, O_ref, case=case, atol=1e-4, rtol=1e-4)
                checks.compare("LSE", LSE, LSE_ref, case=case, atol=1e-4, rtol=1e-4)
            print(f"ok: {case}")
    print("all ok")


if __name__ == "__main__":
    main()
