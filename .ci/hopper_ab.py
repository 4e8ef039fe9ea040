"""A/B of build options of chapter 14's CUDA kernel against cuDNN, on one GPU, in one run.

    python .ci/hopper_ab.py [--ns 4096,16384] [--rounds 3] [--out ab.json]

Every build in BUILDS is compiled (about 40 s each). Then each shape times every build's
variants and SDPA's flash and cuDNN backends, round after round in turn, so that clock drift
hits all alike. The table gives each one's median over the rounds in TFLOP/s; the spread of
cuDNN's rounds shows how much two equal kernels can differ. Every output is also compared with
cuDNN's.
Needs an sm_90 GPU (H100/H200).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import course_utils as cu  # noqa: E402
from course_utils import bench  # noqa: E402
from course_utils.toolbox.cuda import load_cuda  # noqa: E402

SOURCE = ROOT / "course_utils" / "kernels" / "flash_attention_hopper.cu"
BWD_SOURCE = SOURCE.with_name("flash_attention_hopper_bwd.cu")
BUILDS = {"default": [], "skip rescale": ["-DFA_SKIP_UNIT_RESCALE"]}
VARIANTS = {64: (0, 2, 3, 5, 6), 128: (0, 2, 3, 4, 6)}


def sdpa(backend):
    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def in_rounds(impls, args, flops, rounds):
    """TFLOP/s of each of impls (name -> function of args), timed round after round in turn, so
    that clock drift hits all alike: name -> one value per round."""
    times = {name: [] for name in impls}
    for _ in range(rounds):
        for name, fn in impls.items():
            times[name].append(bench.tflops(flops, bench.time_fn(fn, *args).median_ms))
    return times


def shapes(D, ns, n_tensors):
    """The table's shapes at head dim D: B x N = 32768 tokens, H x D = 2048, without the mask
    and causal. Yields (causal, N, B, H, tensors): n_tensors random bf16 (B, H, N, D) tensors."""
    for causal in (False, True):
        for N in (int(x) for x in ns.split(",")):
            B, H = 32768 // N, 2048 // D
            tensors = tuple(torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
                            for _ in range(n_tensors))
            yield causal, N, B, H, tensors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ns", default="4096,16384")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="hopper_ab.json")
    parser.add_argument("--bwd", action="store_true",
                        help="also forward + backward: the wgmma backward against cuDNN's")
    args = parser.parse_args()
    cu.setup()
    started = time.time()
    mods = {label: load_cuda(SOURCE, ["flash_attention_hopper"], name="fa_ab", arch="sm_90a",
                             extra_cuda_cflags=flags) for label, flags in BUILDS.items()}
    print(f"built {len(mods)} variants of the source in {time.time() - started:.0f} s")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for D in (64, 128):
        impls = {"sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION),
                 "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
        for label, mod in mods.items():
            for var in VARIANTS[D]:
                impls[f"{label} v{var}"] = (lambda q, k, v, c, mod=mod, var=var:
                                            mod.flash_attention_hopper(q, k, v, c, var)[0])
        names = list(impls)
        print(f"\nd = {D}: TFLOP/s, median of {args.rounds} rounds (cuDNN's spread in brackets)")
        print(f"{'causal':>6} {'N':>6} " + " ".join(f"{n[-15:]:>15}" for n in names))
        for causal, N, B, H, (q, k, v) in shapes(D, args.ns, 3):
            want = impls["sdpa cudnn"](q, k, v, causal).float()
            flops = bench.attention_flops(B, H, N, N, D, causal)
            for name, fn in impls.items():
                err = (fn(q, k, v, causal).float() - want).abs().max().item()
                if not err < 0.05:
                    print(f"   {name}: max |O - O_cudnn| = {err:.3g} at N={N}, causal={causal}")
            times = in_rounds(impls, (q, k, v, causal), flops, args.rounds)
            med = {n: statistics.median(t) for n, t in times.items()}
            spread = max(times["sdpa cudnn"]) / min(times["sdpa cudnn"]) - 1
            rows.append({"D": D, "causal": causal, "N": N, "tflops": times})
            print(f"{str(causal):>6} {N:6d} " + " ".join(f"{med[n]:15.0f}" for n in names)
                  + f"   [{spread:.0%}]", flush=True)
    if args.bwd:
        rows += fwd_bwd(mods["default"], args)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                         indent=1))
    print(f"\nwrote {args.out} ({time.time() - started:.0f} s)")


def fwd_bwd(fwd, args):
    """Forward + backward in TFLOP/s (3.5x the forward's FLOPs): each forward variant with the
    wgmma backward, against cuDNN's and flash's autograd; dQ, dK, dV compared with cuDNN's."""
    bwd = load_cuda(BWD_SOURCE, ["flash_attention_hopper_bwd"], name="fa_ab_bwd", arch="sm_90a")
    rows = []

    def sdpa_both(backend):
        def run(q, k, v, causal, dO):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            with sdpa_kernel(backend):
                O = F.scaled_dot_product_attention(*leaves, is_causal=causal)
                return torch.autograd.grad(O, leaves, dO)
        return run

    def cuda_both(var):
        def run(q, k, v, causal, dO):
            O, lse = fwd.flash_attention_hopper(q, k, v, causal, var)
            return bwd.flash_attention_hopper_bwd(q, k, v, O, dO, lse, causal)
        return run

    for D in (64, 128):
        impls = {"sdpa flash": sdpa_both(SDPBackend.FLASH_ATTENTION),
                 "sdpa cudnn": sdpa_both(SDPBackend.CUDNN_ATTENTION)}
        impls |= {f"cuda v{var}": cuda_both(var) for var in (3, 6)}
        names = list(impls)
        print(f"\nd = {D}, forward + backward: TFLOP/s, median of {args.rounds} rounds")
        print(f"{'causal':>6} {'N':>6} " + " ".join(f"{n:>12}" for n in names))
        for causal, N, B, H, (q, k, v, dO) in shapes(D, args.ns, 4):
            want = impls["sdpa cudnn"](q, k, v, causal, dO)
            for name, fn in impls.items():
                for g, w, what in zip(fn(q, k, v, causal, dO), want, "QKV", strict=True):
                    err = (g.float() - w.float()).abs().max().item()
                    tol = 0.05 * max(1.0, w.float().abs().max().item())
                    if not err < tol:
                        print(f"   {name}: max |d{what} - cuDNN's| = {err:.3g} at N={N}, "
                              f"causal={causal}")
            flops = bench.attention_flops(B, H, N, N, D, causal, mode="fwd+bwd")
            times = in_rounds(impls, (q, k, v, causal, dO), flops, args.rounds)
            med = {n: statistics.median(t) for n, t in times.items()}
            rows.append({"D": D, "causal": causal, "N": N, "mode": "fwd+bwd", "tflops": times})
            print(f"{str(causal):>6} {N:6d} " + " ".join(f"{med[n]:12.0f}" for n in names),
                  flush=True)
    return rows


if __name__ == "__main__":
    main()
