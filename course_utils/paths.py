"""Where things are on disk: the package, the repository, the kernels' sources, the recordings.

The bottom of the package with :mod:`runtime` (it imports nothing of the course): a module that
reads a file names its folder from here, so that moving a module never moves what it reads.
"""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent  # course_utils/
REPO = PACKAGE.parent  # the checkout: notebooks/, solutions/, docs/, ...
KERNELS = PACKAGE / "library" / "kernels"  # the chapters' CUDA C++ (.cu, .cuh) and Triton
RECORDED = PACKAGE / "recorded"  # GPU results as JSON (course_utils.recorded reads them)
CUDA_CPU_HEADER = PACKAGE / "toolbox" / "cuda_cpu.h"  # the CUDA thread model in C++ (cuda_cpu)
