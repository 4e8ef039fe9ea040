"""The README's chapter table and docs/results.md are generated from the recordings.

No number in them is typed: `python -m course_utils results` writes both from
`course_utils/recorded/*.json`, and these tests fail when a committed file and the recordings
disagree, when the README outgrows the front door, or when a headline lacks its device or
baseline. Chapters 10 and 14 take their headline from `NN_headline.json` (interleaved rounds,
`course_utils.library.headlines`) and fall back to the lecture's recording, saying so, until it
exists. Issue 43's recordings (11_decode_headline, 12_profile, 13_ring_benchmark, 13_ulysses) each
have a renderer chosen by content, exercised on the real recording and on a minimal synthetic one.
"""

import json
import re
import shutil
from pathlib import Path

import pytest

from course_utils import results
from course_utils.__main__ import main as cli
from course_utils.recorded import FOLDER

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


@pytest.fixture
def recordings(tmp_path):
    """A copy of the recorded folder that a test may change."""
    folder = tmp_path / "recorded"
    shutil.copytree(FOLDER, folder)
    return folder


def _edit(folder: Path, name: str, change) -> None:
    path = folder / f"{name}.json"
    payload = json.loads(path.read_text(encoding="utf-8"))
    change(payload["data"])
    path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")


def test_committed_files_agree_with_the_recordings(capsys):
    assert results.check() == "", "run `python -m course_utils results` and commit the files"
    assert cli(["results", "--check"]) == 0
    assert "agree with the recordings" in capsys.readouterr().out


def test_a_changed_recording_fails_the_check(recordings):
    def shape(data):  # chapter 07's headline shape: the CUDA C++ forward at d 128, N 4096
        row = next(r for r in data["rows"] if (r["d"], r["N"], r["causal"]) == (128, 4096, False))
        return row["tflops"]

    t = shape(json.loads((recordings / "07_forward_benchmark.json").read_text())["data"])
    before, after = t["cuda"] / t["sdpa fp32"], 0.5 * t["cuda"] / t["sdpa fp32"]
    _edit(recordings, "07_forward_benchmark",
          lambda d: shape(d).__setitem__("cuda", 0.5 * t["cuda"]))
    diff = results.check(folder=recordings)
    assert "README.md (committed)" in diff and "docs/results.md (committed)" in diff
    assert re.search(rf"^-.*\| 07 \|.*{before:.2f}x SDPA fp32", diff, re.M)
    assert re.search(rf"^\+.*\| 07 \|.*{after:.2f}x SDPA fp32", diff, re.M)


def test_a_changed_table_number_fails_the_check(recordings):
    """Not only headlines: every figure of docs/results.md comes from a recording."""
    _edit(recordings, "05_transpose_bandwidth",
          lambda d: d["gbps"]["naive transpose"].__setitem__(0, 1.0))
    diff = results.check(folder=recordings)
    assert "docs/results.md (committed)" in diff and "README.md (committed)" not in diff


def test_check_command_exits_1_with_a_diff(recordings, monkeypatch, capsys):
    _edit(recordings, "04_ladder", lambda d: d["tflops"]["pipeline"].__setitem__(-1, 20.0))
    monkeypatch.setattr(results, "FOLDER", recordings)
    assert cli(["results", "--check"]) == 1
    out = capsys.readouterr().out
    assert "--- README.md (committed)" in out and "run `python -m course_utils results`" in out


def test_readme_is_a_front_door():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) <= 12 * 1024, "README.md over 12 KB: move text to docs/"
    assert "pytest -n 3 --dist loadfile" in text  # .ci/run runs the README's test command
    assert 'pip install -e ".[dev]"' in text and "jupyter lab" in text
    assert "download.pytorch.org/whl/cpu" in text
    assert "docs/instructors.md" in text and "python -m course_utils grade" in text
    for doc in re.findall(r"\]\((docs/[\w.]+)", text):
        assert (ROOT / doc).exists(), doc


def test_one_line_per_chapter():
    table = README.read_text(encoding="utf-8").split(results.BEGIN)[1].split(results.END)[0]
    rows = [line for line in table.splitlines() if re.match(r"\| \d\d \|", line)]
    assert [r[2:4] for r in rows] == [n for n, _, _ in results.CHAPTERS]
    assert len(rows) == len(list((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")))


def test_every_headline_names_its_device_and_baseline():
    heads = results.headlines()
    assert sum(h is not None for h in heads.values()) >= 10
    for n, h in heads.items():
        if h is None:
            continue
        cell = h.cell()
        assert h.device and h.device in cell, n
        assert h.baseline and h.baseline in h.text, n
        assert re.search(r"one run|rounds|seeds", h.runs), n
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", h.date), n


def test_no_headline_is_the_best_of_several_kernels():
    """Chapter 14's fallback states one rung on every shape, not the fastest per shape."""
    h = results.headlines()["14"]
    assert "ping-pong with intra-warpgroup overlap" in h.text or "default variant" in h.text


HEADLINE_ROW = {"B": 8, "H": 16, "variant": None, "tflops": {"course": 500.0}}


def _ratio(med):
    return {"median": med, "lo": med - 0.03, "hi": med + 0.02, "rounds": 5}


def _headline(chapter, device="NVIDIA H100 80GB HBM3"):
    rows = []
    for D in (64, 128):
        for causal in (False, True):
            for N in (1024, 4096, 16384):
                for mode in ("fwd", "fwd+bwd"):
                    med = 0.9 + 0.001 * D + N / 1e6 + (0.05 if mode == "fwd+bwd" else 0)
                    rows.append({**HEADLINE_ROW, "D": D, "causal": causal, "N": N, "mode": mode,
                                 "variant": 6 if chapter == 14 else None,
                                 "ratio": {"sdpa flash": _ratio(med),
                                           "sdpa cudnn": _ratio(med - 0.2)}})
    return {"name": f"{chapter}_headline",
            "environment": {"date": "2026-11-28", "device": device, "torch": "2.11.0",
                            "cuda": "13.0", "triton": "3.6.0", "numba_cuda": "0.30.4"},
            "data": {"chapter": chapter, "kernel": f"chapter {chapter}", "device": device,
                     "rounds": 5, "dtype": "bfloat16", "rows": rows}}


@pytest.mark.parametrize("chapter, baseline", [(10, "SDPA flash"), (14, "cuDNN")])
def test_headline_recordings_replace_the_fallback(recordings, chapter, baseline):
    (recordings / f"{chapter}_headline.json").unlink(missing_ok=True)
    before = results.headlines(results.Recordings(recordings))[str(chapter)]
    assert "until" in before.text and f"{chapter}_headline" in before.text
    assert before.runs in ("one run per shape", "medians of 3 rounds per shape")

    path = recordings / f"{chapter}_headline.json"
    path.write_text(json.dumps(_headline(chapter)), encoding="utf-8")
    h = results.headlines(results.Recordings(recordings))[str(chapter)]
    assert h.source.split("`")[0] == f"{chapter}_headline" and "until" not in h.text
    if chapter == 14:  # the forward at d = 96, 192 and 256 joins the row, with its own recording
        assert h.source == "14_headline`, `14_head_dims`, `14_fp8" and "forward only" in h.text
        assert all(f"d = {D} " in h.text for D in (96, 192, 256))
        assert "FP8" in h.text and "Hadamard rotation" in h.text
        (recordings / "14_head_dims.json").unlink()
        (recordings / "14_fp8.json").unlink()
        alone = results.headlines(results.Recordings(recordings))["14"]
        assert alone.source == "14_headline" and "forward only" not in alone.text
        assert "FP8" not in alone.text
    assert h.runs == "5 interleaved rounds" and h.device == "H100 80GB HBM3"
    assert baseline in h.baseline and h.date == "2026-11-28"
    # forward rows only: medians per d, and the single rounds' spread over every forward shape
    shift = -0.2 if chapter == 14 else 0
    lo64, hi64 = 0.9 + 0.064 + 0.001024 + shift, 0.9 + 0.064 + 0.016384 + shift
    assert f"d = 64 {lo64:.2f}-{hi64:.2f}x" in h.text
    assert f"single rounds {lo64 - 0.03:.2f}-" in h.text
    assert f"forward + backward {lo64 + 0.05:.2f}-" in h.text
    table = results.chapter_table(results.Recordings(recordings))
    assert f"`{chapter}_headline`" in table and "5 interleaved rounds" in table
    assert "| fwd+bwd |" in results.render_results(results.Recordings(recordings))


# ---------------------------------------------------------------- issue 43's recordings

def _payload(name, data, device="NVIDIA H100 80GB HBM3"):
    return {"name": name,
            "environment": {"date": "2026-11-28", "device": device, "torch": "2.11.0"},
            "data": data}


def _write(folder: Path, name: str, data, device="NVIDIA H100 80GB HBM3") -> None:
    (folder / f"{name}.json").write_text(json.dumps(_payload(name, data, device)),
                                         encoding="utf-8")


def _summary(med, lo, hi, rounds=5):
    return {"median": med, "lo": lo, "hi": hi, "rounds": rounds}


def _decode_row(label, *, B=1, N=32768, Lq=1, lens=None, us=100.0, sdpa=None, plan=None):
    row = {"label": label, "B": B, "lens": lens, "N": N, "Hq": 32, "Hkv": 8, "d": 128,
           "Lq": Lq, "paged": False, "bytes": 301_500_000, "us": {"ours": [us] * 5},
           "errors": {}, "median_us": {"ours": us}, "num_splits": 4}
    if sdpa:
        row["us"]["sdpa cudnn"] = [sdpa] * 5
        row["median_us"]["sdpa cudnn"] = sdpa
        row["sdpa_best"] = "sdpa cudnn"
        row["vs_sdpa_best"] = _summary(sdpa / us, sdpa / us - 0.01, sdpa / us + 0.01)
    if plan:
        row["us"]["one split count"] = [2 * us] * 5
        row["median_us"]["one split count"] = 2 * us
        row["plan_splits"] = plan
        row["vs_one_split_count"] = _summary(2.0, 1.9, 2.1)
    return row


def _decode(device="NVIDIA H100 80GB HBM3"):
    """A minimal 11_decode_headline: 301.5 MB in 100 us is 90 % of an H100's 3.35 TB/s."""
    return {"device": device, "dtype": "torch.bfloat16", "Hq": 32, "d": 128, "rounds": 5,
            "copy_tbps": 1.0, "sweep": [], "correctness_failures": [],
            "rows": [_decode_row("skewed", B=4, N=131072, lens=[131072, 1024, 1024, 1024],
                                 plan=[13, 1, 1, 1]),
                     _decode_row("decode B=1", sdpa=95.0),
                     _decode_row("decode Lq=2", Lq=2, us=110.0, sdpa=300.0)]}


def test_decode_headline_is_a_fraction_of_the_nominal_hbm(recordings):
    _write(recordings, "11_decode_headline", _decode())
    h = results.headlines(results.Recordings(recordings))["11"]
    assert "B = 1, 32k keys: 90% (90%) of the H100 80GB HBM3's nominal 3.35 TB/s HBM" in h.text
    assert "0.95x (0.94-0.96x) cuDNN" in h.text
    assert "split plan 2.00x (1.90-2.10x) one split count on a skewed batch (128k, 1k, 1k, 1k)"\
        in h.text
    assert "2 new tokens per sequence in 1.10x the time of one" in h.text
    assert "copy" not in h.text  # a copy counts read + write: no ceiling for a read-only kernel
    assert h.runs == "median of 5 interleaved rounds (lo-hi)" and h.device == "H100 80GB HBM3"
    assert results.nominal_hbm_tbps("NVIDIA H200") == 4.8


def test_decode_headline_from_the_real_recording():
    rec = results.Recordings()
    d = rec.data("11_decode_headline")
    h = results.headlines(rec)["11"]
    one = next(r for r in d["rows"] if (r["B"], r["N"], r["Lq"], r["paged"], r["lens"])
               == (1, 131072, 1, False, None) and r["Hkv"] == 8)
    nominal = results.nominal_hbm_tbps(d["device"])
    frac = one["bytes"] / (one["median_us"]["ours"] * 1e-6) / (nominal * 1e12)
    assert f"{frac:.0%} (" in h.text and f"nominal {nominal} TB/s HBM" in h.text
    assert f"{one['vs_sdpa_best']['median']:.2f}x" in h.text and "copy" not in h.text
    assert f"median of {d['rounds']} interleaved rounds" in h.runs


def test_decode_table(recordings):
    lines = results.render_recording(_decode())
    text = "\n".join(lines)
    assert "| % of HBM |" in text and "| 90% |" in text and "plan 13/1/1/1" in text
    assert "2.00x (1.90-2.10)" in text and "copy's figure" in text
    real = "\n".join(results.render_recording(results.Recordings().data("11_decode_headline")))
    assert "| % of HBM |" in real and "x one split count" in real
    # the name ends in _headline but the content decides: the whole file renders
    _write(recordings, "11_decode_headline", _decode())
    assert "| % of HBM |" in results.render_results(results.Recordings(recordings))


def _profile_row(attention, mode, step):
    return {"attention": attention, "mode": mode, "step_ms": step,
            "step_ms_rounds": [step] * 5, "device_ms": step / 2, "idle_ms": step / 2,
            "host_ops_ms": 1.0, "launches": 10.0, "graph_launches": 0.0, "rounds": 5,
            "batch": 64, "block": 256}


def _profile():
    return {"profile": {"note": "ms per training step", "cudagraph_skips": {},
                        "rows": {"course, eager": _profile_row("course", "eager", 20.0),
                                 "sdpa, eager": _profile_row("sdpa", "eager", 10.0)}},
            "kv_cache": {"compiled_exact": True, "code_inplace_call": True,
                         "code_auto_functionalized": False, "code_clone_or_copy": 0,
                         "timing": {"ms": {"course::kv_cache_write": [0.2] * 5}, "T": 8}}}


def test_profile_headline_and_table(recordings):
    _write(recordings, "12_profile", _profile(), device="NVIDIA H200")
    old_training = {f"{a}, seed {s}": {"attention": a, "seed": s, "tokens_per_s": 1000.0 + s}
                    for a in ("course", "sdpa") for s in (0, 1, 2)}  # before the validation split
    _write(recordings, "12_training", old_training)
    h = results.headlines(results.Recordings(recordings))["12"]
    assert "eager 20.0 ms (GPU busy 50%; 0.50x SDPA's step)" in h.text
    assert "compiles in place" in h.text and h.source == "12_profile" and h.device == "H200"
    assert "12_training" in h.text and "predates the validation split" in h.text  # old format
    text = "\n".join(results.render_recording(_profile()))
    assert "| course, eager | eager | course | 20.0 (20.0) |" in text.replace("(20.0-20.0)",
                                                                             "(20.0)")
    assert "**KV-cache write**" in text and "course::kv_cache_write 0.2" in text
    (recordings / "12_profile.json").unlink()
    old = results.headlines(results.Recordings(recordings))["12"]
    assert "before the validation split" in old.text and old.source == "12_training"


def test_profile_headline_from_the_real_recording():
    rec = results.Recordings()
    h = results.headlines(rec)["12"]
    rows = results._profile_part(rec.data("12_profile"))["rows"]
    ro = rows["course, reduce-overhead"]
    assert f"{ro['step_ms']:.1f} ms ({ro['device_ms'] / ro['step_ms']:.0%}" in h.text
    assert "host-bound" not in h.text  # measured now, not inferred
    text = "\n".join(results.render_recording(rec.data("12_profile")))
    assert "| GPU busy |" in text and "reduce_overhead_argument" in text


def _ring_row(n, H, Hkv):
    ms = {"cudnn 1 GPU": 100.0, "block kernel 1 GPU": 110.0, "ring zigzag": 60.0,
          "all-gather zigzag": 64.0, "torch context_parallel": 62.0, "link one way": 0.5}
    return {"n_per_gpu": n, "N": 2 * n, "H": H, "Hkv": Hkv, "kv_block_bytes": 150_000_000,
            "block_kernel": "chapter 14's TMA + wgmma (sm_90a)", "errors": {},
            "notes": {"cudnn kernels": ["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_"
                                        "wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1"]},
            "ms": {k: [v] * 5 for k, v in ms.items()},
            "summary": {"ms": {k: _summary(v, v - 1, v + 1) for k, v in ms.items()},
                        "pct_ideal": {"ring zigzag": _summary(0.833, 0.8, 0.85),
                                      "all-gather zigzag": _summary(0.78, 0.75, 0.8),
                                      "torch context_parallel": _summary(0.8, 0.78, 0.82)},
                        "pct_ideal_block": {"ring zigzag": _summary(0.92, 0.9, 0.93)},
                        "vs_cudnn": {"block kernel 1 GPU": _summary(0.91, 0.9, 0.92)}}}


def _ring():
    return {"rows": [_ring_row(16384, 16, 16), _ring_row(16384, 32, 8)], "B": 1, "d": 128,
            "rounds": 5, "R": 2, "device": "NVIDIA H200"}


def _ulysses():
    row = {"n_per_gpu": 16384, "N": 32768, "B": 1, "H": 32, "Hkv": 8, "d": 128, "R": 2,
           "plan": {"H_r": 16, "Hkv_r": 4, "t": 1}, "a2a_bytes_per_rank": {"total": 1.0},
           "errors": [], "s": {"single GPU": [0.1] * 5, "ulysses": [0.055] * 5},
           "pct_of_ideal": _summary(0.91, 0.9, 0.92), "a2a_share": _summary(0.05, 0.04, 0.06),
           "a2a_GBps_per_rank": _summary(120.0, 110.0, 125.0),
           "ulysses_vs_ring": _summary(1.03, 1.0, 1.05)}
    return {"R": 2, "backend": "nccl", "nccl": "2.28.9", "kernel": "k", "rounds": 5,
            "dtype": "bfloat16", "what": "seconds",
            "checks": [{"case": {"B": 1, "H": 8, "Hkv": 2}, "rel_err": {"O": 0.003},
                        "tol": 0.02, "ok": True}], "rows": [row]}


def test_ring_headline_and_table(recordings):
    _write(recordings, "13_ring_benchmark", _ring(), device="NVIDIA H200")
    _write(recordings, "13_ulysses", _ulysses(), device="NVIDIA H200")
    h = results.headlines(results.Recordings(recordings))["13"]
    assert "32:8 83%, 16:16 83% of ideal scaling against cuDNN on one GPU" in h.text
    assert "block kernel alone 0.91x cuDNN" in h.text
    assert "all-gather 64.0 ms (63.0-65.0) beside `context_parallel` 62.0 ms (61.0-63.0)" \
        in h.text
    assert "Ulysses (NCCL, 1/1 checks) at 91% of ideal" in h.text and "4%" not in h.text
    assert h.device == "2 x H200" and h.runs == "median of 5 interleaved rounds (lo-hi)"
    text = "\n".join(results.render_recording(_ring()))
    header = next(line for line in text.splitlines() if line.startswith("| tokens/GPU"))
    assert header.count("|") - 1 <= 12  # a compact table, not the flattened 70 columns
    assert "| 16k | 32:8 | 100 (99.0-101) | 110 (109-111) | 60.0 (59.0-61.0) |" in text
    assert "| 83% / 78% / 80% | 92% | 300 |" in text  # 150 MB / 0.5 ms = 300 GB/s
    assert "`cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16`" in text
    assert "knob" not in text
    (recordings / "13_ulysses.json").unlink()
    assert "Ulysses" not in results.headlines(results.Recordings(recordings))["13"].text


def test_ring_and_ulysses_from_the_real_recordings():
    rec = results.Recordings()
    h = results.headlines(rec)["13"]
    rows = rec.data("13_ring_benchmark")["rows"]
    for r in rows:
        assert f"{r['summary']['pct_ideal']['ring zigzag']['median']:.0%}" in h.text
    gqa = max((r for r in rows if r["H"] != r["Hkv"]), key=lambda r: r["n_per_gpu"])
    ag = gqa["summary"]["ms"]["all-gather zigzag"]["median"]
    cp = gqa["summary"]["ms"]["torch context_parallel"]["median"]
    assert f"all-gather {ag:.1f} ms" in h.text and f"`context_parallel` {cp:.1f} ms" in h.text
    assert "% of copy" not in h.text and "Ulysses" in h.text
    text = "\n".join(results.render_recording(rec.data("13_ring_benchmark")))
    header = next(line for line in text.splitlines() if line.startswith("| tokens/GPU"))
    assert header.count("|") - 1 <= 12 and "knob" not in text
    uly = "\n".join(results.render_recording(rec.data("13_ulysses")))
    assert "**Checks**" in uly and "| heads per rank |" in uly


def test_renderers_are_chosen_by_content_not_name():
    picked = {}
    rec = results.Recordings()
    for name in rec.names():
        data = rec.data(name)
        picked[name] = next((render.__name__ for accepts, render in results.RENDERERS
                             if accepts(data)), "_render_data")
    assert picked["10_headline"] == picked["14_headline"] == "_render_headline"
    assert picked["11_decode_headline"] == "_render_decode"
    assert picked["12_profile"] == "_render_profile"
    assert picked["13_ring_benchmark"] == "_render_ring"
    assert picked["13_ulysses"] == "_render_ulysses"
    assert picked["12_training"] == "_render_data"
    assert results.render_recording({"rows": 3}) == ["- rows: 3", ""]


def test_training_after_the_validation_split_keeps_the_profile(recordings):
    """A 12_training of tinygpt's current format (validation loss, floor, comparisons)."""
    def run(attention, seed, final):
        return {"attention": attention, "seed": seed, "tokens_per_s": 1e6, "val": [final],
                "floor": 1.0, "final_val": final, "steps": 400, "compare_every": 100,
                "compare": [{"course": {"grad": 2e-3}, "sdpa": {"grad": 1e-3}}]}
    runs = {f"{a}, seed {s}": run(a, s, 1.1 + 0.01 * s + (0.005 if a == "course" else 0))
            for s in (0, 1, 2) for a in ("course", "sdpa")}
    _write(recordings, "12_training", runs)
    _write(recordings, "12_profile", _profile(), device="NVIDIA H200")
    h = results.headlines(results.Recordings(recordings))["12"]
    assert "final validation loss 0.105-0.125 nats above the data's exact floor" in h.text
    assert "2e-03 against SDPA's 1e-03" in h.text and "GPU busy 50%" in h.text
    assert h.source == "12_training, 12_profile" and "predates" not in h.text


def test_ring_summary_is_derived_from_the_rounds():
    from course_utils.library.ring_benchmark import summarize_row

    row = _ring_row(16384, 32, 8)
    row["ms"]["ring zigzag"] = [60.0, 50.0, 70.0, 60.0, 62.5]
    s = summarize_row(row)
    ideal = s["pct_ideal"]["ring zigzag"]  # cuDNN ms / (R x ring ms), round by round
    assert (ideal["median"], ideal["lo"], ideal["hi"]) == (100 / 120, 100 / 140, 100 / 100)
    assert s["pct_ideal_block"]["ring zigzag"]["median"] == 110 / 120
    assert s["vs_cudnn"]["block kernel 1 GPU"]["median"] == 100 / 110
    assert s["allgather_over_cp"]["median"] == 64 / 62
    assert s["link one way GB/s"]["median"] == 300.0 and "link ring hop GB/s" not in s
    for real in results.Recordings().data("13_ring_benchmark")["rows"]:
        assert summarize_row(real) == real["summary"]  # the shipped summary, from its rounds
