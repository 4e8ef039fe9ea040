"""The course's kernels: CUDA C++ sources (``*.cu``), their sanitizer drivers, and Python modules
that build or hold kernels the lectures use:

* ``sgemm`` (with ``sgemm.cu``): chapter 04's ladder of float32 matmuls in CUDA C++, also the
  fixed-tile matmul that chapter 03 sweeps for wave quantization;
* ``ch03_recompute``: chapter 03's fused sigmoid-stack kernels in Numba (import after
  ``course_utils.setup()``);
* ``flash_attention_triton``: chapter 09's Triton FlashAttention (import it after
  ``course_utils.setup()``);
* ``flash_attention_tma``: chapter 14's Triton rungs above it: TMA descriptors, a persistent grid,
  FP8 with per-block scales (import after ``course_utils.setup()``);
* ``flash_attention_hopper.cu``: chapter 14's CUDA C++ forward for sm_90a (TMA, mbarriers,
  ``wgmma``, a producer and two consumer warpgroups, ping-pong, intra-warpgroup overlap).
"""
