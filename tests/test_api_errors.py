"""Clear errors for inputs that used to crash deep inside torch or be silently misread (issue 14,
"Kernels and API"): a non-bool ``causal`` given to the Triton kernels, ``meta`` tensors, head
dim 0 in the reference and the attention cases, a string tolerance, a negative max score,
``load_cuda(functions=None)`` and ``time_fn(rep=True)``. Each error names the value and says
what to pass instead. All run on the CPU.
"""

import pytest
import torch

import course_utils as cu
from course_utils import bench, checks, reference
from course_utils import cuda as C
from course_utils.library.kernels import flash_attention_triton as fat

DEV = cu.device()
DTYPE = cu.pick(gpu=torch.float16, cpu=torch.float32)


def _qkv(B=1, H=2, N=8, d=16, device=DEV):
    return tuple(torch.randn(B, H, N, d).to(device, DTYPE) for _ in range(3))


# ---------------------------------------------------------------------------------------------
# Triton FlashAttention: causal must be a bool; meta tensors are refused up front
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", ["no", "False", None, 2, 0.5, torch.tensor(True)],
                         ids=repr)
def test_non_bool_causal_is_a_type_error_naming_the_value(causal):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"causal=.* pass True .* or False"):
        fat.flash_attention_triton(q, k, v, causal=causal)
    with pytest.raises(TypeError, match=r"causal="):
        fat.attention_forward(q, k, v, causal)
    if isinstance(causal, str):
        with pytest.raises(TypeError, match=repr(causal)):
            fat.flash_attention_triton(q, k, v, causal=causal)


def test_bool_like_causal_still_works():
    q, k, v = _qkv()
    for causal in (True, False, 1, 0):
        O = fat.flash_attention_triton(q, k, v, causal=causal)
        O_ref, _ = reference.attention(q, k, v, causal=bool(causal))
        checks.compare("O", O, O_ref, case=f"causal={causal!r}",
                       atol=checks.tolerance(q.dtype, 10.0)[0], rtol=checks.tolerance(q.dtype)[1])


def test_meta_tensors_are_a_clear_value_error():
    q, k, v = _qkv(device="meta")
    with pytest.raises(ValueError, match=r"device 'meta', which holds no data: the kernels run "
                                         r"on .* device=course_utils.device\(\)"):
        fat.flash_attention_triton(q, k, v)
    with pytest.raises(ValueError, match="'meta'"):
        fat.attention_forward(q, k, v)


# ---------------------------------------------------------------------------------------------
# Head dim 0: ValueError naming d, not ZeroDivisionError
# ---------------------------------------------------------------------------------------------


def test_reference_attention_with_head_dim_0_names_d():
    q, k, v = torch.randn(4, 0), torch.randn(5, 0), torch.randn(5, 3)
    with pytest.raises(ValueError, match="head dim d=0"):
        reference.attention(q, k, v)
    with pytest.raises(ValueError, match="d=0"):
        reference.attention(q[None, None], k[None, None], v[None, None], scale=1.0)


@pytest.mark.parametrize("d", [0, -4, 2.5, True], ids=repr)
def test_attention_cases_with_a_bad_head_dim_names_d(d):
    with pytest.raises(ValueError, match=rf"d={d!r}: the head dimension must be an int >= 1"):
        checks.attention_cases(d=d, sizes="small")


# ---------------------------------------------------------------------------------------------
# checks.compare / checks.tolerance
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{"atol": "x"}, {"rtol": "1e-3"}, {"atol": True},
                                {"atol": [1e-3]}], ids=repr)
def test_compare_with_a_non_number_tolerance_is_a_type_error(kw):
    x = torch.zeros(3)
    name = next(iter(kw))
    with pytest.raises(TypeError, match=rf"{name}=.*the tolerance must be a number"):
        checks.compare("O", x, x.double(), **kw)


def test_compare_with_a_negative_tolerance_is_a_value_error():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match=r"atol=-1e-05: a tolerance must be >= 0"):
        checks.compare("O", x, x.double(), atol=-1e-5)


def test_compare_with_number_tolerances_still_works():
    x = torch.zeros(3)
    checks.compare("O", x, x.double(), atol=0, rtol=1e-3)
    checks.compare("O", x, x.double(), atol=torch.tensor(1e-3).item())


@pytest.mark.parametrize("max_score", [-1.0, float("nan"), float("inf")], ids=repr)
def test_tolerance_with_a_negative_or_non_finite_max_score_is_a_value_error(max_score):
    with pytest.raises(ValueError, match=r"max_score=.*a finite number >= 0"):
        checks.tolerance(torch.float32, max_score)


def test_tolerance_with_a_non_number_max_score_is_a_type_error():
    with pytest.raises(TypeError, match=r"max_score='3': expected a number"):
        checks.tolerance(torch.float32, "3")
    assert checks.tolerance(torch.float32, 0) == checks.tolerance(torch.float32)


# ---------------------------------------------------------------------------------------------
# load_cuda(functions=None), time_fn(rep=True)
# ---------------------------------------------------------------------------------------------

SRC = "#include <torch/types.h>\ntorch::Tensor twice(torch::Tensor x) { return 2 * x; }\n"


@pytest.mark.parametrize("functions", [None, 3, {"twice"}], ids=repr)
def test_load_cuda_without_a_list_of_names_is_a_clear_type_error(functions):
    with pytest.raises(TypeError, match=r"load_cuda: functions=.*e.g. load_cuda\(path, "):
        C.load_cuda(SRC, functions)


def test_load_cuda_with_a_non_string_name_is_a_clear_type_error():
    with pytest.raises(TypeError, match=r"functions holds None \(NoneType\): every entry"):
        C.load_cuda(SRC, ["twice", None])


@pytest.mark.parametrize("name", ["rep", "warmup"])
@pytest.mark.parametrize("value", [True, False, 2.0, "5"], ids=repr)
def test_time_fn_with_a_non_int_count_is_a_type_error(name, value):
    with pytest.raises(TypeError, match=rf"{name}={value!r} .*a number of calls, an int"):
        bench.time_fn(lambda: None, **{name: value})


def test_time_fn_with_a_negative_count_is_still_a_value_error():
    with pytest.raises(ValueError, match="rep must be None or an int >= 0"):
        bench.time_fn(lambda: None, rep=-1)
