"""Chapter 10's kernels (forward, backward) on aligned and ragged sizes, for compute-sanitizer.

On the GPU machine, from the repository root:

    compute-sanitizer --tool racecheck python course_utils/grading/sanitize/flash_mma.py
    compute-sanitizer --tool memcheck  python course_utils/grading/sanitize/flash_mma.py

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

KERNEL = paths.KERNELS / "flash_attention_mma.cu"
BR, THREADS = 128, 128  # the forward's Config: 2 m-tiles of 16 rows per warp, 4 warps
BC = {64: 128, 128: 64}  # keys per tile, by head dim


def main():
    module = load_cuda(KERNEL, ["flash_attention_mma", "flash_attention_mma_backward",
                                "flash_attention_mma_backward_atomic"], name="flash_attention_mma")
    for B, H, Nq, Nk, D in ((1, 2, 128, 128, 64), (1, 1, 100, 77, 128), (1, 1, 17, 200, 64)):
        kernel = compile_kernel(KERNEL, f"fa_mma::flash_attention_mma_kernel<{D}>")
        smem = 2 * (BR * D + 2 * BC[D] * D)  # Q, K and V tiles, bf16
        Q, K, V = (torch.randn(B, H, n, D, device="cuda").bfloat16() for n in (Nq, Nk, Nk))
        for causal in (False, True):
            O_ref, LSE_ref = checks.reference.attention(Q, K, V, causal=causal)
            O1, LSE1 = module.flash_attention_mma(Q, K, V, causal)
            O2 = torch.full_like(Q, math.nan)
            LSE2 = torch.full((B, H, Nq), math.nan, device="cuda")
            kernel((math.ceil(Nq / BR), H, B), THREADS, Q, K, V, O2, LSE2, Nq, Nk,
                   1 / math.sqrt(D), int(causal), shared_mem=smem)
            torch.cuda.synchronize()
            case = f"B={B}, H={H}, Nq={Nq}, Nk={Nk}, D={D}, causal={causal}"
            for O, LSE in ((O1, LSE1), (O2, LSE2)):
                checks.compare("O", O, O_ref, case=case, atol=2e-2, rtol=2e-2)
                checks.compare("LSE", LSE, LSE_ref, case=case, atol=1e-2, rtol=1e-3)
            dO = torch.randn_like(Q)
            q, k, v = (x.double().requires_grad_() for x in (Q, K, V))
            S = q @ k.transpose(-2, -1) / math.sqrt(D)
            if causal:
                keep = torch.ones(Nq, Nk, dtype=torch.bool, device="cuda").tril()
                S = S.masked_fill(~keep, -math.inf)
            (torch.softmax(S, dim=-1) @ v).backward(dO.double())
            for backward in (module.flash_attention_mma_backward,
                             module.flash_attention_mma_backward_atomic):
                dQ, dK, dV = backward(Q, K, V, O1, dO, LSE1, causal)
                for name, got, want in (("dQ", dQ, q.grad), ("dK", dK, k.grad),
                                        ("dV", dV, v.grad)):
                    tol = 3e-2 * max(1.0, want.abs().max().item())
                    checks.compare(name, got, want, case=case, atol=tol, rtol=5e-2)
            print(f"ok: {case}")
    print("all ok")


if __name__ == "__main__":
    main()
