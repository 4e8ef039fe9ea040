"""Fixtures shared by the tests (the repository's conftest.py chooses the runtime mode)."""

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
