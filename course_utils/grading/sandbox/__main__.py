"""``python -m course_utils.grading.sandbox FD_IN FD_OUT``: run a worker (as ``_BOOT`` does)."""

import sys

from . import worker_main

worker_main(int(sys.argv[1]), int(sys.argv[2]))
