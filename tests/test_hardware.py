"""The device facts a fair comparison uses: the FP32 FMA ceiling and the kernels a call ran."""

import shutil

import pytest
import torch

from course_utils import hardware

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_fma_peak_is_sms_lanes_two_flop_clock():
    h100 = hardware.DeviceFacts("NVIDIA H100 80GB HBM3", (9, 0), 132, 1980.0, 128)
    assert h100.fp32_fma_peak_tflops == pytest.approx(66.9, abs=0.05)
    a100 = hardware.DeviceFacts("NVIDIA A100-SXM4-80GB", (8, 0), 108, 1410.0, 64)
    assert a100.fp32_fma_peak_tflops == pytest.approx(19.5, abs=0.05)
    assert "66.9 TFLOP/s" in str(h100)


def test_bad_arguments_say_what_was_wrong():
    with pytest.raises(TypeError, match="GPU number"):
        hardware.device_facts(True)
    with pytest.raises(TypeError, match="function"):
        hardware.kernel_names(42)
    with pytest.raises(TypeError, match="Python source"):
        hardware.ncu_metrics("", "fmha")
    with pytest.raises(TypeError, match="regular expression"):
        hardware.ncu_metrics("print(1)", None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_no_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="GPU|driver"):
        hardware.fp32_fma_peak_tflops()
    if shutil.which("ncu") is None:
        with pytest.raises(RuntimeError, match="ncu"):
            hardware.ncu_metrics("print(1)", "anything")


@gpu
def test_device_facts_on_the_gpu():
    facts = hardware.device_facts()
    assert facts.sms == torch.cuda.get_device_properties(0).multi_processor_count
    assert facts.compute_capability == torch.cuda.get_device_capability(0)
    assert 1 < facts.fp32_fma_peak_tflops < 200


@gpu
def test_kernel_names_lists_what_ran():
    x = torch.randn(1024, 1024, device="cuda")
    names = hardware.kernel_names(torch.mm, x, x)
    assert names and all(isinstance(n, str) for n in names)
