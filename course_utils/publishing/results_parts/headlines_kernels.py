"""The headlines of chapters 00-10: one recording per chapter, the kernels on one GPU.

Each ``_hNN(rec)`` turns a chapter's recording into its :class:`~.common.Headline` (the README's
chapter table and the top of each chapter in ``docs/results.md``). These chapters' recordings
hold one timing per shape (chapter 10: interleaved rounds once ``10_headline`` exists); chapters
11-14 (serving, training, ranks, Hopper) read issue 43's recordings and are
:mod:`.headlines_systems`.
"""

from __future__ import annotations

import dataclasses
import statistics

from .common import Headline, Recordings, _from_headline_file, ks, pct, sizes, span, x


def _h00(rec: Recordings) -> Headline:
    name = "00_tensor_cores"
    runs = {r["name"]: r for r in rec.data(name)["runs"]}
    a, b = runs["bf16 4096"], runs["bf16 4095"]
    return Headline(
        f"bf16 matmul (cuBLAS) at {a['tflops']:.0f} TFLOP/s on 4096³ on tensor cores; 4095³ "
        f"{b['median_ms'] / a['median_ms']:.1f}x slower on a fallback kernel",
        "4096³", rec.device(name), "one run", rec.date(name), name)


def _h01(rec: Recordings) -> Headline:
    name = "01_naive_attention_memory"
    rows = [r for r in rec.data(name)["rows"] if r["peak_bytes"] is not None]
    err = [abs(r["peak_bytes"] / r["predicted_bytes"] - 1) for r in rows]
    return Headline(
        f"naive attention's measured peak memory within {max(err):.1%} of the predicted bytes "
        f"of its N x N scores, N {ks(r['N'] for r in rows)}, float32 and bf16",
        "the predicted bytes", rec.device(name), "one run per shape", rec.date(name), name)


def _h02(rec: Recordings) -> Headline:
    name = "02_softmax_bandwidth"
    d = rec.data(name)
    ratio = [a / b for a, b in zip(d["gbps"]["numba (3 passes)"], d["gbps"]["torch.softmax"],
                                   strict=True)]
    return Headline(
        f"the Numba softmax (3 passes over global memory) at {span(ratio)} the bandwidth of "
        f"torch.softmax, {d['R']} rows of N {sizes(d['N'])}",
        "torch.softmax", rec.device(name), "one run per shape", rec.date(name), name)


def _h03(rec: Recordings) -> Headline:
    name = "03_bf16_divisibility"
    d = rec.data(name)
    t = dict(zip(d["sizes"], d["tflops"], strict=True))
    return Headline(
        f"bf16 matmul at 2049³ {t[2048] / t[2049]:.1f}x slower than at 2048³ "
        f"({t[2049]:.0f} against {t[2048]:.0f} TFLOP/s on cuBLAS)",
        "2048³", rec.device(name), "one run", rec.date(name), name)


def _h04(rec: Recordings) -> Headline:
    name = "04_ladder"
    d = rec.data(name)
    i = d["sizes"].index(max(d["sizes"]))
    n = d["sizes"][i]
    best = d["tflops"]["pipeline"][i]
    torch = d["tflops"]["torch fp32"][i]
    return Headline(
        f"the `cp.async` pipeline (the ladder's last step) at {best:.1f} TFLOP/s = "
        f"{x(best / torch)} torch fp32 (cuBLAS's FFMA SGEMM) and "
        f"{pct(best / d['fma_peak_tflops'])} of the FP32 FMA peak, {n}³",
        "torch fp32", rec.device(name), "one run", rec.date(name), name)


def _h05(rec: Recordings) -> Headline:
    name = "05_transpose_bandwidth"
    d = rec.data(name)
    i = d["sizes"].index(max(d["sizes"]))
    g = {k: v[i] for k, v in d["gbps"].items()}
    return Headline(
        f"the padded shared-memory transpose at {g['padded transpose']:.0f} GB/s = "
        f"{x(g['padded transpose'] / g['torch copy'])} torch copy, the naive one "
        f"{x(g['naive transpose'] / g['torch copy'])}; fp32 {d['sizes'][i]}²",
        "torch copy", rec.device(name), "one run", rec.date(name), name)


def _h06(rec: Recordings) -> Headline:
    name = "06_occupancy_driver"
    rows = rec.data(name)["rows"]
    same = sum(r["calculator"] == r["driver"] for r in rows)
    return Headline(
        f"the occupancy calculator agrees with the driver on {same} of {len(rows)} kernels",
        "the driver", rec.device(name), "one run", rec.date(name), name)


def _row(rows, **where):
    (found,) = [r for r in rows if all(r[k] == v for k, v in where.items())]
    return found


def _h07(rec: Recordings) -> Headline:
    name = "07_forward_benchmark"
    d = rec.data(name)
    r = _row(d["rows"], d=128, N=4096, causal=False)["tflops"]
    return Headline(
        f"CUDA C++ forward at {pct(r['cuda'] / d['fp32_fma_peak_tflops'])} of the FP32 FMA peak "
        f"and {x(r['cuda'] / r['sdpa fp32'])} SDPA fp32 (memory-efficient backend, 3xTF32 tensor "
        f"cores), Numba at {x(r['numba'] / r['sdpa fp32'])}; d = 128, N = 4096",
        "SDPA fp32", rec.device(name), "one run", rec.date(name), name)


def _h08(rec: Recordings) -> Headline:
    name = "08_backward_benchmark"
    d = rec.data(name)
    r = _row(d["rows"], d=128, N=4096, causal=False)["tflops"]
    return Headline(
        f"CUDA C++ forward + backward at {pct(r['cuda'] / d['fp32_fma_peak_tflops'])} of the FP32 "
        f"FMA peak and {x(r['cuda'] / r['sdpa fp32'])} SDPA fp32 (memory-efficient backend, "
        f"3xTF32 tensor cores); d = 128, N = 4096",
        "SDPA fp32", rec.device(name), "one run", rec.date(name), name)


def _h09(rec: Recordings) -> Headline:
    name = "09_benchmark"
    rows = [r for r in rec.data(name)["rows"] if r["N"] >= 1024]
    fwd = [r["fwd"]["triton (course)"] / r["fwd"]["sdpa flash"] for r in rows]
    cud = [r["fwd"]["triton (course)"] / r["fwd"]["sdpa cudnn"] for r in rows]
    return Headline(
        f"Triton forward {span(fwd)} SDPA flash (an Ampere `mma.sync` kernel) and {span(cud)} "
        f"cuDNN (Hopper `wgmma`, the bar), median {x(statistics.median(cud))}; "
        f"{len(rows)} shapes, bf16, d = 64/128, N {ks(r['N'] for r in rows)}, causal and not",
        "SDPA flash", rec.device(name), "one run per shape", rec.date(name), name)

def _h10(rec: Recordings) -> Headline:
    flash = "SDPA flash (FlashAttention-2's own `mma.sync` kernel)"
    if rec.has("10_headline"):
        h = _from_headline_file(rec, "10_headline", "`mma.sync` forward", "sdpa flash", flash)
        return _with_atomic_backward(rec, h) if rec.has("10_backward_variants") else h
    name = "10_benchmark"
    rows = rec.data(name)["rows"]
    fwd = [r["fwd"]["course mma"] / r["fwd"]["sdpa flash"] for r in rows]
    return Headline(
        f"`mma.sync` forward against {flash}: median {x(statistics.median(fwd))} over "
        f"{len(rows)} shapes, {span(fwd)} (bf16, d = 64/128, N {ks(r['N'] for r in rows)}); "
        f"from the lecture's recording until `10_headline` is recorded",
        flash, rec.device(name), "one run per shape", rec.date(name), name)


def _with_atomic_backward(rec: Recordings, h: Headline) -> Headline:
    """Chapter 10's row with the atomic-dQ backward (``10_backward_variants``) added."""
    name = "10_backward_variants"
    rows = rec.data(name)["rows"]
    flash = [r["ratio"]["atomic vs sdpa flash"]["median"] for r in rows]
    det = [r["atomic vs deterministic"]["median"] for r in rows]
    return dataclasses.replace(
        h, text=f"{h.text}; with the atomic-dQ backward (one pass, 5 products) {span(flash)}, "
                f"{span(det)} the deterministic one ({rec.date(name)})",
        source=f"{h.source}`, `{name}")
