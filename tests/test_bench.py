"""bench: FLOP convention (ANCHORS.md), CPU timing, tables and environment info."""

import json
import time

import pytest
import torch

from course_utils import bench, runtime

# time_fn times with CUDA events whenever the course runs in GPU mode, so the CPU-timing tests
# only hold in CPU mode (CI, laptops, or COURSE_DEVICE=cpu on a GPU machine).
cpu_mode_only = pytest.mark.skipif(runtime.on_gpu(), reason="checks CPU timing")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_forward_flops_follow_the_papers_convention():
    assert bench.attention_flops(4, 16, 4096, 4096, 128) == 4 * 4 * 16 * 4096 * 4096 * 128
    assert bench.attention_flops(1, 1, 3, 5, 7) == 4 * 3 * 5 * 7  # Nq != Nk


def test_causal_and_backward_multipliers():
    fwd = bench.attention_flops(2, 32, 1024, 1024, 64)
    assert bench.attention_flops(2, 32, 1024, 1024, 64, causal=True) == fwd // 2
    assert bench.attention_flops(2, 32, 1024, 1024, 64, mode="bwd") == fwd * 5 // 2
    assert bench.attention_flops(2, 32, 1024, 1024, 64, mode="fwd+bwd") == fwd * 7 // 2
    both_causal = bench.attention_flops(2, 32, 1024, 1024, 64, causal=True, mode="fwd+bwd")
    assert both_causal == fwd * 7 // 4
    assert isinstance(both_causal, int)
    # ANCHORS.md shapes: hidden 2048, B * N = 32768 tokens; d=128, N=4096 -> H=16, B=8
    assert bench.attention_flops(8, 16, 4096, 4096, 128) == 4 * 8 * 16 * 4096**2 * 128


def test_flops_reject_bad_mode_and_sizes():
    with pytest.raises(ValueError, match="mode must be one of 'fwd', 'bwd', 'fwd\\+bwd'"):
        bench.attention_flops(1, 1, 8, 8, 8, mode="forward")
    with pytest.raises(ValueError, match="Nk must be an int >= 1"):
        bench.attention_flops(1, 1, 8, 0, 8)
    with pytest.raises(ValueError, match="d must be an int"):
        bench.attention_flops(1, 1, 8, 8, 8.0)


def test_tflops_and_gbps():
    assert bench.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert bench.tflops(4 * 4 * 16 * 4096**2 * 128, 1.0) == pytest.approx(549.755813888)
    assert bench.gbps(3e9, 1.0) == pytest.approx(3000.0)
    with pytest.raises(ValueError, match="> 0 ms"):
        bench.tflops(1e9, 0.0)


@cpu_mode_only
def test_time_fn_on_cpu_measures_a_sleep():
    timing = bench.time_fn(time.sleep, 0.002)
    assert timing.device == "cpu" and timing.n >= 5
    assert 1.9 <= timing.min_ms <= timing.p20_ms <= timing.median_ms <= timing.p80_ms
    assert timing.median_ms < 50
    assert "median of" in str(timing)


@cpu_mode_only
def test_time_fn_passes_arguments_and_respects_rep_and_warmup():
    calls = []
    timing = bench.time_fn(lambda x, y=0: calls.append((x, y)), 1, y=2, warmup=3, rep=4)
    assert timing.n == 4 and len(calls) == 1 + 3 + 4 and calls[0] == (1, 2)
    with pytest.raises(ValueError, match="rep must be at least 1"):
        bench.time_fn(lambda: None, rep=0)
    with pytest.raises(TypeError, match="function to time"):
        bench.time_fn(42)


@cpu_mode_only
def test_time_fn_does_not_repeat_a_slow_call():
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.25)  # longer than the CPU budget: like a simulator launch

    timing = bench.time_fn(slow)
    assert timing.n == 1 and len(calls) == 1 and timing.median_ms >= 240


def test_time_fn_on_a_torch_op():
    x = torch.randn(256, 256)
    timing = bench.time_fn(torch.matmul, x, x)
    assert 0 < timing.min_ms <= timing.median_ms and timing.std_ms >= 0


def test_table_ratio_to_baseline(capsys):
    flops = bench.attention_flops(1, 1, 1024, 1024, 64)
    rows = bench.table(
        [
            bench.Row("sdpa fp32", 2.0, flops=flops),
            {"name": "mine", "ms": 4.0, "flops": flops, "bytes": 8e6},
            bench.Row("copy", 1.0, bytes=3e9),
        ],
        device_name="Test GPU",
    )
    by_name = {r["name"]: r for r in rows}
    assert by_name["mine"]["vs_baseline"] == pytest.approx(0.5)  # half the baseline's speed
    assert by_name["copy"]["vs_baseline"] == pytest.approx(2.0)
    assert by_name["sdpa fp32"]["vs_baseline"] == pytest.approx(1.0)
    assert by_name["mine"]["tflops"] == pytest.approx(bench.tflops(flops, 4.0))
    assert by_name["copy"]["tflops"] is None and by_name["copy"]["gbps"] == pytest.approx(3000)
    json.dumps(rows)  # plain values: can be saved as recorded data
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "device: Test GPU"
    assert "vs sdpa fp32" in out[1] and "TFLOP/s" in out[1] and "GB/s" in out[1]
    assert out[4].startswith("mine") and out[4].endswith("0.50x")
    assert len({len(line) for line in out[1:]}) == 1  # aligned columns


def test_table_needs_its_baseline():
    with pytest.raises(ValueError, match="baseline row 'sdpa fp32' is missing; rows are: 'mine'"):
        bench.table([bench.Row("mine", 1.0)])
    rows = bench.table([bench.Row("mine", 1.0)], baseline=None, verbose=False)
    assert rows[0]["vs_baseline"] is None
    with pytest.raises(ValueError, match="needs 'name' and 'ms'"):
        bench.table([{"name": "x"}], baseline=None)


@cpu_mode_only
def test_table_accepts_timings_and_names_the_cpu(capsys):
    timing = bench.time_fn(torch.add, torch.ones(10), torch.ones(10), rep=3)
    rows = bench.table([bench.Row("sdpa fp32", timing), bench.Row("b", 2 * timing.median_ms)])
    assert rows[1]["vs_baseline"] == pytest.approx(0.5)
    assert capsys.readouterr().out.startswith(f"device: {bench.CPU_NOTE}")


def test_environment_info_is_json_ready():
    info = bench.environment_info()
    assert info["torch"] == torch.__version__ and info["gpu"] is runtime.on_gpu()
    assert (info["device"] == "CPU") is not runtime.on_gpu() and "date" in info
    json.dumps(info)


@needs_cuda
def test_time_fn_on_cuda_uses_events_and_can_flush_l2():
    x = torch.randn(4096, 4096, device="cuda")
    warm = bench.time_fn(torch.matmul, x, x)
    cold = bench.time_fn(torch.matmul, x, x, flush_l2=True)
    assert warm.device == torch.cuda.get_device_name() and warm.n >= 5
    assert 0 < warm.min_ms <= warm.median_ms < 100 and 0 < cold.median_ms < 100
    # 4 MB: fits in L2, so flushing it slows the add down; both must time the GPU's work (a
    # few microseconds), not Python's launch latency (~20 microseconds per call)
    small = torch.randn(1 << 20, device="cuda")
    hot = bench.time_fn(torch.add, small, small, rep=300)
    flushed = bench.time_fn(torch.add, small, small, rep=300, flush_l2=True)
    assert hot.median_ms < flushed.median_ms * 1.2 and hot.n == 300


def test_interleaved_rounds_and_the_median_ratio_with_its_spread():
    calls = []
    ms = bench.interleaved({"fast": lambda: calls.append("f"), "slow": lambda: calls.append("s")},
                           rounds=5, warmup=0, rep=1)
    assert set(ms) == {"fast", "slow"} and all(len(v) == 5 for v in ms.values())
    summary = bench.ratio_summary({"k": [1.0, 2.0, 1.0, 4.0, 1.0], "b": [2.0] * 5}, "k", "b")
    assert summary == {"median": 2.0, "lo": 0.5, "hi": 2.0, "rounds": 5}
    with pytest.raises(ValueError, match="same number"):
        bench.ratio_summary({"k": [1.0], "b": [1.0, 2.0]}, "k", "b")
    with pytest.raises(ValueError, match="rounds"):
        bench.interleaved({"a": lambda: None}, rounds=0)
