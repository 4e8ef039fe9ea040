"""The compile matrix: kernels checked against the limits of sm_75 .. sm_90 without a GPU.

Planted kernels stand for the failures a T4 or an RTX card meets with H100-sized tiles: too much
shared memory per block, an instruction the generation lacks, spills. Each must be reported in
words that name the architecture and its limit, and a kernel that fits must pass everywhere.
"""

import pytest
from test_cuda import SPILL_SRC as SPILLS  # 32 live accumulators: spills at -maxrregcount=16

from course_utils import cuda as C
from course_utils import portability as P

pytestmark = pytest.mark.skipif(C.nvcc_path() is None and not C.nvrtc_available(),
                                reason="needs nvcc or NVRTC (no GPU needed)")

TILES = r"""
__global__ void small_kernel(float* out) { out[threadIdx.x] = threadIdx.x; }

__global__ void tile_kernel(float* out) {
  extern __shared__ float tile[];  // sized at launch: the third <<<...>>> argument
  tile[threadIdx.x] = threadIdx.x;
  __syncthreads();
  out[threadIdx.x] = tile[(threadIdx.x + 1) % blockDim.x];
}
"""

# bf16 mma.sync exists from sm_80 on: a T4 cannot even compile it
MMA = r"""
__global__ void bf16_mma_kernel(const unsigned* a, const unsigned* b, float* d) {
  unsigned lane = threadIdx.x;
  float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
      : "r"(a[lane]), "r"(a[lane + 32]), "r"(a[lane + 64]), "r"(a[lane + 96]),
        "r"(b[lane]), "r"(b[lane + 32]));
  d[lane] = c0 + c1 + c2 + c3;
}
"""

KIB = 1024


def _cells_by_arch(cells, kernel):
    return {c.arch: c for c in cells if c.kernel == kernel}


def test_a_small_kernel_fits_every_generation():
    cells = P.compile_matrix(TILES, {"small_kernel": P.Launch(256)})
    assert [c.arch for c in cells] == list(P.ALL_ARCHS)
    P.require_fits(cells)
    by_arch = _cells_by_arch(cells, "small_kernel")
    assert by_arch["sm_75"].occupancy.blocks == 4  # 32 warp slots on a T4
    assert by_arch["sm_86"].occupancy.blocks == 6  # 48 on an RTX 30
    assert by_arch["sm_90"].occupancy.blocks == 8  # 64 on an H100


def test_h100_sized_tiles_fail_where_shared_memory_is_smaller():
    # 120 KiB of tiles: an A100 or an H100 launches it, a T4 or an RTX 30/40 cannot
    cells = P.compile_matrix(TILES, {"tile_kernel": P.Launch(128, 120 * KIB)})
    failing = {c.arch for c in cells if not c.ok}
    assert failing == {"sm_75", "sm_86", "sm_89"}
    by_arch = _cells_by_arch(cells, "tile_kernel")
    assert "sm_86 (RTX 30, A10, A40) allows 99 KiB" in by_arch["sm_86"].problems[0]
    assert "allows 64 KiB" in by_arch["sm_75"].problems[0]
    with pytest.raises(AssertionError, match="tile_kernel on sm_89: 120 KiB of shared memory"):
        P.require_fits(cells)
    P.require_fits(cells, expected_failures=[("tile_kernel", a) for a in failing])
    table = P.format_matrix(cells)
    assert table.splitlines()[0].split() == ["kernel", *P.ALL_ARCHS]
    assert "FAIL" in table and "smaller tiles there" in table


def test_a_launch_chosen_per_architecture_fits_everywhere():
    def tiles(arch):  # 48 KiB where a block may have less than 99 KiB, else 96 KiB
        return P.Launch(128, (48 if arch == "sm_75" else 96) * KIB)

    cells = P.compile_matrix(TILES, {"tile_kernel": tiles})
    P.require_fits(cells)
    # and an expected failure that no longer fails is reported too
    with pytest.raises(AssertionError, match="fits now"):
        P.require_fits(cells, expected_failures=[("tile_kernel", "sm_75")])


def test_bf16_mma_does_not_compile_for_a_t4():
    cells = P.compile_matrix(MMA, {"bf16_mma_kernel": P.Launch(32)})
    by_arch = _cells_by_arch(cells, "bf16_mma_kernel")
    assert not by_arch["sm_75"].ok and by_arch["sm_75"].resources is None
    assert "does not compile for sm_75: ptxas: Feature '.bf16' requires .target sm_80" in (
        by_arch["sm_75"].problems[0])
    assert all(by_arch[a].ok for a in ("sm_80", "sm_86", "sm_89", "sm_90"))


def test_spills_are_problems_unless_allowed():
    launch = P.Launch(128)
    cells = P.compile_matrix(SPILLS, {"many_live_values": launch}, archs=("sm_86",),
                             extra_flags=["-maxrregcount=16"])
    assert len(cells) == 1 and "spills" in cells[0].problems[0]
    allowed = P.compile_matrix(SPILLS, {"many_live_values": P.Launch(128, allow_spills=True)},
                               archs=("sm_86",), extra_flags=["-maxrregcount=16"])
    P.require_fits(allowed)
    P.require_fits(P.compile_matrix(SPILLS, {"many_live_values": launch}, archs=("sm_86",)))


def test_too_many_registers_per_block_and_threads():
    cells = P.compile_matrix(SPILLS, {"many_live_values": P.Launch(2048)}, archs=("sm_90",))
    assert any("at most 1024" in p for p in cells[0].problems)


def test_bad_arguments_say_what_to_pass():
    with pytest.raises(ValueError, match="sm_75, sm_80, sm_86, sm_89, sm_90"):
        P.compile_matrix(TILES, {"small_kernel": P.Launch(32)}, archs=("sm_70",))
    with pytest.raises(ValueError, match="launches is empty"):
        P.compile_matrix(TILES, {})
    with pytest.raises(ValueError, match="threads per block"):
        P.Launch(0)
    with pytest.raises(ValueError, match="dynamic_shared_bytes"):
        P.Launch(32, -1)
    with pytest.raises(TypeError, match="expected a Launch"):
        P.compile_matrix(TILES, {"small_kernel": lambda arch: 256}, archs=("sm_90",))
    cells = P.compile_matrix(TILES, {"no_such_kernel": P.Launch(32)}, archs=("sm_90",))
    assert "kernels compiled: small_kernel, tile_kernel" in cells[0].problems[0]
