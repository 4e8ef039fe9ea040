"""`python -m course_utils doctor`: one row per capability, exit 0 while the simulator works."""

import os
import subprocess
import sys

import course_utils as cu

ROWS = ["Python", "torch", "GPU", "Numba CUDA simulator", "Triton interpreter",
        "nvcc (compile-only)", "NVRTC via cuda.core", "ninja + load_inline"]


def test_doctor_reports_every_capability():
    proc = subprocess.run([sys.executable, "-m", "course_utils", "doctor"], capture_output=True,
                          text=True, timeout=900, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in ROWS + (["Numba CUDA on the GPU", "Triton on the GPU"] if cu.on_gpu() else []):
        assert row in proc.stdout, f"no {row!r} row in:\n{proc.stdout}"
    assert "ok  Numba CUDA simulator" in proc.stdout
    assert "ok  Triton interpreter" in proc.stdout
    if cu.on_gpu():
        assert "FAIL" not in proc.stdout, proc.stdout


def test_broken_simulator_path_gives_a_nonzero_exit(monkeypatch):
    from course_utils import doctor

    monkeypatch.setattr(doctor, "_probe", lambda code, cpu=False: (False, "ImportError: numba"))
    table = doctor.rows()
    assert any(r.critical and r.status == doctor.FAIL for r in table)
    assert doctor.main() == 1
