"""pytest configuration shared by tests/ and the notebooks that nbval runs.

- Chooses the runtime mode once, before anything imports numba or triton, so the test process
  and every notebook kernel it starts (nbval's ``--nbval-current-env`` passes the environment on)
  run in the same mode: GPU if there is one, else the CPU simulator; ``COURSE_DEVICE=cpu``
  forces the simulator on a GPU machine.
- Makes a failed ``grader.check`` raise, so a solution or lecture notebook whose check fails
  fails its nbval test instead of printing ❌ and passing.
"""

import os

import matplotlib

matplotlib.use("Agg")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ["COURSE_CHECKS_RAISE"] = "1"

import course_utils  # noqa: E402

course_utils.setup(verbose=False)
