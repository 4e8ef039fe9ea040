"""Chapter 07's graded cases catch the bugs students make, with advice that names the fix.

The right answers are the solution notebook's own cells (written to a module); each named slip
(``NAMED_MISTAKES``) is that code with one edit, and must fail a *visible* case whose hint names
it: a student sees the diagnosis in the notebook, not after handing in.
"""

import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from numba import cuda
from spec_helpers import Slip, module_builder, solution_source

from course_utils import grader
from course_utils.grading.harness import ch07 as harness
from course_utils.grading.specs import ch07, ch07_combine

pytestmark = pytest.mark.usefixtures("grading_env")  # hidden cases too (tests/conftest.py)

SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "07_flash_attention_forward.ipynb"
_build = module_builder(
    Path(tempfile.mkdtemp(prefix="ch07_")),
    solution_source(SOLUTION, lambda s: "cu.setup()" not in s and "grader.check(" not in s),
    "ch07",
)
_modules = {}


def build(*edits):
    """The solution's module with ``(old, new)`` edits (each must match), built once."""
    if edits not in _modules:
        _modules[edits] = _build(*edits)
    return _modules[edits]


def forward(*edits):
    return build(*edits).flash_attention_forward


def online(*edits):
    return build(*edits).online_kernel


def tile_range(*edits):
    return build(*edits).kv_tile_range


# ----------------------------------------------------------------------------- named slips

F, O, R = "07.torch_forward", "07.online_update", "07.causal_skip"


def _every_tile():  # the mask does all the work: no tile is skipped
    return forward(("for c0 in range(lo // Bc * Bc, hi + 1, Bc):",
                    "for c0 in range(0, Nk, Bc):"))


NAMED_MISTAKES = [
    # 07.torch_forward
    Slip(F, "no rescale", lambda: forward(("l = l * alpha +", "l = l +"),
                                          ("acc = acc * alpha +", "acc = acc +")),
         "no rescale by alpha"),
    Slip(F, "exp2 in place of exp", lambda: forward(("alpha = torch.exp(", "alpha = torch.exp2("),
                                                    ("P = torch.exp(", "P = torch.exp2(")),
         "exp2 where exp belongs"),
    Slip(F, "missing -inf guard", lambda: forward(
        ("base = m_next.nan_to_num(neginf=0.0)", "base = m_next"),
        ("torch.where(seen, acc / torch.where(seen, l, 1.0), 0.0)", "acc / l"),
        ("torch.where(seen, m + torch.log(l), -math.inf)", "(m + torch.log(l))")),
         "missing -inf guard"),
    Slip(F, "top-left alignment", lambda: forward(("shift = Nk - Nq", "shift = 0")),
         "top-left alignment"),
    Slip(F, "window ignored", lambda: forward(
        ("hidden = hidden | (keys <= pos - window)", "pass"),
        ("lo = 0 if window is None else max(r0 + shift - window + 1, 0)", "lo = 0")),
         "window ignored"),
    Slip(F, "window off by one", lambda: forward(("keys <= pos - window", "keys < pos - window"),
                                                 ("- window + 1, 0)", "- window, 0)")),
         "window off by one"),
    Slip(F, "range stops one tile early", lambda: forward(
        ("range(lo // Bc * Bc, hi + 1, Bc)", "range(lo // Bc * Bc, hi, Bc)")),
         "Nq=Nk=33", "last K/V tile skipped"),
    Slip(F, "m = the guarded max", lambda: forward(("m = m_next", "m = base")),
         "scores near -120", "the running max must stay the max"),
    Slip(F, "every tile visited", _every_tile, "NaN outside tiles", "visit only the tiles",
         "are NaN, at [", "computed: a K or V row outside the query tile's tiles was read"),
    # 07.online_update
    Slip(O, "old o not reweighted", lambda: online(("o[k] *= share", "o[k] *= 1.0")),
         "old o not reweighted"),
    Slip(O, "new terms weighted by exp(s - max)", lambda: online(
        ("w = math.exp(s[c] - lse_new)", "w = math.exp(s[c] - top)")),
         "new terms not normalised"),
    Slip(O, "lse of the tile alone", lambda: online(
        ("total = math.exp(lse - top)", "total = 0.0")), "lse of the tile alone"),
    Slip(O, "no -inf guard", lambda: online(("if top != NEG_INF:", "if True:")),
         "Nq=30, Nk=12", "missing -inf guard"),
    # 07.causal_skip
    Slip(R, "top-left alignment", lambda: tile_range(("shift = Nk - Nq", "shift = 0")),
         "top-left alignment"),
    Slip(R, "window ignored", lambda: tile_range(
        ("lo = 0 if window is None else max(p_first - window + 1, 0)", "lo = 0")),
         "left of the first row's window"),
    Slip(R, "inclusive end", lambda: tile_range(("hi // Bc + 1", "hi // Bc")),
         "one past the last"),
    Slip(R, "window start off by one", lambda: tile_range(
        ("p_first - window + 1", "p_first - window")), "window off by one"),
    Slip(R, "window start not clipped at 0", lambda: tile_range(
        ("max(p_first - window + 1, 0)", "p_first - window + 1")), "clipped at 0"),
    Slip(R, "empty range not empty", lambda: tile_range(("return 0, 0", "return 0, 1")),
         "empty range"),
]


@pytest.mark.parametrize("slip", NAMED_MISTAKES, ids=repr)
def test_named_mistake(slip):
    slip.fails()


# The solution's full marks, hidden cases too, are checked once, where the solution notebook is
# graded (tests/test_notebooks.py runs every cell and every case of its checks).


# ----------------------------------------------------------------------------- the mask


def test_window_keep_matches_its_picture():
    # Nq = 4, Nk = 7, window = 3: row r (position r + 3) sees keys r + 1 .. r + 3
    keep = ch07.window_keep(4, 7, 3)
    assert keep.int().tolist() == [[0, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0],
                                   [0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1]]
    assert not ch07.window_keep(5, 2, None)[:3].any()  # p < 0: no key
    assert torch.equal(ch07.window_keep(6, 6, None), torch.ones(6, 6, dtype=torch.bool).tril())


# ----------------------------------------------------------------------------- torch forward


def test_torch_forward_full_mask_is_caught(monkeypatch):
    monkeypatch.delenv(grader.GRADING_ENV)  # the visible cases alone must catch it
    r = grader.check(F, _materialising)
    assert r.status == "failed" and "never holds a tensor" in r.message, r.message


def _materialising(Q, K, V, window=None, scale=None, Br=64, Bc=64):
    """The right answer, plus a whole (Nq, Nk) mask built once (and not even used)."""
    Nq, Nk = Q.shape[2], K.shape[2]
    full = torch.ones(Nq, Nk, dtype=torch.bool, device=Q.device)
    O, LSE = forward()(Q, K, V, window=window, scale=scale, Br=Br, Bc=Bc)
    return O + 0 * full.sum(), LSE


def test_guarded_max_trap_scores_are_very_negative():
    case = ch07.C("trap", 1, 1, 64, 64, 16)
    q, k, _ = ch07.very_negative_scores(case)
    S = (q.double() @ k.double().transpose(-2, -1)) / 4
    assert S.max() < -104 and S.min() > -140  # exp(S) underflows float32; exp(S - max) does not


def test_slip_models_differ_from_the_answer():
    """Each model gives a wrong answer on the visible cases that name it (else it names nothing)."""
    case = ch07.C("m", 1, 1, 33, 33, 16)
    q, k, v = ch07.random_qkv(case)
    models = ch07.forward_mistakes(q, k, v, 1, 0.25, 8, 8)
    want = ch07.reference.attention(q, k, v, scale=0.25, mask=ch07.window_keep(33, 33, 1))
    names = {slip.name for slip, wrong in models["O"]
             if not torch.allclose(wrong(), want[0], equal_nan=False)}
    assert {"last K/V tile skipped (off by one at the tile edge)", "window off by one",
            "window ignored"} <= names, names  # top-left: the same mask when Nq = Nk


def test_torch_forward_softmax_is_forbidden():
    def with_softmax(Q, K, V, window=None, scale=None, Br=64, Bc=64):
        S = Q @ K.transpose(-2, -1)
        return torch.softmax(S, -1) @ V, torch.zeros(Q.shape[:3], device=Q.device)

    assert grader.check(F, with_softmax).status == "forbidden"


def test_torch_forward_numpy_is_forbidden():
    def with_numpy(Q, K, V, window=None, scale=None, Br=64, Bc=64):
        S = np.asarray(Q) @ np.asarray(K).swapaxes(-1, -2)
        return torch.from_numpy(S) @ V, torch.zeros(Q.shape[:3])

    assert grader.check(F, with_numpy).status == "forbidden"


def test_torch_forward_stub_is_not_implemented():
    def stub(Q, K, V, window=None, scale=None, Br=64, Bc=64):
        raise NotImplementedError("replace this line with your code")

    assert grader.check(F, stub).status == "not implemented"


# ----------------------------------------------------------------------------- causal skip


def test_causal_skip_brute_force_agrees_with_the_closed_form():
    kv_tile_range = tile_range()
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        Br, Bc = (int(x) for x in torch.randint(1, 6, (2,), generator=g) * 4)
        Nq, Nk = (int(x) for x in torch.randint(1, 90, (2,), generator=g))
        window = None if _ % 2 else int(torch.randint(1, 50, (1,), generator=g))
        for i in range(math.ceil(Nq / Br)):
            want = ch07.visited_tiles(i, Br, Bc, Nq, Nk, window)
            first, end = kv_tile_range(i, Br, Bc, Nq, Nk, window)
            assert list(range(first, end)) == want


def test_causal_skip_wants_a_pair():
    r = grader.check(R, lambda *a: 3)
    assert r.status == "failed" and "pair of ints" in r.message


# ----------------------------------------------------------------------------- online update


def test_online_update_stub_is_not_implemented():
    @cuda.jit
    def stub(Q, K, V, O, LSE, scale, causal):
        raise NotImplementedError("replace this line with your code")

    assert grader.check(O, stub).status == "not implemented"


def test_online_models_agree_with_the_slips_they_name():
    """The float64 models of 07.online_update's slips are what the edited kernels compute."""
    case = ch07.C("m", 1, 1, 24, 24, harness.ONLINE_D)
    q, k, v = ch07.random_qkv(case)
    keep = torch.ones(24, 24, dtype=torch.bool, device=q.device)
    models = dict((slip.name, wrong) for slip, wrong in
                  ch07.online_mistakes(q, k, v, keep, 0.25, harness.ONLINE_BC)["O"])
    slips = {s.name: s for s in NAMED_MISTAKES if s.exercise_id == O}
    for name, slip in (("old o not reweighted", "old o not reweighted"),
                       ("new terms not normalised", "new terms weighted by exp(s - max)"),
                       ("lse of the tile alone", "lse of the tile alone")):
        kernel = slips[slip].make()
        out, lse = torch.full_like(q, math.nan), torch.full(q.shape[:3], math.nan, device=q.device)
        args = [ch07.kernel_array(x) for x in (q, k, v, out, lse)]
        kernel[(math.ceil(24 / harness.ONLINE_BR), 1), harness.ONLINE_BR](
            *args, np.float32(0.25), False)
        ch07.synchronize()
        assert torch.allclose(out.double().cpu(), models[name]().cpu(), atol=1e-4), name


# ----------------------------------------------------------------------------- split-KV combine

COMBINE = r"""
#define NEG_INF __int_as_float(0xff800000)

__global__ void combine_splits(const float* __restrict__ O_parts,
                               const float* __restrict__ LSE_parts, float* __restrict__ O,
                               float* __restrict__ LSE, int n_splits, int rows, int d) {
    const int r = blockIdx.x, t = threadIdx.x;
    if (r >= rows || t >= d) return;
    float M = NEG_INF;
    for (int s = 0; s < n_splits; ++s) M = fmaxf(M, LSE_parts[s * rows + r]);
    float w_sum = 0.f, acc = 0.f;
    for (int s = 0; s < n_splits; ++s) {
        const float w = M == NEG_INF ? 0.f : expf(LSE_parts[s * rows + r] - M);
        w_sum += w;
        acc += w * O_parts[(s * rows + r) * d + t];
    }
    O[r * d + t] = w_sum > 0.f ? acc / w_sum : 0.f;
    if (t == 0) LSE[r] = w_sum > 0.f ? M + logf(w_sum) : NEG_INF;
}
"""


def combine_torch(O_parts, LSE_parts):
    """What the kernel computes, in float32 torch (to check the problems the spec builds)."""
    M = LSE_parts.amax(0)
    M_use = torch.where(M == -math.inf, 0.0, M)
    w = torch.exp(LSE_parts - M_use)
    total = w.sum(0)
    O = torch.where(total[:, None] > 0, (w[..., None] * O_parts).sum(0) / total[:, None], 0.0)
    return O, torch.where(total > 0, M_use + torch.log(total), -math.inf)


@pytest.mark.parametrize(("rows", "Nk", "d", "splits", "logits"), [
    (8, 256, 64, 4, 1.0), (50, 40, 32, 3, 1.0), (8, 300, 128, 5, 30.0), (20, 8, 16, 2, 1.0),
    (3, 1000, 128, 16, 1.0)])  # fmt: skip
def test_combine_problems_are_what_the_combine_gives(rows, Nk, d, splits, logits):
    problem = ch07_combine._combine_problem(rows, Nk, d, splits, logits)
    (O_parts, LSE_parts), (O, LSE), max_score = problem
    got_O, got_LSE = combine_torch(O_parts, LSE_parts)
    atol, rtol = grader_tolerance(max_score)
    assert bool(torch.isneginf(LSE_parts).any()) == (rows > Nk)  # empty splits
    ch07.compare("O", got_O, O, atol=atol, rtol=rtol)
    ch07.compare("LSE", got_LSE, LSE, atol=atol, rtol=rtol)


def grader_tolerance(max_score):
    return ch07.tolerance(torch.float32, max_score)


def test_combine_scores_on_either_machine():
    """On a GPU the real build runs; on a CPU the same body under the thread-model emulation."""
    r = grader.check("07.combine_splits", COMBINE)
    assert r.status == "passed" and r.score == r.points, r.message


def test_combine_compile_error_is_shown():
    r = grader.check("07.combine_splits", COMBINE.replace("fmaxf(M,", "fmaxf(M"))
    assert r.status == "failed" and "does not compile" in r.message


def test_combine_wrong_name_is_named():
    r = grader.check("07.combine_splits", COMBINE.replace("combine_splits(", "combine("))
    assert r.status == "failed" and "combine_splits" in r.message


def test_combine_placeholder_is_not_implemented():
    stub = "__global__ void combine_splits() {\n// YOUR CODE HERE\n}"
    r = grader.check("07.combine_splits", stub)
    assert r.status == "not implemented"


def test_combine_without_a_cuda_compiler_still_scores_on_a_cpu(monkeypatch):
    """No nvcc or NVRTC: the CPU emulation (g++) still decides the values."""
    if ch07_combine.on_gpu():
        pytest.skip("on a GPU the kernel is compiled and run by NVRTC")

    def no_compiler(*args, **kwargs):
        raise RuntimeError("resource_usage needs a CUDA compiler and found none: install one")

    monkeypatch.setattr(ch07_combine, "compiled_resources", no_compiler)
    r = grader.check("07.combine_splits", COMBINE + "\n// no compiler\n")
    assert r.status == "passed", r.message


def _emulated_gpu(monkeypatch, bug=None):
    """The GPU path of 07.combine_splits on a CPU: NVRTC replaced by a torch emulation."""
    import course_utils.toolbox.cuda

    def launch(grid, block, O_parts, LSE_parts, O, LSE, n_splits, rows, d):
        assert grid == (rows,) and block == (d,) and O_parts.shape == (n_splits, rows, d)
        if bug == "no max":
            w = torch.exp(LSE_parts)
            got_O, got_LSE = (w[..., None] * O_parts).sum(0) / w.sum(0)[:, None], w.sum(0).log()
        else:
            got_O, got_LSE = combine_torch(O_parts, LSE_parts)
            if bug == "nan when empty":
                got_O[torch.isneginf(LSE_parts.amax(0))] = math.nan
        O.copy_(got_O)
        LSE.copy_(got_LSE)

    monkeypatch.setattr(course_utils.toolbox.cuda, "compile_kernel", lambda source, name: launch)
    monkeypatch.setattr(harness, "_compiled", {})
    monkeypatch.setattr(ch07_combine, "on_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


def test_combine_gpu_path_passes_a_right_kernel(monkeypatch):
    _emulated_gpu(monkeypatch)
    r = grader.check("07.combine_splits", COMBINE)
    assert r.status == "passed" and r.hidden_run, r.message


@pytest.mark.parametrize(("bug", "case"), [("no max", "std 100"),
                                           ("nan when empty", "rows=50 > Nk=40")])
def test_combine_gpu_path_catches_bugs(monkeypatch, bug, case):
    monkeypatch.delenv(grader.GRADING_ENV)  # the visible cases alone must catch it
    _emulated_gpu(monkeypatch, bug)
    r = grader.check("07.combine_splits", COMBINE)
    assert r.status == "failed" and case in r.message, r.message
