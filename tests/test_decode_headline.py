"""Chapter 11's decode headline (``course_utils.library.decode_headline``): the measurement that
writes ``11_decode_headline`` runs at tiny shapes (Triton's interpreter in CPU mode), gives data of
the committed recording's schema, row by row, that the results page turns into a headline, and
names a wrong kernel in ``correctness_failures`` instead of timing it."""

import json

import pytest

from course_utils.library import decode_headline as dh
from course_utils.library.kernels import flash_decoding as fd
from course_utils.publishing.results_parts.common import Recordings
from course_utils.publishing.results_parts.headlines_systems import _h11_headline
from course_utils.recorded import FOLDER


def _committed():
    return json.loads((FOLDER / f"{dh.NAME}.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def small():
    return dh.measure(small=True, sweep=True, rounds=2, save=False)


def test_small_run_has_the_recordings_schema(small):
    old = _committed()["data"]
    assert set(old) <= set(small), set(old) - set(small)
    assert small["rounds"] == 2 and not small["correctness_failures"]
    def kinds(rows):  # a row's kind (skewed, SDPA-compared, paged) -> its keys
        return {(bool(r["lens"]), r["paged"], r["Lq"] > 1): frozenset(r) for r in rows}

    assert kinds(small["rows"]) == kinds(old["rows"])
    assert [r["label"].split()[0] for r in small["rows"]] == \
        [r["label"].split()[0] for r in old["rows"]][:2] + ["decode"] * (len(small["rows"]) - 2)
    for new in small["rows"]:
        assert "ours" in new["median_us"] and len(new["us"]["ours"]) == 2
    assert {k for e in small["sweep"] for k in e} == {k for e in old["sweep"] for k in e}
    assert len(small["chosen"]) == 5 and small["rule"] == old["rule"]
    for c in small["chosen"].values():
        assert set(c) == {"config", "programs_per_sm", "merge"}
    cudnn = [r["errors"].get("sdpa cudnn") for r in small["rows"] if "vs_sdpa_best" in r]
    assert cudnn and (small["device"] != "CPU" or all(cudnn))  # no cuDNN on a CPU: an error


def test_small_run_renders_a_headline(small, tmp_path):
    payload = {"name": dh.NAME, "environment": {"date": "2026-12-01", "device": small["device"]},
               "data": small}
    (tmp_path / f"{dh.NAME}.json").write_text(json.dumps(payload), encoding="utf-8")
    h = _h11_headline(Recordings(tmp_path))
    assert "skewed batch" in h.text and "new tokens per sequence" in h.text
    assert h.runs == "median of 2 interleaved rounds (lo-hi)" and h.source == dh.NAME


def test_a_wrong_kernel_is_reported_and_not_timed(monkeypatch):
    def wrong(q, *args, **kwargs):
        return q * 0 + 1, None

    monkeypatch.setattr(fd, "decode_attention", wrong)
    d = dh.measure(small=True, sweep=True, rounds=1, save=False)
    assert d["correctness_failures"] and not d["sweep"] and not d["chosen"]
    assert any("ours: max error" in f for f in d["correctness_failures"])
    for r in d["rows"]:
        assert "ours" not in r["us"] and "ours" not in r["median_us"]
