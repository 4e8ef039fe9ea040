"""Headlines: the chapter-14 variant is fixed before timing, and a recording prints as medians
with their spread (the measurement itself runs on a GPU: `python -m
course_utils.library.headlines`)."""

import pytest

from course_utils import headlines


def _row(D, causal, N, mode, med, lo, hi):
    ratio = {"median": med, "lo": lo, "hi": hi, "rounds": 5}
    return {"D": D, "causal": causal, "N": N, "B": 1, "H": 1, "mode": mode, "variant": None,
            "tflops": {"course": 500.0, "sdpa flash": 450.0, "sdpa cudnn": 520.0},
            "ratio": {"sdpa flash": ratio, "sdpa cudnn": dict(ratio, median=med - 0.1)},
            "max_abs_vs_float64": 3e-3, "max_abs_vs_flash": 2e-3}


DATA = {"chapter": 14, "kernel": "k", "device": "GPU", "rounds": 5, "dtype": "bfloat16",
        "tokens": 32768, "hidden": 2048, "peak_tflops": 989,
        "rows": [_row(128, False, N, m, 1.0 + N / 1e5, 0.9, 1.2)
                 for N in (1024, 4096) for m in ("fwd", "fwd+bwd")]}


def test_the_default_variant_is_a_rule_of_the_shape():
    assert headlines.default_variant(128, False, 16384) == 6
    assert headlines.default_variant(64, True, 2048) == 7
    assert headlines.default_variant(64, True, 4096) == 6
    assert headlines.default_variant(128, True, 4096) == 7
    assert headlines.default_variant(128, True, 8192) == 6
    assert headlines.default_variant(96, True, 4096) == 7  # d = 128's tiles, d = 128's rule
    assert headlines.default_variant(96, False, 1024) == 6
    assert headlines.default_variant(256, False, 8192) == 6  # the wide heads: 3 and 6 only
    assert headlines.default_variant(192, True, 8192) == 3
    with pytest.raises(ValueError, match="d in"):
        headlines.default_variant(80, True, 8192)


def test_summary_is_the_spread_of_the_medians_and_of_single_rounds():
    got = headlines.summary(DATA, "sdpa flash", mode="fwd", D=128, min_N=4096)
    assert got["shapes"] == 1 and got["lo"] == got["hi"] == pytest.approx(1.04096)
    everything = headlines.summary(DATA, "sdpa flash")
    assert everything["lo"] < everything["hi"] and everything["rounds_lo"] == 0.9
    with pytest.raises(ValueError, match="no recorded shape"):
        headlines.summary(DATA, "sdpa flash", D=64)


def test_the_table_prints_medians_with_spread_and_fits_a_lecture(capsys):
    headlines._print(DATA, "recorded somewhere")
    out = capsys.readouterr().out
    assert "median (lowest-highest) over 5 interleaved rounds" in out
    assert "1.01 (0.90-1.20)" in out and len(out.splitlines()) < 60


def test_the_table_prints_a_forward_only_recording(capsys):
    # 14_head_dims: forward rows only, a fixed H instead of H x d
    from course_utils import recorded

    data = recorded.load("14_head_dims", verbose=False)
    headlines._print(data, "recorded")
    out = capsys.readouterr().out
    assert f"H = {data['heads']}" in out and "fwd+bwd" not in out
    assert len(out.splitlines()) == 3 + len(data["rows"]) + 1  # two lines, a header, a footer


def test_show_on_a_cpu_prints_the_recording_or_says_it_is_missing(capsys):
    if headlines.runtime_on_gpu():
        pytest.skip("on a GPU show() measures")
    headlines.show(10)
    out = capsys.readouterr().out
    assert "not recorded yet" in out or "interleaved rounds" in out


def test_the_fp8_recording_prints_ratios_with_spread_and_both_errors(capsys):
    from course_utils import recorded

    data = recorded.load("14_fp8", verbose=False)
    assert [(r["D"], r["causal"], r["N"]) for r in data["rows"]] == [
        (D, causal, N) for D in headlines.FP8_DS for causal in (False, True)
        for N in headlines.FP8_NS]
    headlines.print_fp8(data, "recorded")
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if " False " in line or " True " in line]
    assert len(rows) == len(data["rows"]) and all(line.count("(") == 2 for line in rows)
    assert any("x30: plain" in line and "rotated" in line for line in out)


def test_measuring_fp8_on_a_cpu_says_what_it_needs():
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("on an H100/H200 measure_fp8 measures")
    with pytest.raises(RuntimeError, match="sm_90"):
        headlines.measure_fp8(save=False)
