"""Exercises and their grading (docs/ARCHITECTURE.md).

From the bottom: ``types`` (what an exercise, a case, a candidate and a result are) and
``watch`` (operations an exercise forbids, caught while the candidate runs); ``checks``
(comparing an answer with the float64 reference, with hints); ``harness/`` (student-side
helpers a case runs next to the candidate) and ``emulated`` (a CUDA C++ case on the CPU);
``sandbox/``, ``seccomp``, ``ranks`` and ``worker_package`` (the worker that holds a notebook
while it is graded, and the ranks of chapter 13's exercises); ``specs/`` (each chapter's
cases); ``grader`` (``check`` and the grade command) and ``assign`` (exercises generated from
solutions). ``sanitize/`` holds compute-sanitizer drivers run on a GPU.
"""
