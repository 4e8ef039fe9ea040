"""The headlines of chapters 11-14: decode, a training step, ring attention, Hopper.

Issue 43's recordings (``11_decode_headline``, ``12_profile``, ``12_training``,
``13_ring_benchmark``, ``13_ulysses``, ``14_headline``) hold interleaved rounds and several
baselines each, so their headlines are longer than chapters 00-10's
(:mod:`.headlines_kernels`), and each falls back to the lecture's older recording, saying so,
until the new one exists.
"""

from __future__ import annotations

import dataclasses
import statistics

from .common import (
    SDPA_NAMES,
    Headline,
    Recordings,
    _from_headline_file,
    _per_head_dim,
    _profile_part,
    _rounds_text,
    _tbps,
    ks,
    nominal_hbm_tbps,
    pct,
    short_device,
    sizes,
    span,
    x,
)


def _decode_plain(d: dict) -> list[dict]:
    """Single-token decode rows, dense, equal lengths, >= 32k keys, one per (B, N, Hkv)."""
    seen, out = set(), []
    for r in d["rows"]:
        key = (r["B"], r["N"], r["Hkv"])
        if (r.get("Lq", 1) == 1 and not r.get("lens") and not r.get("paged")
                and r["N"] >= 32768 and "ours" in r.get("median_us", {}) and key not in seen):
            seen.add(key)
            out.append(r)
    return out

def _h11_headline(rec: Recordings) -> Headline:
    """Chapter 11 from ``11_decode_headline`` (issue 43: CUDA-graph timings, interleaved rounds
    against SDPA's backends, per-sequence plans against one split count)."""
    name = "11_decode_headline"
    d = rec.data(name)
    device = short_device(d.get("device") or rec.payload(name)["environment"]["device"])
    nominal = nominal_hbm_tbps(device)
    plain = _decode_plain(d)
    parts = []
    if plain:
        n, hkv = max(r["N"] for r in plain), max(r["Hkv"] for r in plain)
        one = next((r for r in plain if (r["B"], r["N"], r["Hkv"]) == (1, n, hkv)), None)
        head = f"split-KV decode (GQA {d['Hq']}:{hkv}, bf16, d = {d['d']})"
        if one and nominal:
            us = one["us"]["ours"]
            fr = [_tbps(one["bytes"], u) / nominal for u in us]
            best = SDPA_NAMES.get(one.get("sdpa_best"), one.get("sdpa_best"))
            head += (f" at B = 1, {n // 1024}k keys: {pct(statistics.median(fr))} "
                     f"({span(fr, pct)}) of the {device}'s nominal {nominal} TB/s HBM")
            if "vs_sdpa_best" in one:
                head += f", {_rounds_text(one['vs_sdpa_best'])} {best}"
        parts.append(head)
        heads = "/".join(f"{d['Hq']}:{h}" for h in sorted({r["Hkv"] for r in plain},
                                                          reverse=True))
        parts.append(f"{len(plain)} shapes of {ks(r['N'] for r in plain)} keys "
                     f"(B {sizes(r['B'] for r in plain)}, GQA {heads})")
        with_sdpa = [r for r in plain if "vs_sdpa_best" in r]
        if nominal:
            every = [_tbps(r["bytes"], r["median_us"]["ours"]) / nominal for r in plain]
            parts[-1] += f": {span(every, pct)} of nominal"
            if with_sdpa:
                theirs = [_tbps(r["bytes"], r["median_us"][r["sdpa_best"]]) / nominal
                          for r in with_sdpa]
                parts[-1] += f" (SDPA's fastest backend {span(theirs, pct)})"
        if with_sdpa:
            parts[-1] += (f", {span([r['vs_sdpa_best']['median'] for r in with_sdpa])} SDPA's "
                          "fastest backend")
    skew = [r for r in d["rows"] if "vs_one_split_count" in r]
    if skew:
        lens = ", ".join(f"{v // 1024}k" for v in skew[0]["lens"])
        first, rest = skew[0], skew[1:]
        parts.append(f"a per-sequence split plan {_rounds_text(first['vs_one_split_count'])} one "
                     f"split count on a skewed batch ({lens}"
                     + "".join(f"; {'paged' if r.get('paged') else 'dense'} "
                               f"{x(r['vs_one_split_count']['median'])}" for r in rest) + ")")
    multi = []
    for r in d["rows"]:
        if r.get("Lq", 1) > 1 and "ours" in r.get("median_us", {}):
            base = [b for b in d["rows"] if b.get("Lq", 1) == 1 and not b.get("paged")
                    and not b.get("lens") and (b["B"], b["N"], b["Hkv"]) == (r["B"], r["N"],
                                                                            r["Hkv"])]
            if base:
                multi.append((r["Lq"], r["median_us"]["ours"] / base[-1]["median_us"]["ours"]))
    if multi:
        parts.append(f"{sizes(q for q, _ in multi)} new tokens per sequence in "
                     f"{span([t for _, t in multi])} the time of one")
    rounds = d.get("rounds")
    return Headline("; ".join(parts), "SDPA's fastest backend", device,
                    f"median of {rounds} interleaved rounds (lo-hi)" if rounds else "one run",
                    rec.date(name), name)


def _h11(rec: Recordings) -> Headline:
    if rec.has("11_decode_headline"):
        return _h11_headline(rec)
    name = "11_decode_benchmark"
    d = rec.data(name)
    n = max(r["N"] for r in d["rows"])
    rows = [r for r in d["rows"] if r["N"] == n]
    hbm = [r["bytes"] / (r["us"]["ours dense"] * 1e-6) / (d["hbm_tbps"] * 1e12) for r in rows]
    best = [min(v["us"] for v in r["sdpa"].values() if v["us"] is not None)
            / r["us"]["ours dense"] for r in rows]
    return Headline(
        f"split-KV decode (GQA {d['Hq'] // d['Hkv']}:1, bf16) at {n // 1024}k keys: "
        f"{span(hbm, pct)} of HBM bandwidth and {span(best)} SDPA's fastest backend, "
        f"batch {sizes(r['B'] for r in rows)}",
        "SDPA's fastest backend", rec.device(name), "one run per shape",
        rec.date(name), name)

def _profile_text(rec: Recordings) -> tuple[str, str] | None:
    """Chapter 12's measured step (``12_profile``): text and the recording's runs."""
    from ...toolbox.bench import ratio_summary

    name = "12_profile"
    rows = (_profile_part(rec.data(name)) or {"rows": {}})["rows"].values()
    course = {r["mode"]: r for r in rows if r.get("attention") == "course"}
    sdpa = {r["mode"]: r for r in rows if r.get("attention") == "sdpa"}
    if not course:
        return None
    first = next(iter(course.values()))
    parts = []
    for mode, r in course.items():
        busy = pct(r["device_ms"] / r["step_ms"])
        inner = [f"GPU busy {busy}" if not parts else busy]
        if mode in sdpa and r.get("step_ms_rounds") and sdpa[mode].get("step_ms_rounds"):
            s = ratio_summary({"course": r["step_ms_rounds"],
                               "sdpa": sdpa[mode]["step_ms_rounds"]}, "course", "sdpa")
            inner.append(f"{x(s['median'])} SDPA's step" if not parts else x(s["median"]))
            if mode == "reduce-overhead":
                inner.append(f"rounds {span([s['lo'], s['hi']])}")
        parts.append(f"{_MODES.get(mode, mode)} {r['step_ms']:.1f} ms ({'; '.join(inner)})")
    text = (f"a tiny GPT's training step ({first['batch']} x {first['block']} tokens, bf16), "
            f"the course's op, host and device measured (torch.profiler): {', '.join(parts)}")
    kv = rec.data(name).get("kv_cache", {})
    if kv.get("compiled_exact") and kv.get("code_inplace_call") is not None:
        inplace = (kv["code_inplace_call"] and not kv.get("code_auto_functionalized")
                   and not kv.get("code_clone_or_copy"))
        text += ("; the KV-cache write (`mutates_args`) compiles "
                 + ("in place" if inplace else "with a functional copy"))
    rounds = first.get("rounds")
    return text, (f"median of {rounds} interleaved rounds (lo-hi)" if rounds else "one run")


_MODES = {"eager": "eager", "default": "compiled", "reduce-overhead":
          "reduce-overhead (CUDA graphs)"}

def _h12(rec: Recordings) -> Headline:
    name = "12_training"
    profile = _profile_text(rec) if rec.has("12_profile") else None
    if profile and (not rec.has(name) or "val" not in next(iter(rec.data(name).values()))):
        text, runs = profile
        if rec.has(name):
            old = _h12_before_issue43(rec)
            text += (f"; `{name}` ({old.device}, {old.runs}, {old.date}) predates the "
                     f"validation split (one fixed text, memorised): {old.text}")
        return Headline(text, "SDPA's step", rec.device("12_profile"), runs,
                        rec.date("12_profile"), "12_profile")
    runs = rec.data(name)
    seeds = sorted({r["seed"] for r in runs.values()})
    ratio = [runs[f"course, seed {s}"]["tokens_per_s"] / runs[f"sdpa, seed {s}"]["tokens_per_s"]
             for s in seeds]
    if "val" not in runs[f"course, seed {seeds[0]}"]:
        return _h12_before_issue43(rec)
    first = runs[f"course, seed {seeds[0]}"]
    floor = first["floor"]
    final = {a: [runs[f"{a}, seed {s}"]["final_val"] for s in seeds] for a in ("course", "sdpa")}
    above = [v - floor for v in final["course"]]
    se = (statistics.variance(final["course"]) / len(seeds)
          + statistics.variance(final["sdpa"]) / len(seeds)) ** 0.5
    gap = (statistics.mean(final["course"]) - statistics.mean(final["sdpa"])) / se

    def worst(attention, precision):  # the largest gradient error against float64, all runs
        found = [(c.get(precision) if precision else c)[attention]["grad"]
                 for r in runs.values() for c in r["compare"] if not precision or precision in c]
        return max(found) if found else None

    errors = [f"{worst('course', None):.0e} against SDPA's {worst('sdpa', None):.0e} "
              f"({first.get('amp_dtype') or 'float32'})"]
    if worst("course", "float32") is not None:
        errors.append(f"{worst('course', 'float32'):.0e} against {worst('sdpa', 'float32'):.0e} "
                      "(float32)")
    text = (f"a tiny GPT ({first['steps']} steps of fresh sums, {len(seeds)} seeds) with the "
            f"course's op: final validation loss {span(above, lambda v: f'{v:.3f}')} nats above "
            f"the data's exact floor ({floor:.3f}; SDPA "
            f"{span([v - floor for v in final['sdpa']], lambda v: f'{v:.3f}')}), "
            f"{gap:+.1f} standard errors from SDPA (same seeds, same batches); "
            f"gradients against float64 every {first['compare_every']} steps "
            f"{', '.join(errors)}; {x(statistics.median(ratio))} SDPA's tokens/s")
    sources = name
    if profile:
        text += f"; {profile[0]} ({profile[1]}, `12_profile`)"
        sources = f"{name}, 12_profile"
    return Headline(text, "SDPA (same seeds, same batches)", rec.device(name),
                    f"{len(seeds)} seeds", rec.date(name), sources)


def _h12_before_issue43(rec: Recordings) -> Headline:
    """The row of a training recording made before the validation split (one fixed text)."""
    name = "12_training"
    runs = rec.data(name)
    seeds = sorted({r["seed"] for r in runs.values()})
    ratio = [runs[f"course, seed {s}"]["tokens_per_s"] / runs[f"sdpa, seed {s}"]["tokens_per_s"]
             for s in seeds]
    text = f"tokens/s {x(statistics.median(ratio))} SDPA's (seeds {span(ratio)})"
    if not rec.has("12_profile"):
        text = ("a tiny GPT trained with the course's op, recorded before the validation split "
                f"(one fixed text, memorised: its losses are no check): {text}")
    return Headline(text, "SDPA", rec.device(name),
        f"median of {len(seeds)} seeds", rec.date(name), name)


def _h13(rec: Recordings) -> Headline:
    name = "13_ring_benchmark"
    data = rec.data(name)
    rows = data["rows"]
    if "ms" not in rows[0]:  # recorded before issue 43: seconds, one run, chapter 09 as the bar
        ideal = [r["s"]["single GPU"] / (2 * r["s"]["ring zigzag"]) for r in rows]
        return Headline(
            f"zig-zag ring forward + backward at {'/'.join(pct(v)[:-1] for v in ideal)}% of "
            f"ideal scaling (half the time of one GPU on the whole sequence) at "
            f"{'/'.join(str(r['n_per_gpu'] // 1024) + 'k' for r in rows)} tokens per GPU "
            f"with bf16, causal, d = 128",
            "one GPU on the whole sequence", "2 x " + rec.device(name), "one run per length",
            rec.date(name), name)
    by_heads = {}
    for r in rows:
        if "ring zigzag" in r["summary"].get("pct_ideal", {}):
            by_heads.setdefault((r["H"], r["Hkv"]), []).append(r)
    ideal = []
    for (h, k), group in sorted(by_heads.items(), reverse=True):
        vals = [r["summary"]["pct_ideal"]["ring zigzag"] for r in group]
        ideal.append(f"{h}:{k} {'/'.join(pct(v['median']) for v in vals)}")
    every = [r["summary"]["pct_ideal"]["ring zigzag"] for g in by_heads.values() for r in g]
    blocks = [r["summary"]["vs_cudnn"]["block kernel 1 GPU"]["median"]
              for g in by_heads.values() for r in g
              if "block kernel 1 GPU" in r["summary"].get("vs_cudnn", {})]
    text = (f"zig-zag ring (chapter 14's blocks) forward + backward at {', '.join(ideal)} of "
            f"ideal scaling against cuDNN on one GPU at "
            f"{'/'.join(ks([n]) for n in sorted({r['n_per_gpu'] for r in rows}))} tokens per GPU "
            f"(rounds {span([v['lo'] for v in every] + [v['hi'] for v in every], pct)}; the "
            f"block kernel alone {span(blocks)} cuDNN)")
    gqa = [r for r in rows if r["H"] != r["Hkv"] and "all-gather zigzag" in r["summary"]["ms"]
           and "torch context_parallel" in r["summary"]["ms"]]
    if gqa:
        r = max(gqa, key=lambda r: r["n_per_gpu"])
        ag, cp = (r["summary"]["ms"][k] for k in ("all-gather zigzag", "torch context_parallel"))

        def ms(v):
            return f"{v['median']:.1f} ms ({v['lo']:.1f}-{v['hi']:.1f})"

        text += (f"; at GQA {r['H']}:{r['Hkv']}, {ks([r['n_per_gpu']])} tokens per GPU: "
                 f"all-gather {ms(ag)} beside `context_parallel` {ms(cp)}, ring "
                 f"{r['summary']['ms']['ring zigzag']['median']:.1f} ms")
    source = name
    if rec.has("13_ulysses"):
        u = rec.data("13_ulysses")
        ok = sum(c.get("ok", False) for c in u.get("checks", []))
        ur = [r for r in u.get("rows", []) if "pct_of_ideal" in r]
        if ur:
            text += (f"; Ulysses ({u['backend'].upper()}, {ok}/{len(u['checks'])} checks) at "
                     f"{span([r['pct_of_ideal']['median'] for r in ur], pct)} of ideal against "
                     f"the block kernel on one GPU, all-to-all "
                     f"{span([r['a2a_share']['median'] for r in ur], pct)} of its time")
            source = f"{name}`, `13_ulysses"
    return Headline(
        text + " (bf16, causal, d = 128)",
        "cuDNN on one GPU",
        f"{data.get('R', 2)} x " + rec.device(name),
        f"median of {data['rounds']} interleaved rounds (lo-hi)", rec.date(name), source)


def _h14(rec: Recordings) -> Headline:
    cudnn = "cuDNN (SDPA's Hopper `wgmma` backend)"
    if rec.has("14_headline"):
        h = _from_headline_file(rec, "14_headline", "TMA + `wgmma` forward (the default "
                                "variant)", "sdpa cudnn", cudnn)
        h = _with_head_dims(rec, h) if rec.has("14_head_dims") else h
        return _with_fp8(rec, h) if rec.has("14_fp8") else h
    name = "14_ladder"
    d = rec.data(name)
    rung = "cuda + ping-pong + overlap"
    per_d = _per_head_dim(d["rows"], lambda r: r["fwd"][rung] / r["fwd"]["sdpa cudnn"])
    return Headline(
        f"TMA + `wgmma` forward, ping-pong with intra-warpgroup overlap, against {cudnn}: "
        f"{per_d} (bf16, N {ks(r['N'] for r in d['rows'])}, causal and not); from "
        f"the lecture's ladder until `14_headline` is recorded",
        cudnn, rec.device(name), f"medians of {d['rounds']} rounds per shape", rec.date(name),
        name)


def _with_head_dims(rec: Recordings, h: Headline) -> Headline:
    """Chapter 14's row with the forward at d = 96, 192 and 256 (``14_head_dims``) added."""
    name = "14_head_dims"
    w = rec.data(name)
    per_d = _per_head_dim(w["rows"], lambda r: r["ratio"]["sdpa cudnn"]["median"]
                          if r["ratio"]["sdpa cudnn"] else None)
    best = max(r["tflops"]["course"] for r in w["rows"])
    return dataclasses.replace(
        h, text=f"{h.text}; the head dims run forward only: {per_d} cuDNN, up to "
                f"{best:.0f} TFLOP/s ({short_device(w['device'])}, {rec.date(name)})",
        source=f"{h.source}`, `{name}")


def _with_fp8(rec: Recordings, h: Headline) -> Headline:
    """Chapter 14's row with the FP8 forward as a user calls it (``14_fp8``) added: its speed
    against the course's bf16 forward, and what the Hadamard rotation does to the error with
    the largest outlier channels."""
    name = "14_fp8"
    f = rec.data(name)
    def per_d(run):  # "d = 128 a-b, d = 256 c-d": the head dims differ by far more than noise
        return _per_head_dim(f["rows"], lambda r: r["ratio"][f"{run} vs bf16"]["median"])

    acc = [row for rows in f["accuracy"]["rows"].values() for row in rows]
    top = max(row["outlier"] for row in acc)
    plain = [row["plain"] for row in acc if row["outlier"] == top]
    rotated = [row["rotated"] for row in acc if row["outlier"] == top]
    Ns = ks(r["N"] for r in f["rows"])
    # the recording's kernel ends in its implementation: "..., CUDA (wgmma)" -> "CUDA, wgmma"
    impl = f["kernel"].split(", ")[-1].replace(" (", ", ").rstrip(")")
    return dataclasses.replace(
        h, text=f"{h.text}; FP8 (e4m3, {impl}) as a user calls it, "
                f"quantization included, against the bf16 forward: {per_d('fp8')} (the kernel "
                f"alone {per_d('fp8 kernel')}; N {Ns}), error with {top:g}x outlier channels "
                f"{span(plain, pct)} of max |O|, {span(rotated, pct)} with a Hadamard rotation "
                f"({short_device(f['device'])}, {f['rounds']} rounds, {rec.date(name)})",
        source=f"{h.source}`, `{name}")
