"""Runtime mode: setup() in fresh interpreters, pick, kernel_array, needs_gpu."""

import os
import subprocess
import sys

import pytest
import torch

import course_utils as cu


def run(code, **env):
    full = {k: v for k, v in os.environ.items()
            if k not in ("NUMBA_ENABLE_CUDASIM", "TRITON_INTERPRET", "COURSE_DEVICE")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full,
                          timeout=120)


def test_forced_cpu_mode_sets_both_switches_and_prints_the_banner():
    p = run("import os, course_utils as cu; m = cu.setup(); "
            "print(os.environ['NUMBA_ENABLE_CUDASIM'], os.environ['TRITON_INTERPRET'], m.gpu)",
            COURSE_DEVICE="cpu")
    assert p.returncode == 0, p.stderr
    assert cu.runtime.SIMULATOR_BANNER in p.stdout
    assert p.stdout.strip().endswith("1 1 False")


def test_numba_imported_first_asks_for_a_restart():
    p = run("import numba\nimport course_utils as cu\ncu.setup()", COURSE_DEVICE="cpu")
    assert p.returncode != 0 and "Restart the kernel" in p.stderr


def test_setup_twice_is_harmless():
    p = run("import course_utils as cu\ncu.setup()\nfrom numba import cuda\n"
            "print(cuda.is_available())\ncu.setup()", COURSE_DEVICE="cpu")
    assert p.returncode == 0, p.stderr
    assert "True" in p.stdout  # the simulator reports itself as available


def test_bad_course_device_value():
    p = run("import course_utils as cu\ncu.setup()", COURSE_DEVICE="tpu")
    assert p.returncode != 0 and "COURSE_DEVICE" in p.stderr


def test_pick_and_device_follow_the_mode():
    assert cu.pick(gpu="big", cpu="small") == ("big" if cu.on_gpu() else "small")
    assert cu.device().type == ("cuda" if cu.on_gpu() else "cpu")


@pytest.mark.skipif(cu.on_gpu(), reason="simulator-mode behaviour")
def test_kernel_array_in_the_simulator(capsys):
    t = torch.arange(4.0)
    a = cu.kernel_array(t)
    a[0] = 7  # zero-copy: writes land in the tensor
    assert t[0] == 7
    with pytest.raises(TypeError, match="bfloat16"):
        cu.kernel_array(t.bfloat16())
    with pytest.raises(TypeError, match="torch.Tensor"):
        cu.kernel_array([1, 2])
    assert cu.needs_gpu("a timing") is False
    assert "[needs a GPU]" in capsys.readouterr().out


@pytest.mark.skipif(not cu.on_gpu(), reason="needs a GPU")
def test_kernel_array_on_the_gpu():
    t = torch.arange(4.0, device="cuda")
    a = cu.kernel_array(t)
    assert a.shape == (4,)
    with pytest.raises(ValueError, match="device"):
        cu.kernel_array(torch.arange(4.0))


def test_half_dtype_is_bf16_only_where_the_gpu_has_bf16_tensor_cores(monkeypatch, capsys):
    if not cu.on_gpu():
        assert cu.half_dtype() is torch.float16  # Triton's interpreter: no bf16
        return
    assert cu.half_dtype() is (torch.bfloat16 if torch.cuda.get_device_capability() >= (8, 0)
                               else torch.float16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))  # a T4
    monkeypatch.setattr(cu.runtime, "_told_half", set())
    assert cu.half_dtype() is torch.float16 and cu.half_dtype() is torch.float16
    out = capsys.readouterr().out
    assert out.count("sm_75") == 1 and "no bfloat16 tensor cores" in out  # said once


def test_capability_and_pretending_an_older_gpu(monkeypatch):
    monkeypatch.delenv(cu.runtime.PRETEND_ENV, raising=False)
    if not cu.on_gpu():
        assert cu.capability() == (0, 0)
        return
    assert cu.capability() == tuple(torch.cuda.get_device_capability())
    monkeypatch.setenv(cu.runtime.PRETEND_ENV, "7.5")  # a T4's features on this GPU
    assert cu.capability() == (7, 5)
    assert cu.half_dtype(verbose=False) is torch.float16
    from course_utils.library.kernels import flash_attention_triton as fat

    q = torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="sm_75"):
        fat.attention_forward(q, q, q)
    monkeypatch.setenv(cu.runtime.PRETEND_ENV, "seven")
    with pytest.raises(ValueError, match="major.minor"):
        cu.capability()
