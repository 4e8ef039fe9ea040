"""Fixtures shared by the tests (the repository's conftest.py chooses the runtime mode)."""

import socket

import pytest

from course_utils import grader


@pytest.fixture
def grading_env(monkeypatch):
    """Check the way `python -m course_utils grade` does: hidden cases run, failures don't raise."""
    monkeypatch.setenv(grader.GRADING_ENV, "1")
    monkeypatch.delenv(grader.RAISE_ENV, raising=False)


@pytest.fixture
def nan_shared_memory(monkeypatch):
    """In the CUDA simulator, every new float shared array starts as NaN.

    The simulator allocates a tile with np.empty: whatever bits were there, NaN now and then.
    Tests of a kernel that reads never-stored tile slots use this to draw NaN every time.
    """
    import numpy as np
    from numba.cuda.simulator import kernelapi

    class NumpyWithNanEmpty:  # numpy, except that np.empty of floats is all NaN
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def empty(shape, dtype=float, **kw):
            out = np.empty(shape, dtype, **kw)
            if out.dtype.kind == "f":
                out[...] = np.nan
            return out

    monkeypatch.setattr(kernelapi, "np", NumpyWithNanEmpty())


@pytest.fixture
def one_rank_group():
    """A torch.distributed group of one gloo rank in this process (the ring's and Ulysses'
    one-rank tests), torn down after the test."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
