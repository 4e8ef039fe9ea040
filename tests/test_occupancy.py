"""The occupancy calculator on known cases; on a GPU, against the CUDA driver."""

import pytest

from course_utils import occupancy as occ
from course_utils.runtime import on_gpu

KNOWN = [  # (registers, shared bytes, threads) -> (blocks, limit), sm_90
    ((32, 0, 256), (8, "warps")),  # 100 %: 8 blocks x 8 warps
    ((64, 0, 256), (4, "registers")),  # 64 x 256 = 16K registers per block
    ((40, 0, 64), (24, "registers")),  # 1280 per warp: 12 warps per register-file quarter
    ((16, 0, 32), (32, "blocks")),  # tiny blocks: 32 blocks per SM at most
    ((32, 100 * 1024, 128), (2, "shared memory")),  # 101 KiB allocated per block
    ((32, 227 * 1024, 128), (1, "shared memory")),  # the largest block: 227 KiB + 1 KiB
    ((168, 0, 384), (1, "registers")),
]


@pytest.mark.parametrize(("config", "expected"), KNOWN)
def test_known_cases(config, expected):
    got = occ.active_blocks(*config)
    assert (got.blocks, got.limit) == expected
    assert got.occupancy == got.warps / 64


@pytest.mark.parametrize(
    "config",
    [(256, 0, 128), (255, 0, 1024), (32, 0, 1025), (32, 227 * 1024 + 1, 128)],
)
def test_cannot_launch(config):
    got = occ.active_blocks(*config)
    assert got.blocks == 0 and "cannot launch" in got.limit


def test_register_rounding_to_multiples_of_8():
    # 33 registers are allocated as 40: the same occupancy as 40
    assert occ.active_blocks(33, 0, 64).blocks == occ.active_blocks(40, 0, 64).blocks == 24


def test_sm80_has_less_shared_memory():
    assert occ.active_blocks(32, 100 * 1024, 128, arch=occ.SM80).blocks == 1
    assert occ.active_blocks(32, 164 * 1024, 128, arch=occ.SM80).blocks == 0


# (arch, (registers, shared bytes, threads)) -> (blocks, limit), by the rules of each generation
OTHER_ARCHS = [
    ("sm_75", (32, 0, 256), (4, "warps")),  # 32 warp slots: 4 blocks of 8 warps
    ("sm_75", (16, 0, 32), (16, "blocks")),  # at most 16 blocks
    ("sm_75", (32, 20 * 1024, 128), (3, "shared memory")),  # 64 KiB, no reserved KiB
    ("sm_75", (32, 64 * 1024, 128), (1, "shared memory")),  # the whole 64 KiB for one block
    ("sm_75", (64, 0, 256), (4, "warps")),  # registers allow 4 too: warps are named on a tie
    ("sm_80", (32, 0, 256), (8, "warps")),
    ("sm_80", (32, 81 * 1024, 128), (2, "shared memory")),  # 2 x (81 + 1) KiB = 164 KiB
    ("sm_80", (32, 82 * 1024, 128), (1, "shared memory")),  # 2 x 83 KiB > 164 KiB
    ("sm_86", (32, 0, 256), (6, "warps")),  # 48 warp slots
    ("sm_86", (64, 0, 128), (8, "registers")),  # 2048 per warp: 8 warps per quarter
    ("sm_86", (16, 0, 32), (16, "blocks")),
    ("sm_86", (32, 50 * 1024, 128), (1, "shared memory")),  # 51 KiB x 2 > 100 KiB
    ("sm_86", (32, 99 * 1024, 128), (1, "shared memory")),
    ("sm_89", (16, 0, 32), (24, "blocks")),  # Ada holds 24 small blocks, Ampere GA10x 16
    ("sm_89", (32, 0, 256), (6, "warps")),
    ("sm_89", (32, 32 * 1024, 128), (3, "shared memory")),  # 3 x 33 KiB <= 100 KiB
]


@pytest.mark.parametrize(("arch", "config", "expected"), OTHER_ARCHS,
                         ids=[f"{a}-{c}" for a, c, _ in OTHER_ARCHS])
def test_other_generations(arch, config, expected):
    got = occ.active_blocks(*config, arch=arch)
    assert (got.blocks, got.limit) == expected
    assert got.occupancy == got.warps / occ.arch_limits(arch).max_warps_per_sm


@pytest.mark.parametrize(("arch", "config"), [
    ("sm_75", (32, 64 * 1024 + 1, 128)),  # more than a T4 block may have
    ("sm_86", (32, 99 * 1024 + 1, 128)),  # the H100's chapter 07 tiles on an RTX 3090
    ("sm_89", (32, 100 * 1024, 128)),
    ("sm_75", (255, 0, 512)),  # 255 x 512 registers pass 64K per block
])
def test_other_generations_cannot_launch(arch, config):
    got = occ.active_blocks(*config, arch=arch)
    assert got.blocks == 0 and "cannot launch" in got.limit


def test_arch_limits_by_name_and_capability():
    assert occ.arch_limits("sm_86") is occ.arch_limits((8, 6)) is occ.arch_limits("8.6") is occ.SM86
    assert occ.arch_limits(75) is occ.SM75 and occ.arch_limits(occ.SM90) is occ.SM90
    assert not occ.SM75.bf16_tensor_cores and all(
        occ.ARCHS[a].bf16_tensor_cores for a in ("sm_80", "sm_86", "sm_89", "sm_90"))
    for bad in ("sm_70", (10, 0), "H100", 8.6):
        with pytest.raises(ValueError, match="sm_75, sm_80, sm_86, sm_89, sm_90"):
            occ.arch_limits(bad)


def test_flash_budget():
    assert occ.fa_registers_per_thread(64, 128, 128) == 64 + 2
    assert occ.fa_registers_per_thread(128, 256, 128) == 256 + 2  # over 255: spills
    assert occ.fa_registers_per_thread(256, 64, 128) == 128 + 4  # two rows per thread
    assert occ.fa_shared_bytes(64, 64, 128, 2) == 3 * 64 * 128 * 2


DRIVER_SOURCE = r"""
__global__ void small_kernel(float* out) { out[threadIdx.x] = threadIdx.x; }
__global__ void shared_kernel(float* out) {
    __shared__ float tile[4096];  // 16 KiB static
    tile[threadIdx.x] = threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = tile[(threadIdx.x + 1) % blockDim.x];
}
"""


@pytest.mark.skipif(not on_gpu(), reason="needs a GPU to ask the driver")
@pytest.mark.parametrize("name", ["small_kernel", "shared_kernel"])
@pytest.mark.parametrize(("threads", "dynamic"), [(32, 0), (128, 0), (256, 8192), (1024, 0),
                                                   (128, 30 * 1024)])  # fmt: skip
def test_calculator_matches_driver(name, threads, dynamic):
    from course_utils.toolbox.cuda import compile_kernel

    kernel = compile_kernel(DRIVER_SOURCE, name)
    used = occ.driver_resources(kernel)
    regs, static = used["registers"], used["shared_bytes"]
    ours = occ.active_blocks(regs, static + dynamic, threads).blocks
    assert ours == occ.driver_active_blocks(kernel, threads, dynamic)


HEAVY_SOURCE = r"""
template <int R>
__global__ void heavy_kernel(const float* x, float* out, int n) {
    float acc[R];  // R live accumulators: ptxas gives 40, 72, 168, 255 registers for R below
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = x[(threadIdx.x + i) % n];
    for (int k = 0; k < n; ++k) {
        float xk = x[k];
#pragma unroll
        for (int i = 0; i < R; ++i) acc[i] = fmaf(acc[i], xk, acc[(i + 1) % R]);
    }
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < R; ++i) s += acc[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""


@pytest.mark.skipif(not on_gpu(), reason="needs a GPU to ask the driver")
@pytest.mark.parametrize("R", [24, 56, 120, 200])
def test_calculator_matches_driver_when_registers_limit(R):
    from course_utils.toolbox.cuda import compile_kernel

    kernel = compile_kernel(HEAVY_SOURCE, f"heavy_kernel<{R}>")
    used = occ.driver_resources(kernel)
    assert used["registers"] > 32  # otherwise this test does not test the register limit
    for threads in (64, 96, 128, 192, 256, 384, 512, 768, 1024):
        for dynamic in (0, 20 * 1024):
            ours = occ.active_blocks(used["registers"], used["shared_bytes"] + dynamic, threads)
            driver = occ.driver_active_blocks(kernel, threads, dynamic)
            assert ours.blocks == driver, (R, used, threads, dynamic, ours)
