"""``docs/results.md``: each recording drawn as tables by what it holds, and the page itself.

:data:`RENDERERS` picks a renderer by content (the first predicate that accepts the data):
attention headlines (chapters 10, 14), decode (``11_decode_headline``), a training step's
profile (``12_profile``), the ring's benchmark (``13_ring_benchmark``) and Ulysses
(``13_ulysses``) have compact tables; :func:`_render_data` flattens the rest.
:func:`render_results` puts them under each chapter's headline. Its own room: the tables know
nothing of the README or of the files written (:mod:`course_utils.publishing.results`).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from pathlib import Path

from .chapters import CHAPTERS, headlines, notebook
from .common import (
    ROOT,
    SDPA_NAMES,
    Recordings,
    _profile_part,
    _tbps,
    ks,
    nominal_hbm_tbps,
    num,
    pct,
    short_device,
    span,
)


def _flatten(value, prefix: str = "") -> dict:
    """Nested dicts as ``{"fwd / sdpa flash": 1.0}``; short lists joined, long ones counted."""
    out = {}
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix} / {k}" if prefix else str(k)))
    elif isinstance(value, list):
        if len(value) <= 6 and all(not isinstance(v, dict | list) for v in value):
            out[prefix] = ", ".join(num(v) for v in value)
        else:
            out[prefix] = f"({len(value)} values)"
    else:
        out[prefix] = value
    return out


def _table(rows: list[dict]) -> list[str]:
    flat = [_flatten(r) for r in rows]
    cols: list[str] = []
    for f in flat:
        cols += [c for c in f if c not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(num(f.get(c)) for c in cols) + " |" for f in flat]
    return lines


def _series(d: dict) -> tuple[str, list] | None:
    """The key of a list of sizes that other lists (or a dict of lists) run along."""
    for key in ("sizes", "N", "sizes (N)"):
        if isinstance(d.get(key), list) and all(isinstance(v, int | float) for v in d[key]):
            return key, d[key]
    return None


def _keyed_table(d: dict) -> list[str] | None:
    """A dict of dicts (one row per key) as a table; transposed when the rows are wide."""
    if len(d) < 2 or not all(isinstance(r, dict) and r for r in d.values()):
        return None
    flat = {name: _flatten(r) for name, r in d.items()}
    cols = {c for f in flat.values() for c in f}
    if len(cols) > 12 and len(cols) > len(flat):  # few wide rows: one row per column instead
        return _table([{"": c, **{name: f.get(c) for name, f in flat.items()}}
                       for c in dict.fromkeys(c for f in flat.values() for c in f)])
    return _table([{"": name, **f} for name, f in flat.items()])


def _render_data(d) -> list[str]:
    if not isinstance(d, dict):
        return [f"- {num(d)}"]
    table = _keyed_table(d)
    if table:
        return table + [""]
    lines: list[str] = []
    series = _series(d)
    if series:
        key, xs = series
        cols = {k: v for k, v in d.items()
                if isinstance(v, list) and len(v) == len(xs) and k != key}
        for k, v in d.items():
            if isinstance(v, dict) and v and all(isinstance(s, list) and len(s) == len(xs)
                                                for s in v.values()):
                cols.update({f"{k} / {s}": vals for s, vals in v.items()})
        if cols and len(xs) <= 40:
            rows = [{key: xs[i], **{c: v[i] for c, v in cols.items()}} for i in range(len(xs))]
            lines += _table(rows) + [""]
        elif cols:
            lines.append(f"- {len(xs)} sizes, {key} {num(min(xs))}-{num(max(xs))}: "
                         + "; ".join(f"{c} {num(min(v))}-{num(max(v))}" for c, v in cols.items()
                                     if all(isinstance(y, int | float) for y in v)))
        done = {key, *(c.split(" / ")[0] for c in cols)}
    else:
        done = set()
    for k, v in d.items():
        if k in done:
            continue
        if lines and lines[-1] != "" and isinstance(v, list | dict):
            lines.append("")
        if isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
            lines += [f"**{k}**", ""] + _table(v) + [""]
        elif isinstance(v, dict) and _keyed_table(v):
            lines += [f"**{k}**", ""] + _keyed_table(v) + [""]
        else:
            for name, value in _flatten(v, str(k)).items():
                lines.append(f"- {name}: {num(value)}")
    if lines and lines[-1] != "":
        lines.append("")
    return lines


def _ratio_cell(r: dict | None) -> str:
    if not r:
        return "-"
    return f"{r['median']:.2f}x ({r['lo']:.2f}-{r['hi']:.2f})"


def _render_headline(d: dict) -> list[str]:
    """A ``NN_headline`` recording: per shape and mode, the median ratio and its spread."""
    lines = [f"{d.get('kernel', 'the course kernel')}: {d['dtype']}, {d['rounds']} interleaved "
             "rounds per shape; ratio = SDPA's time / the course's time (> 1: the course is "
             "faster), median (lowest-highest round).", ""]
    rows = [{"d": r["D"], "causal": r["causal"], "N": r["N"], "B": r["B"], "H": r["H"],
             "mode": r["mode"], "variant": r.get("variant"),
             "course TFLOP/s": r["tflops"].get("course"),
             "x SDPA flash": _ratio_cell(r["ratio"].get("sdpa flash")),
             "x cuDNN": _ratio_cell(r["ratio"].get("sdpa cudnn"))} for r in d["rows"]]
    return lines + _table(rows) + [""]


def _spread(v: dict | None, scale: float = 1.0) -> str:
    """``26.7 (25.3-28.2)``: a summary's median with its lowest and highest round."""
    if not v:
        return "-"
    return f"{num(v['median'] * scale)} ({num(v['lo'] * scale)}-{num(v['hi'] * scale)})"


def _rounds_summary(values: list[float] | None) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "lo": min(values), "hi": max(values)}


def _rows(d) -> list:
    """``d["rows"]`` when it is a list of dicts, else []."""
    rows = d.get("rows") if isinstance(d, dict) else None
    if isinstance(rows, list) and all(isinstance(r, dict) for r in rows):
        return rows
    return []


def _is_attention_headline(d) -> bool:
    rows = _rows(d)
    return bool(rows) and all(isinstance(r, dict) and "D" in r and "ratio" in r for r in rows)


def _is_decode(d) -> bool:
    rows = _rows(d)
    return bool(rows) and all(isinstance(r, dict) and "Lq" in r and "median_us" in r
                              for r in rows)


def _is_profile(d) -> bool:
    return _profile_part(d) is not None


def _is_ring(d) -> bool:
    rows = _rows(d)
    return bool(rows) and all(isinstance(r, dict) and "n_per_gpu" in r and "summary" in r
                              and "ms" in r for r in rows)


def _is_ulysses(d) -> bool:
    rows = _rows(d)
    return (bool(rows) and "checks" in d
            and all(isinstance(r, dict) and "a2a_bytes_per_rank" in r for r in rows))


def _is_fp8(d) -> bool:
    rows = _rows(d)
    return (bool(rows) and isinstance(d.get("accuracy"), dict)
            and all("fp8 vs bf16" in r.get("ratio", {}) for r in rows))


def _render_fp8(d: dict) -> list[str]:
    """``14_fp8``: the FP8 forward as a user calls it, the kernel alone, the producers, against
    the course's bf16 forward and cuDNN; then the error with and without the rotation."""
    lines = [f"{d.get('kernel', 'FP8')}: {d['dtype']}, {d['rounds']} interleaved rounds per "
             "shape. `fp8`: as a user calls it (quantization inside the timed call); `rotated`: "
             "with the Hadamard rotation; `kernel`: the FP8 kernel on inputs quantized "
             "beforehand; `triton fp8`: the Triton FP8 forward as a user calls it; `bf16`: the "
             "course's bf16 forward. Ratio = bf16's time / the FP8 call's (> 1: FP8 is "
             "faster), median (lowest-highest round).", ""]
    rows = [{"d": r["D"], "causal": r["causal"], "N": r["N"], "B": r["B"], "H": r["H"],
             **{f"{n} TFLOP/s": r["tflops"].get(n) for n in ("fp8", "fp8 rotated", "fp8 kernel",
                                                            "triton fp8", "bf16", "sdpa cudnn")},
             "quantize ms": r["ms"].get("quantize"),
             "fp8 / bf16": _ratio_cell(r["ratio"].get("fp8 vs bf16")),
             "kernel / bf16": _ratio_cell(r["ratio"].get("fp8 kernel vs bf16")),
             "fp8 / cuDNN": _ratio_cell(r["ratio"].get("fp8 vs sdpa cudnn"))}
            for r in d["rows"]]
    acc = d["accuracy"]
    lines += _table(rows) + ["", f"Error of O against float64, max |O - O64| / max |O64| "
                             f"(B = {acc['B']}, H = {acc['H']}, N = {acc['N']}, d = {acc['D']}; "
                             "two channels of Q and K scaled by the outlier factor):", ""]
    lines += _table([{"causal": causal, "outlier": row["outlier"], "plain": row["plain"],
                      "rotated": row["rotated"]}
                     for causal, rs in acc["rows"].items() for row in rs])
    return lines + [""]


def _render_decode(d: dict) -> list[str]:
    """``11_decode_headline``: decode bandwidth as a fraction of the nominal HBM, against SDPA."""
    device = short_device(d.get("device", ""))
    nominal = nominal_hbm_tbps(device)
    lines = [f"Decode, {d.get('dtype', '')}, Hq = {d.get('Hq')}, d = {d.get('d')}; "
             f"{d.get('rounds')} interleaved rounds per shape. {d.get('timing', '')}. "
             f"{d.get('sdpa_note', '')}. Bytes = K and V of the visible keys plus q and O; "
             + (f"% of HBM = bytes / time against the {device}'s nominal {nominal} TB/s (decode "
                "only reads: a copy's figure, which counts read + write, is no ceiling here)"
                if nominal else "no nominal HBM bandwidth known for this device")
             + ". Ratios: the other method's time / ours (> 1: ours is faster), median "
             "(lowest-highest round).", ""]
    rows = []
    for r in d["rows"]:
        ours = r.get("us", {}).get("ours")
        best = r.get("sdpa_best")
        med = r.get("median_us", {})
        gbs = _tbps(r["bytes"], med["ours"]) * 1e3 if "ours" in med else None
        plan = r.get("plan_splits")
        rows.append({
            "shape": r.get("label", ""), "B": r["B"], "keys": ks([r["N"]]), "Hkv": r["Hkv"],
            "Lq": r.get("Lq", 1), "paged": r.get("paged", False),
            "ours µs": _spread(_rounds_summary(ours)),
            "GB/s": gbs,
            "% of HBM": pct(gbs / 1e3 / nominal) if gbs and nominal else "-",
            "SDPA's fastest": (f"{SDPA_NAMES.get(best, best)} {num(med[best])} µs"
                               if best in med else "-"),
            "x SDPA's fastest": _ratio_cell(r.get("vs_sdpa_best")),
            "splits": ("plan " + "/".join(map(str, plan)) if plan
                       else r.get("num_splits")),
            "x one split count": _ratio_cell(r.get("vs_one_split_count"))})
    lines += _table(rows) + [""]
    errors = sorted({f"{k}: {str(v).rstrip('.')}" for r in d["rows"]
                     for k, v in r.get("errors", {}).items()})
    if errors:
        lines += ["Refused (every shape where it appears): " + "; ".join(errors) + ".", ""]
    where = sorted({r.get("config_from") for r in d["rows"] if r.get("config_from")})
    lines.append(f"Configuration: {', '.join(where) or '-'}"
                 + ("" if d.get("sweep") else " (the configuration sweep did not run)")
                 + "; correctness on the GPU: "
                 + ("; ".join(d["correctness_failures"]) if d.get("correctness_failures")
                    else "no failure") + ".")
    return lines + [""]


def _render_profile(d: dict) -> list[str]:
    """``12_profile``: a training step's host / device / idle split, and the KV-cache op."""
    p = _profile_part(d)
    lines = [f"{p.get('note', '')}.", ""]
    skips = p.get("cudagraph_skips", {})
    rows = [{"": name, "mode": r.get("mode"), "attention": r.get("attention"),
             "step ms": _spread(_rounds_summary(r.get("step_ms_rounds"))),
             "device ms": r.get("device_ms"), "idle ms": r.get("idle_ms"),
             "GPU busy": pct(r["device_ms"] / r["step_ms"]) if r.get("step_ms") else "-",
             "host ops ms": r.get("host_ops_ms"), "launches": r.get("launches"),
             "graph launches": r.get("graph_launches"),
             "CUDA-graph skips": skips.get(name)}
            for name, r in p["rows"].items()]
    lines += _table(rows) + [""]
    if d.get("sizes"):
        lines += ["Model: " + ", ".join(f"{k} {v}" for k, v in d["sizes"].items()) + ".", ""]
    kv = d.get("kv_cache")
    if kv:
        lines += ["**KV-cache write** (a custom op with `mutates_args`):", ""]
        for key, value in kv.items():
            if key == "timing":
                t = value
                ms = {k: _rounds_summary(v) for k, v in t.get("ms", {}).items()}
                lines.append("- timing (" + ", ".join(f"{k} {t[k]}" for k in
                                                      ("T", "H", "d", "page_size") if k in t)
                             + "): " + "; ".join(f"{k} {_spread(v)} ms" for k, v in ms.items())
                             + (f"; ratio {_ratio_cell(t.get('ratio'))}" if t.get("ratio")
                                else ""))
            elif isinstance(value, dict):
                lines.append(f"- {key}: " + ", ".join(f"{k} {num(v)}" for k, v in value.items()))
            else:
                lines.append(f"- {key}: {num(value)}")
        lines.append("")
    for m in p.get("skip_messages", []):
        lines.append(f"- CUDA graphs skipped: {num(m)}")
    return lines + [""]


def _kernel_names(notes: dict) -> list[str]:
    names = []
    for k, v in notes.items():
        if k.endswith("kernels") and isinstance(v, list):
            for n in v:
                short = n.split("_knob")[0].removeprefix("void ").split("(")[0].split("<")[0]
                if short not in names:
                    names.append(short)
    return names


def _render_ring(d: dict) -> list[str]:
    """``13_ring_benchmark`` (issue 43's format): ms per variant with spreads, % of ideal."""
    lines = [f"Forward + backward, causal, B = {d.get('B')}, d = {d.get('d')}, on "
             f"{d.get('R', 2)} GPUs; ms: median (lowest-highest) of {d.get('rounds')} "
             "interleaved rounds, slowest rank. % of ideal = one GPU's time / (GPUs x the "
             "variant's time), per round, against cuDNN on one GPU (and against the course's "
             "block kernel on one GPU). Link GB/s = the K/V block's bytes / one one-way "
             "transfer.", ""]
    rows = []
    for r in d["rows"]:
        s, ms = r["summary"], r["summary"].get("ms", {})
        ideal, block = s.get("pct_ideal", {}), s.get("pct_ideal_block", {})
        link = ms.get("link one way")
        rows.append({
            "tokens/GPU": ks([r["n_per_gpu"]]), "H:Hkv": f"{r['H']}:{r['Hkv']}",
            "cuDNN 1 GPU ms": _spread(ms.get("cudnn 1 GPU")),
            "block kernel 1 GPU ms": _spread(ms.get("block kernel 1 GPU")),
            "ring zigzag ms": _spread(ms.get("ring zigzag")),
            "all-gather ms": _spread(ms.get("all-gather zigzag")),
            "context_parallel ms": _spread(ms.get("torch context_parallel")),
            "% ideal vs cuDNN: ring / all-gather / cp": " / ".join(
                pct(ideal[k]["median"]) if k in ideal else "-"
                for k in ("ring zigzag", "all-gather zigzag", "torch context_parallel")),
            "ring % ideal vs block kernel": (pct(block["ring zigzag"]["median"])
                                             if "ring zigzag" in block else "-"),
            "link GB/s": (r["kv_block_bytes"] / (link["median"] * 1e-3) / 1e9
                          if link and r.get("kv_block_bytes") else None)})
    lines += _table(rows) + [""]
    blocks = sorted({r["block_kernel"] for r in d["rows"] if r.get("block_kernel")})
    if blocks:
        lines += [f"Block kernel: {', '.join(blocks)}.", ""]
    names = []
    for r in d["rows"]:
        names += [n for n in _kernel_names(r.get("notes", {})) if n not in names]
    if names:
        lines += ["SDPA's kernels (cuDNN on one GPU and inside `context_parallel`): "
                  + ", ".join(f"`{n}`" for n in names) + ".", ""]
    diffs = [v for r in d["rows"] for k, v in r.get("notes", {}).items()
             if "max rel" in k and isinstance(v, int | float)]
    if diffs:
        lines += [f"`context_parallel`'s O against the ring's: max relative difference "
                  f"{span(diffs, num)}.", ""]
    errors = [f"{ks([r['n_per_gpu']])} {r['H']}:{r['Hkv']} {k}: {v}" for r in d["rows"]
              for k, v in (r.get("errors") or {}).items()]
    if errors:
        lines.append("Errors: " + "; ".join(errors) + ".")
    return lines + [""]


def _render_ulysses(d: dict) -> list[str]:
    """``13_ulysses``: the check against float64, then timing against one GPU and the ring."""
    lines = [f"DeepSpeed-Ulysses on {d.get('R')} GPUs over {d.get('backend')} "
             f"(NCCL {d.get('nccl', '-')}), block kernel {d.get('kernel')}, {d.get('dtype')}. "
             f"{d.get('what', '')}.", "", "**Checks** (relative error against float64):", ""]
    checks = [{**{k: v for k, v in c["case"].items()},
               **{k: v for k, v in c.get("rel_err", {}).items()},
               "tol": c.get("tol"), "ok": c.get("ok")} for c in d.get("checks", [])]
    if checks:
        lines += _table(checks) + [""]
    lines += [f"**Timing** (recorded in seconds, shown in ms: median (lowest-highest) of "
              f"{d.get('rounds')} interleaved rounds; % of ideal against the block kernel on "
              "one GPU; x ring = the ring's time / Ulysses' (> 1: Ulysses is faster)):", ""]
    rows = []
    for r in d["rows"]:
        t = {k: _rounds_summary(v) for k, v in r.get("s", {}).items()}
        plan = r.get("plan", {})
        rows.append({
            "tokens/GPU": ks([r["n_per_gpu"]]), "H:Hkv": f"{r['H']}:{r['Hkv']}",
            "heads per rank": f"{plan.get('H_r')}:{plan.get('Hkv_r')}" if plan else "-",
            "1 GPU": _spread(t.get("single GPU"), 1e3),
            "Ulysses": _spread(t.get("ulysses"), 1e3),
            "its attention": _spread(t.get("ulysses compute"), 1e3),
            "its all-to-alls": _spread(t.get("ulysses all-to-all"), 1e3),
            "ring zigzag": _spread(t.get("ring zigzag"), 1e3),
            "% of ideal": (f"{pct(r['pct_of_ideal']['median'])} ("
                           f"{span([r['pct_of_ideal']['lo'], r['pct_of_ideal']['hi']], pct)})"
                           if r.get("pct_of_ideal") else "-"),
            "all-to-all share": pct(r["a2a_share"]["median"]) if r.get("a2a_share") else "-",
            "all-to-all GB/s per rank": (r["a2a_GBps_per_rank"]["median"]
                                         if r.get("a2a_GBps_per_rank") else None),
            "x ring": _ratio_cell(r.get("ulysses_vs_ring"))})
    lines += _table(rows) + [""]
    errors = [f"{ks([r['n_per_gpu']])} {r['H']}:{r['Hkv']}: {e}" for r in d["rows"]
              for e in (r.get("errors") or [])]
    if errors:
        lines.append("Errors: " + "; ".join(map(str, errors)) + ".")
    return lines + [""]


# How docs/results.md renders a recording, by what it holds (never by its name alone): the
# first predicate that accepts the data picks the renderer; the generic one takes the rest.
RENDERERS: list[tuple[Callable[[object], bool], Callable[[dict], list[str]]]] = [
    (_is_fp8, _render_fp8),
    (_is_attention_headline, _render_headline),
    (_is_decode, _render_decode),
    (_is_profile, _render_profile),
    (_is_ring, _render_ring),
    (_is_ulysses, _render_ulysses),
]


def render_recording(data) -> list[str]:
    """One recording's data as markdown lines, by the first renderer that accepts it."""
    for accepts, render in RENDERERS:
        if accepts(data):
            return render(data)
    return _render_data(data)


def _chapter_of(name: str) -> str:
    m = re.match(r"(\d\d)", name)
    return m.group(1) if m else "other"


def _fairly(rec: Recordings) -> list[str]:
    name = "07_forward_benchmark"
    peak = rec.data(name)["fp32_fma_peak_tflops"]
    return [
        "How the figures compare, fairly: every ratio names the device and the backend it was "
        "measured against, in the same run. SDPA on float32 inputs runs its memory-efficient "
        "backend, a CUTLASS kernel built for sm_80 that computes on tensor cores as 3xTF32 "
        "(Nsight Compute on the H100: three TF32 tensor-core products per multiply-add, almost "
        "no FFMA; `07_sdpa_fp32_instructions`), while the course's float32 kernels multiply with "
        "scalar FFMAs: so chapters 07 and 08 also give each kernel as a fraction of the FP32 FMA "
        f"peak ({peak:.1f} TFLOP/s on the {rec.device(name)}, "
        "`hardware.fp32_fma_peak_tflops()`). SDPA's flash backend is FlashAttention-2 written "
        "for Ampere (`mma.sync`, no `wgmma`), while Triton issues `wgmma` on the H100: chapter "
        "09 shows cuDNN beside it as the Hopper bar, and chapters 10 and 14 compare with the "
        "backend that matches their instructions (flash for `mma.sync`, cuDNN for `wgmma`).",
        "",
    ]


def render_results(rec: Recordings | None = None, root: Path = ROOT) -> str:
    """``docs/results.md``: every recording of every chapter, headline first."""
    rec = rec or Recordings()
    heads = headlines(rec)
    out = [
        "# Measured results",
        "",
        "Generated from `course_utils/recorded/*.json` by `python -m course_utils results`; do "
        "not edit by hand (`python -m course_utils results --check`, run by "
        "`tests/test_results.py`, fails when this file differs from the recordings).",
        "",
        "Every figure was measured on the device named with it, on the date and with the "
        "library versions of its recording. A headline ratio names its baseline; where the "
        "recording holds interleaved rounds it is their median with the lowest and highest "
        "round, and where it holds one timing per shape it says \"one run\". In the tables "
        "below, TFLOP/s counts attention as the FlashAttention papers do "
        "(`course_utils.toolbox.bench.attention_flops`), times are medians of many calls, and a "
        "dash is a value not measured.",
        "",
    ]
    out += _fairly(rec)
    by_chapter: dict[str, list[str]] = {}
    for name in rec.names():
        by_chapter.setdefault(_chapter_of(name), []).append(name)
    for n, build, _ in CHAPTERS:
        out += [f"## {n} `{notebook(n, root)}`", "", f"What you build: {build}.", ""]
        if heads[n]:
            out += [f"**Headline**: {heads[n].cell()}.", "", f"Baseline: {heads[n].baseline}.",
                    ""]
        for name in by_chapter.get(n, []):
            env = rec.payload(name)["environment"]
            versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "cuda", "triton",
                                                           "numba_cuda") if env.get(k))
            out += [f"### `{name}`", "", f"{env['device']}, {env['date']}; {versions}.", ""]
            data = rec.data(name)
            out += render_recording(data)
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n"
