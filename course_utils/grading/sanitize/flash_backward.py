"""Run chapter 08's CUDA backward kernels on tile-aligned and ragged sizes, for compute-sanitizer.

On the GPU machine, from the repository root:

    compute-sanitizer --tool racecheck python course_utils/grading/sanitize/flash_backward.py
    compute-sanitizer --tool memcheck  python course_utils/grading/sanitize/flash_backward.py

Both dQ variants (atomics in the dK/dV kernel, and the deterministic second kernel) run, causal
and not; each gradient is also checked against the float64 closed form, so a run that prints
"all ok" and a sanitizer summary of 0 errors is clean. O and LSE come from the float64 reference,
so that only the backward kernels run under the sanitizer.
"""

import math

import torch

import course_utils as cu

cu.setup()

from course_utils import paths  # noqa: E402
from course_utils.grading import checks  # noqa: E402
from course_utils.grading.specs.ch08 import reference_gradients  # noqa: E402
from course_utils.toolbox.cuda import load_cuda  # noqa: E402

KERNEL = paths.KERNELS / "flash_attention_backward.cu"


def main():
    module = load_cuda(KERNEL, ["flash_attention_backward"])
    for B, H, Nq, Nk, d in ((2, 2, 128, 128, 64), (1, 3, 100, 77, 128), (1, 1, 17, 200, 16),
                            (1, 2, 130, 40, 32)):  # fmt: skip
        Q, dO = (torch.randn(B, H, Nq, d, device="cuda") for _ in range(2))
        K, V = (torch.randn(B, H, Nk, d, device="cuda") for _ in range(2))
        for causal in (False, True):
            scale = 1 / math.sqrt(d)
            O, LSE, *want = reference_gradients(Q, K, V, dO, causal, scale)
            O, LSE = O.float().contiguous(), LSE.float().contiguous()
            for deterministic in (False, True):
                got = module.flash_attention_backward(Q, K, V, O, LSE, dO, causal, scale,
                                                      deterministic)
                torch.cuda.synchronize()
                case = (f"B={B}, H={H}, Nq={Nq}, Nk={Nk}, d={d}, causal={causal}, "
                        f"deterministic={deterministic}")
                for name, g, w in zip(("dQ", "dK", "dV"), got, want, strict=True):
                    checks.compare(name, g, w, case=case, atol=1e-4, rtol=1e-4)
                print(f"ok: {case}")
    print("all ok")


if __name__ == "__main__":
    main()
