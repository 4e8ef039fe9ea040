"""plots.sm_diagram draws one H100 SM with the numbers chapter 00 states (and that its recording
of the device's own attributes shows)."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from course_utils import occupancy, plots, recorded  # noqa: E402


def _texts(ax):
    return "\n".join(t.get_text() for t in ax.texts)


def test_the_sm_diagram_labels_every_part_with_its_numbers():
    ax = plots.sm_diagram()
    text = _texts(ax)
    for p in range(4):
        assert f"sub-partition {p}" in text
    for label in ("warp scheduler + dispatch unit", "16,384 x 32-bit (64 KiB)", "FP32 x 32",
                  "INT32 x 16", "FP64 x 16", "tensor core", "LD/ST", "SFU",
                  "256 KiB combined L1", "up to 228 KiB per SM", "227 KiB per block",
                  "4 x 32 = 128 FP32 lanes", "65,536 registers", "2,048 threads",
                  "132 SMs", "270,336 threads"):
        assert label in text, label
    assert text.count("tensor core") == 4 and text.count("FP32 x 32") == 4
    plt.close(ax.figure)


def test_the_sm_diagram_draws_into_a_given_axes():
    fig, ax = plt.subplots()
    assert plots.sm_diagram(ax=ax) is ax
    plt.close(fig)


def test_the_drawn_numbers_agree_with_the_recorded_device_and_the_occupancy_limits():
    sm = plots.H100_SM
    facts = recorded.load("00_device_facts", verbose=False)
    assert sm["SMs"] == facts["SMs"]
    assert sm["max warps per SM"] * 32 == facts["max threads per SM"]
    assert sm["partitions"] * sm["registers per partition"] == facts["registers per SM (32-bit)"]
    assert sm["max shared per SM (KiB)"] == facts["shared memory per SM (KiB)"]
    limits = occupancy.SM90
    assert sm["max warps per SM"] == limits.max_warps_per_sm
    assert sm["partitions"] == limits.register_partitions
    assert sm["max shared per SM (KiB)"] * 1024 == limits.shared_per_sm
    assert sm["max shared per block (KiB)"] * 1024 == limits.max_shared_per_block
