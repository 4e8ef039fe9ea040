"""The course's kernels: CUDA C++ sources (``*.cu``), their sanitizer drivers, and Python modules
that build or hold kernels the lectures use:

* ``sgemm`` (with ``sgemm.cu``): chapter 04's ladder of float32 matmuls in CUDA C++, also the
  fixed-tile matmul that chapter 03 sweeps for wave quantization;
* ``ch03_recompute``: chapter 03's fused sigmoid-stack kernels in Numba (import after
  ``course_utils.setup()``);
* ``flash_attention_triton``: chapter 09's Triton FlashAttention (import it after
  ``course_utils.setup()``).
"""
