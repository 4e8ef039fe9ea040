"""The README's chapter table and docs/results.md are generated from the recordings.

No number in them is typed: `python -m course_utils results` writes both from
`course_utils/recorded/*.json`, and these tests fail when a committed file and the recordings
disagree, when the README outgrows the front door, or when a headline lacks its device or
baseline. Chapters 10 and 14 take their headline from `NN_headline.json` (interleaved rounds,
`course_utils.headlines`) and fall back to the lecture's recording, saying so, until it exists.
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
    assert "pytest -n 2 --dist loadfile" in text  # .ci/run runs the README's test command
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
    assert h.source == f"{chapter}_headline" and "until" not in h.text
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
