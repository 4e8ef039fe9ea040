"""course::kv_cache_write (course_utils/library/kv_cache.py): a mutating custom op.

The write against an out-of-place reference (skipped slots, int32 slots, strided caches and
inputs), torch.library.opcheck, torch.compile(fullgraph=True): the captured graph holds
auto_functionalized and Inductor's output code calls the op in place on the caches with no copy;
what goes wrong without ``mutates_args`` (opcheck's schema error, and a compiled call that drops
the write); the clear errors for bad input. CPU mode runs the PyTorch path; a GPU the Triton
kernel, and also CUDA-graph capture (reduce-overhead) with the caches as buffers.
"""

import re

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.utils import run_and_get_code

import course_utils as cu
from course_utils import kv_cache

DEV = cu.device()
DTYPE = cu.pick(gpu=torch.bfloat16, cpu=torch.float32)
P, S, H, D, T = 6, 16, 2, 16, 9


def _problem(seed=0, dtype=DTYPE, slot_dtype=torch.int64, T=T):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(T, H, D, generator=gen).to(dtype).to(DEV)
    v = torch.randn(T, H, D, generator=gen).to(dtype).to(DEV)
    slots = torch.randperm(P * S, generator=gen)[:T]
    slots[::4] = -1  # every fourth token skipped (padding)
    k_cache = torch.randn(P, S, H, D, generator=gen).to(dtype).to(DEV)
    v_cache = torch.randn(P, S, H, D, generator=gen).to(dtype).to(DEV)
    return k_cache, v_cache, k, v, slots.to(slot_dtype).to(DEV)


def _expected(k_cache, v_cache, k, v, slots):
    """Token by token, in Python: the definition the op must meet."""
    kc, vc = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            kc[slot // S, slot % S] = k[t]
            vc[slot // S, slot % S] = v[t]
    return kc, vc


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_write_matches_the_definition(slot_dtype):
    kc, vc, k, v, slots = _problem(slot_dtype=slot_dtype)
    want_k, want_v = _expected(kc, vc, k, v, slots)
    ref_k, ref_v = kv_cache.kv_cache_write_reference(kc, vc, k, v, slots)
    assert torch.equal(ref_k, want_k) and torch.equal(ref_v, want_v)
    assert kv_cache.kv_cache_write(kc, vc, k, v, slots) is None  # in place, returns nothing
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_strided_caches_and_inputs():
    """A cache that is a view (heads sliced out of a bigger buffer) and k, v transposed views."""
    kc, vc, k, v, slots = _problem(seed=1)
    big_k = torch.zeros(P, S, 2 * H, D, dtype=DTYPE, device=DEV)
    big_v = torch.zeros(P, S, 2 * H, D, dtype=DTYPE, device=DEV)
    view_k, view_v = big_k[:, :, 1::2], big_v[:, :, 1::2]  # every other head: not contiguous
    k_t = k.transpose(0, 1).contiguous().transpose(0, 1)  # (T, H, d) with H outermost in memory
    want_k, want_v = _expected(view_k, view_v, k, v, slots)
    kv_cache.kv_cache_write(view_k, view_v, k_t, v, slots)
    assert torch.equal(view_k, want_k) and torch.equal(view_v, want_v)
    assert not big_k[:, :, 0::2].any(), "wrote outside the view"


def test_no_tokens_and_all_skipped():
    kc, vc, k, v, slots = _problem()
    before = kc.clone()
    kv_cache.kv_cache_write(kc, vc, k[:0], v[:0], slots[:0])
    kv_cache.kv_cache_write(kc, vc, k, v, torch.full_like(slots, -1))
    assert torch.equal(kc, before)


def test_opcheck():
    kc, vc, k, v, slots = _problem()
    result = torch.library.opcheck(kv_cache.kv_cache_write, (kc, vc, k, v, slots))
    assert set(result.values()) == {"SUCCESS"}, result


def test_schema_declares_the_mutation():
    schema = str(torch.ops.course.kv_cache_write.default._schema)
    assert "Tensor(a0!) k_cache" in schema and "Tensor(a1!) v_cache" in schema, schema
    assert schema.endswith("-> ()"), schema


def _write_then_read(kc, vc, k, v, slots):
    kv_cache.kv_cache_write(kc, vc, k, v, slots)
    return kc.float().sum() + vc.float().sum()


def test_compiled_graph_auto_functionalized_then_in_place():
    kc, vc, k, v, slots = _problem()
    want_k, want_v = _expected(kc, vc, k, v, slots)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    a, b = kc.clone(), vc.clone()
    torch.compile(_write_then_read, backend=aot_autograd(fw_compiler=keep), fullgraph=True)(
        a, b, k, v, slots)
    assert torch.equal(a, want_k) and torch.equal(b, want_v)
    assert "auto_functionalized" in graphs[0], graphs[0]  # functional in the captured graph

    torch._dynamo.reset()
    a, b = kc.clone(), vc.clone()
    out, codes = run_and_get_code(torch.compile(_write_then_read, fullgraph=True),
                                  a, b, k, v, slots)
    code = "\n".join(codes)
    assert torch.equal(a, want_k) and torch.equal(b, want_v)
    assert float(out) == pytest.approx(float(want_k.float().sum() + want_v.float().sum()),
                                       rel=1e-5)
    assert "torch.ops.course.kv_cache_write.default(arg0_1, arg1_1" in code  # re-inplaced
    assert "auto_functionalized" not in code
    copies = [ln for ln in code.splitlines() if not ln.strip().startswith("#")
              and re.search(r"(copy_|clone)\(", ln) and re.search(r"arg[01]_1\b", ln)]
    assert not copies, copies


def test_without_mutates_args_the_write_is_lost():
    @torch.library.custom_op("course_test::kv_write_undeclared", mutates_args=())
    def undeclared(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        kv_cache.kv_cache_write(k_cache, v_cache, k, v, slot_mapping)

    undeclared.register_fake(lambda *args: None)
    kc, vc, k, v, slots = _problem()
    with pytest.raises(Exception, match="not defined as mutable but was mutated"):
        torch.library.opcheck(undeclared, (kc.clone(), vc.clone(), k, v, slots))

    def write(kc, vc, k, v, slots):
        undeclared(kc, vc, k, v, slots)
        return kc.float().sum()

    torch._dynamo.reset()
    a = kc.clone()
    torch.compile(write, fullgraph=True)(a, vc.clone(), k, v, slots)
    assert torch.equal(a, kc), "the compiler kept the call: update the lecture's story"


def test_bad_input_errors():
    kc, vc, k, v, slots = _problem()
    cases = [
        ((kc[0], vc[0], k, v, slots), ValueError, "num_pages, page_size, Hkv, d"),
        ((kc, vc[:, :, :1], k, v, slots), ValueError, "the same shape"),
        ((kc, vc, k[:, :1], v[:, :1], slots), ValueError, r"\(T, Hkv, d\)"),
        ((kc, vc, k, v, slots[:-1]), ValueError, "one slot per token"),
        ((kc, vc, k, v, slots.float()), TypeError, "int64 or int32"),
        ((kc, vc, k.double(), v.double(), slots), TypeError, "the caches' dtype"),
        ((kc, vc, k, v, slots.to("meta")), ValueError, "one device"),
        # the dispatcher checks the schema's types first, with a clear message of its own
        ((kc, vc, k, v, slots.tolist()), RuntimeError, "Expected a value of type 'Tensor'"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            kv_cache.kv_cache_write(*args)
    for bad in (P * S, -2):
        s = slots.clone()
        s[1] = bad
        with pytest.raises(ValueError, match=rf"slot_mapping\[1\] = {bad}"):
            kv_cache.kv_cache_write(kc, vc, k, v, s)


def test_errors_while_compiling():
    """The fake checks metadata: a bad shape fails while tracing, before any data is read."""
    kc, vc, k, v, slots = _problem()
    torch._dynamo.reset()
    with pytest.raises(Exception, match="one slot per token"):
        torch.compile(_write_then_read, fullgraph=True)(kc, vc, k, v, slots[:-1])


@pytest.mark.skipif(not cu.on_gpu(), reason="CUDA graphs need a GPU")
def test_reduce_overhead_with_cache_buffers():
    kc, vc, k, v, slots = _problem()
    want_k, want_v = _expected(kc, vc, k, v, slots)

    class Cache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("k_cache", kc.clone())
            self.register_buffer("v_cache", vc.clone())

        def forward(self, k, v, slots):
            kv_cache.kv_cache_write(self.k_cache, self.v_cache, k, v, slots)
            return self.k_cache.float().sum()

    torch._dynamo.reset()
    cache = Cache()
    step = torch.compile(cache, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        torch.compiler.cudagraph_mark_step_begin()
        step(k, v, slots)
    torch.cuda.synchronize()
    assert torch.equal(cache.k_cache, want_k) and torch.equal(cache.v_cache, want_v)
