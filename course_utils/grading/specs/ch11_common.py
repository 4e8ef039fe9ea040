"""Chapter 11's shared helpers: registering a case, an int32 tensor of the device, and the
low-precision dtype the kernels run in (``LOW``).

Its own room so that ``ch11`` and ``ch11_splits`` share them without an import circle: both
import this bottom module.
"""

from __future__ import annotations

import torch

from ...runtime import device, pick

LOW = pick(gpu=torch.bfloat16, cpu=torch.float16)  # the interpreter cannot run bfloat16


def _ints(values):
    return torch.tensor(list(values), dtype=torch.int32, device=device())


def _add(exercise, name, make, *args, hidden=False, **kwargs):
    """Register the case ``make(name, *args, **kwargs)`` under ``name``."""
    exercise.case(name, hidden=hidden)(make(name, *args, **kwargs))
