"""The tiny GPT's data, its entropy floor, the direct comparison and the profiler's split
(course_utils/library/tinygpt.py, chapter 12).

The generated batches are sums, fresh every call and the same for one seed; the validation set
is fixed and not a training batch; the entropy floor is exact (against brute force over all
streams at small sizes); the direct comparison sees a bug that the loss curve hides (a 2 % scale
slip in a test-only wrapper around the course's op: the validation losses agree to 1e-3, the
comparison reads hundreds of times the correct op's error) and an off-by-one causal mask; the
profiler's split runs for eager, compile and reduce-overhead on the CPU.
"""

import itertools
import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import course_utils as cu
from course_utils import ops, tinygpt

DEV = cu.device()
SMALL = dict(batch=8, block=32, n_layer=1, n_head=2, n_embd=32)


def _sums_of(row):
    """The whole sums of a decoded row (the last one may be cut off)."""
    return [s for s in tinygpt.decode(row).split(";")[:-1] if s]


def test_batches_are_sums_fresh_and_seeded():
    gen = torch.Generator().manual_seed(3)
    x, y = tinygpt.sum_batch(4, 40, gen)
    assert x.shape == y.shape == (4, 40) and x.dtype == torch.long
    assert bool((x[:, 0] == tinygpt.SEMI).all()), "each row starts right after a ';'"
    assert torch.equal(x[:, 1:], y[:, :-1]), "x is y shifted right by one"
    for row in y:
        for sample in _sums_of(row):
            lhs, total = sample.split("=")
            a, b = lhs.split("+")
            assert int(a) + int(b) == int(total) and int(a) <= tinygpt.MAX_OPERAND
    x2, _ = tinygpt.sum_batch(4, 40, gen)
    assert not torch.equal(x, x2), "the next batch must be new data"
    again, _ = tinygpt.sum_batch(4, 40, torch.Generator().manual_seed(3))
    assert torch.equal(x, again), "the same seed gives the same batches"


def test_operands_are_uniform():
    x, y = tinygpt.sum_batch(400, 256, torch.Generator().manual_seed(0))
    pairs = Counter()
    for row in y:
        for sample in _sums_of(row)[:20]:  # not the last ones: a cut-off sum is more often long
            a, b = sample.split("=")[0].split("+")
            pairs[len(a)] += 1
    share_two_digits = pairs[2] / (pairs[1] + pairs[2])
    assert share_two_digits == pytest.approx(0.9, abs=0.01)  # 90 of 0..99 have two digits


def test_validation_set_is_fixed_and_held_out():
    val = tinygpt.validation_set(8, 32)
    again = tinygpt.validation_set(8, 32)
    assert len(val) == tinygpt.VAL_BATCHES
    assert all(torch.equal(a[0], b[0]) for a, b in zip(val, again, strict=True))
    rows = {tuple(x.tolist()) for xb, _ in val for x in xb}
    for seed in range(3):  # the first batches of training seeds 0..2
        gen = torch.Generator().manual_seed(seed)
        for _ in range(5):
            xb, _ = tinygpt.sum_batch(8, 32, gen)
            assert not rows & {tuple(x.tolist()) for x in xb}


def _brute_force_floor(block, max_operand):
    """H(first `block` characters of the stream) / block by enumerating enough sums."""
    strings = [f"{a}+{b}={a + b};" for a in range(max_operand + 1)
               for b in range(max_operand + 1)]
    p = 1 / len(strings)
    need = block // min(map(len, strings)) + 1
    counts = Counter()
    for combo in itertools.product(strings, repeat=need):
        counts["".join(combo)[:block]] += p**need
    return -sum(q * math.log(q) for q in counts.values()) / block


@pytest.mark.parametrize("block, max_operand", [(1, 9), (5, 9), (7, 9), (13, 4), (8, 12)])
def test_entropy_floor_is_exact(block, max_operand):
    assert tinygpt.entropy_floor(block, max_operand) == pytest.approx(
        _brute_force_floor(block, max_operand), rel=1e-12)


def test_entropy_floor_values():
    # all sums 6 characters (max_operand 1..4): 2 ln(m + 1) nats per 6 characters exactly
    assert tinygpt.entropy_floor(60, 1) == pytest.approx(2 * math.log(2) / 6, rel=1e-12)
    rate = tinygpt.entropy_rate()
    lengths = [len(f"{a}+{b}={a + b};") for a in range(100) for b in range(100)]
    assert rate == pytest.approx(2 * math.log(100) / (sum(lengths) / len(lengths)), rel=1e-12)
    floors = [tinygpt.entropy_floor(n) for n in (16, 64, 256, 1024)]
    assert all(a > b > rate for a, b in itertools.pairwise(floors)), floors
    assert floors[2] == pytest.approx(1.0, abs=0.01)  # the lecture's block: about 1.00 nats
    assert tinygpt.unigram_entropy(tinygpt.sum_batch(64, 256, torch.Generator())[1]) > 2.3


def _slip(q, k, v):
    """A test-only bug: the course's op with its scale 2 % too large."""
    return ops.flash_attention(q, k, v, causal=True, scale=1.02 / math.sqrt(q.shape[-1]))


def _off_by_one(q, k, v):
    """A test-only bug: a causal mask that lets query i see key i + 1 (a leak)."""
    N = q.shape[2]
    mask = torch.ones(N, N, dtype=torch.bool, device=q.device).tril(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_comparison_sees_bugs_the_loss_hides():
    cfg = dict(steps=30, warmup=2, eval_every=10, compare_every=0, device="cpu", **SMALL)
    good = tinygpt.train("course", seed=0, **cfg)
    slipped = tinygpt.train(_slip, seed=0, **cfg)
    other_seed = tinygpt.train("course", seed=1, **cfg)
    assert good["val"][-1][1] < good["val"][0][1], "the model did not learn"
    # the loss curve hides the slip: validation losses agree far inside the seed-to-seed spread
    gap = max(abs(a[1] - b[1]) for a, b in zip(good["val"], slipped["val"], strict=True))
    spread = abs(good["final_val"] - other_seed["final_val"])
    assert gap < 1e-3 and gap < spread / 10, (gap, spread)
    # the direct comparison at the trained weights does not
    torch.manual_seed(0)
    model = tinygpt.GPT(SMALL["n_layer"], SMALL["n_head"], SMALL["n_embd"], SMALL["block"])
    x, y = tinygpt.sum_batch(8, SMALL["block"], torch.Generator().manual_seed(9))
    errors = tinygpt.compare_attentions(
        model, x, y, {"course": "course", "sdpa": "sdpa", "slip": _slip, "leak": _off_by_one})
    correct = max(errors["course"]["grad"], errors["sdpa"]["grad"],
                  errors["course"]["logits"], errors["sdpa"]["logits"])
    assert correct < 1e-5, errors  # float32 on the CPU: rounding only
    for bug in ("slip", "leak"):
        assert errors[bug]["grad"] > 100 * correct, (bug, errors)
        assert errors[bug]["logits"] > 10 * correct, (bug, errors)


def test_train_reports_validation_floor_and_comparisons():
    run = tinygpt.train("course", seed=2, steps=12, warmup=2, eval_every=5, compare_every=5,
                        device=DEV, **SMALL)
    assert [s for s, _ in run["val"]] == [5, 10, 11]
    assert [c["step"] for c in run["compare"]] == [5, 10, 11]
    assert run["floor"] == pytest.approx(tinygpt.entropy_floor(SMALL["block"]))
    tol = cu.pick(gpu=1e-1, cpu=1e-5)  # bf16 autocast on a GPU: rounding of about 1e-2
    for entry in run["compare"]:
        for attention in tinygpt.ATTENTIONS:
            assert entry[attention]["grad"] < tol and entry[attention]["logits"] < tol, entry
        if cu.on_gpu():
            assert max(entry["float32"][a]["grad"] for a in tinygpt.ATTENTIONS) < 1e-4, entry
    assert run["final_val"] == run["val"][-1][1] > run["floor"]


def test_callable_attention_and_bad_names():
    model = tinygpt.GPT(1, 2, 32, 16, attention=_off_by_one)
    assert model(torch.zeros(1, 16, dtype=torch.long)).shape == (1, 16, len(tinygpt.VOCAB))
    with pytest.raises(ValueError, match="attention="):
        tinygpt.GPT(1, 2, 32, 16, attention="flex")
    with pytest.raises(ValueError, match="mode="):
        tinygpt.TrainingStep("course", "max-autotune")


@pytest.mark.parametrize("mode", ["eager", "reduce-overhead"])  # default: the same compile
def test_profile_split(mode):
    torch._dynamo.reset()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        split = tinygpt.profile_training("course", mode=mode, steps=2, warm=2, rounds=2,
                                         batch=2, block=16, n_layer=1, n_head=2, n_embd=32)
    finally:
        torch.set_num_threads(threads)
    assert split["step_ms"] > 0 and len(split["step_ms_rounds"]) == 2
    assert 0 < split["host_ops_ms"] <= split["profiled_step_ms"] * 1.05
    assert split["device_ms"] is None and split["idle_ms"] is None  # CPU: no device timeline
    assert split["mode"] == mode and math.isfinite(split["loss"])
