"""Results measured on a GPU, shipped as JSON so that a reader without a GPU sees real numbers.

A notebook cell that measures something on the GPU calls ``save(name, data)``; that writes
``course_utils/recorded/<name>.json`` only while recording (``COURSE_RECORD=1``, set by
``python -m course_utils record NOTEBOOK``), together with the device, date and library
versions. In simulator mode the same cell calls ``load(name)`` and says that it shows a
recorded result, and where it came from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import paths

FOLDER = paths.RECORDED
RECORD_ENV = "COURSE_RECORD"


def environment() -> dict:
    """Device name, date and library versions: stored with every recording."""
    import datetime
    import platform

    import torch

    info = {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": "CPU",
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    for name in ("numba", "triton", "numpy"):
        try:
            info[name] = __import__(name).__version__
        except Exception:  # not installed: record that
            info[name] = None
    try:
        from importlib.metadata import version

        info["numba_cuda"] = version("numba-cuda")
    except Exception:
        info["numba_cuda"] = None
    return info


def recording() -> bool:
    return os.environ.get(RECORD_ENV) == "1"


def save(name: str, data: dict) -> Path | None:
    """Store ``data`` (JSON-serialisable) as recording ``name`` while recording; else no-op."""
    if not recording():
        return None
    FOLDER.mkdir(exist_ok=True)
    path = FOLDER / f"{name}.json"
    payload = {"name": name, "environment": environment(), "data": data}
    path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    print(f"recorded {path.name}")
    return path


def load(name: str, verbose: bool = True) -> dict:
    """The data of recording ``name``; prints where and when it was measured."""
    path = FOLDER / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(
            f"no recorded result {name!r} ({path}); record it on a GPU with "
            "`python -m course_utils record NOTEBOOK`"
        )
    payload = json.loads(path.read_text(encoding="utf-8"))
    env = payload["environment"]
    if verbose:
        print(
            f"Recorded result (not measured now): {env['device']}, {env['date']}, "
            f"torch {env['torch']}, numba-cuda {env.get('numba_cuda')}, triton {env.get('triton')}"
        )
    return payload["data"]


def label(name: str) -> str:
    """A short 'recorded on DEVICE, DATE' label for plot titles."""
    env = json.loads((FOLDER / f"{name}.json").read_text(encoding="utf-8"))["environment"]
    return f"recorded on {env['device']}, {env['date']}"
