"""The course's kernels: CUDA C++ sources (``*.cu``), their sanitizer drivers, and chapter 09's
Triton FlashAttention (``flash_attention_triton``, import it after ``course_utils.setup()``)."""
