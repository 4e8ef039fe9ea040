"""The sandbox's codec: what crosses between the grader and a notebook, and what cannot."""

import time

import numpy as np
import pytest
import torch

from course_utils import checks, sandbox


def round_trip(value):
    """Encode as the grader does, decode as the worker does; return the decoded value."""
    enc = sandbox._Encoder()
    header, buffers = enc.message({"v": enc.enc(value)})
    return sandbox._Decoder(header["regions"], buffers).dec(header["v"]), enc


def test_plain_values_cross_unchanged():
    value = (None, True, 3, -2**70, 1.5, float("inf"), "s", b"\x00\xff", [1, (2,)],
             {"a": 1, 2: "b"}, torch.float16, torch.device("cpu"), np.float32(0.1))
    got, _ = round_trip(value)
    assert got[:12] == value[:12]
    assert got[12] == np.float32(0.1) and got[12].dtype == np.float32


def test_nan_crosses_as_nan():
    got, _ = round_trip(float("nan"))
    assert got != got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
def test_tensor_views_keep_strides_offsets_and_sharing(dtype):
    base = torch.arange(60).to(dtype).reshape(6, 10)
    a, b = base[1:, ::2], base.t()
    (ga, gb), _ = round_trip((a, b))
    assert ga.stride() == a.stride() and ga.storage_offset() == a.storage_offset()
    assert torch.equal(ga, a) and torch.equal(gb, b)
    assert ga.untyped_storage().data_ptr() == gb.untyped_storage().data_ptr()  # still aliased


def test_a_write_past_a_guarded_view_comes_back():
    out, buffer = checks.guarded((4,))
    enc = sandbox._Encoder()
    header, buffers = enc.message({"v": enc.enc((out,))})
    dec = sandbox._Decoder(header["regions"], buffers)
    (remote_out,) = dec.dec(header["v"])
    remote_full = dec.views[0]
    remote_out.fill_(1.0)
    remote_full.view(torch.float32)[5] = 7.0  # one element past the end of out
    back = [v.cpu() for v in dec.views]
    for owner, raw in zip(enc.owners, back, strict=True):
        owner.copy_(raw.to(owner.device))
    assert torch.equal(out.cpu(), torch.ones(4)) and buffer[5] == 7.0


def test_numpy_views_of_tensors_share_the_tensor_storage():
    t = torch.zeros(8)
    arr = t[2:6].numpy()
    (got_t, got_a), enc = round_trip((t, arr))
    assert len(enc.regions) == 1
    got_a[0] = 5.0
    assert got_t[2] == 5.0


@pytest.mark.parametrize(
    "bad", [object(), lambda: 1, np.array([object()]), torch.randn(2).to_sparse()]
)
def test_objects_that_are_not_data_are_refused_with_a_reason(bad):
    with pytest.raises(TypeError, match="cannot"):
        round_trip(bad)


def test_subclass_behaviour_does_not_cross():
    class Liar(torch.Tensor):
        pass

    got, _ = round_trip(torch.zeros(3).as_subclass(Liar))
    assert type(got) is torch.Tensor


@pytest.mark.parametrize("header", [
    {"t": "tensor", "r": 0, "dtype": "float32", "shape": [100], "stride": [1], "offset": 0},
    {"t": "tensor", "r": 0, "dtype": "object", "shape": [1], "stride": [1], "offset": 0},
    {"t": "tensor", "r": 5, "dtype": "float32", "shape": [1], "stride": [1], "offset": 0},
    {"t": "ndarray", "r": 0, "dtype": "|O", "shape": [1], "strides": [8], "offset": 0},
    {"t": "ndarray", "r": 0, "dtype": "<f4", "shape": [100], "strides": [4], "offset": 0},
    {"t": "pickle", "v": "..."},
    [1, 2],
])
def test_malformed_or_hostile_messages_are_rejected(header):
    regions = [{"kind": "torch", "device": "cpu", "nbytes": 16, "sent": True}]
    with pytest.raises((sandbox.ProtocolError, RuntimeError)):
        sandbox._Decoder(regions, [bytes(16)]).dec(header)


def test_a_flood_of_values_is_refused_on_both_sides_before_it_costs_time():
    flood = [("wait", 0)] * sandbox.MAX_ITEMS
    with pytest.raises(sandbox.Unsendable, match="tensor or an array"):
        round_trip(flood)  # the honest worker refuses to encode it
    header = {"t": "list", "v": [{"t": "tuple", "v": ["wait", 0]}] * sandbox.MAX_ITEMS}
    start = time.monotonic()
    with pytest.raises(sandbox.Unsendable, match="more than"):
        sandbox._Decoder([], []).dec(header)  # a hostile one that skips it: the grader refuses
    assert time.monotonic() - start < 2.0
    got, _ = round_trip([("wait", 0)] * 1000)  # a real schedule crosses
    assert got[-1] == ("wait", 0)


def test_framing_round_trip_and_size_limit():
    import os

    r, w = os.pipe()
    sandbox.send(w, {"x": 1}, [b"abc", np.arange(3, dtype=np.uint8)])
    header, buffers = sandbox._Reader(r, 1 << 20).recv()
    assert header["x"] == 1 and buffers == [b"abc", bytes([0, 1, 2])]
    sandbox.send(w, {"x": 2}, [bytes(2048)])
    with pytest.raises(sandbox.ProtocolError, match="MiB"):
        sandbox._Reader(r, 1024).recv()
    os.close(r)
    os.close(w)


gpu_only = pytest.mark.skipif("not __import__('course_utils').on_gpu()", reason="needs a GPU")


@gpu_only
def test_cuda_tensors_and_kernel_arrays_cross_on_the_gpu():
    from course_utils import runtime

    base = torch.arange(32, dtype=torch.float32, device="cuda").reshape(4, 8)
    view = base[1:, 2:]
    arr = runtime.kernel_array(base)
    (got_view, got_arr), enc = round_trip((view, arr))
    assert got_view.is_cuda and got_view.stride() == view.stride()
    assert torch.equal(got_view, view)
    assert len(enc.regions) == 1  # the kernel array is the same storage as the view
    assert hasattr(got_arr, "__cuda_array_interface__") and not isinstance(got_arr, torch.Tensor)


# ----------------------------------------------------------------------------- layouts

def _grader_decode(header, nbytes=1024):
    """Decode ``header`` as the grader decodes what a notebook sent (strict layouts)."""
    regions = [{"kind": "torch", "device": "cpu", "nbytes": nbytes, "sent": True}]
    return sandbox._Decoder(regions, [bytes(nbytes)], strict=True).dec(header)


@pytest.mark.parametrize("shape, stride, why", [
    ([1 << 30], [0], "repeats memory"),  # a 4-byte tensor expanded to 2**30 elements
    ([4, 4], [1, 1], "repeats memory"),  # overlapping rows
    ([1 << 20, 1 << 10], [1, 1], "repeats memory|outside"),
    ([4, 5], [4, 1], "repeats memory"),  # rows of 5 at a pitch of 4
    ([257], [1], "outside"),  # past the storage's 256 floats
    ([2, 2], [1000, 1], "outside"),
])
def test_the_grader_refuses_views_that_repeat_or_leave_their_memory(shape, stride, why):
    import time

    start = time.monotonic()
    header = {"t": "tensor", "r": 0, "dtype": "float32", "shape": shape, "stride": stride,
              "offset": 0}
    with pytest.raises(sandbox.ProtocolError, match=why):
        _grader_decode(header)
    assert time.monotonic() - start < 0.5  # refused before anything is built


@pytest.mark.parametrize("shape, stride, offset", [
    ([4, 4], [4, 1], 0), ([4, 4], [1, 4], 0), ([2, 3], [8, 2], 1), ([1, 16], [0, 1], 0),
    ([0, 5], [0, 0], 0), ([16, 1], [1, 1], 0),
])
def test_the_grader_accepts_plain_views(shape, stride, offset):
    header = {"t": "tensor", "r": 0, "dtype": "float32", "shape": shape, "stride": stride,
              "offset": offset}
    got = _grader_decode(header)
    assert list(got.shape) == shape


def test_the_worker_may_receive_expanded_inputs():
    """Only the grader is strict: what it sends (e.g. a broadcast mask) keeps its strides."""
    got, _ = round_trip(torch.zeros(1).expand(8))
    assert got.stride() == (0,) and got.shape == (8,)


def test_negative_numpy_strides_are_views_not_repeats():
    header = {"t": "ndarray", "r": 0, "dtype": "<f4", "shape": [16], "strides": [-4],
              "offset": 60}  # the first 16 floats, backwards
    got = _grader_decode(header)
    assert got.shape == (16,)
    header["strides"] = [0]
    with pytest.raises(sandbox.ProtocolError, match="repeats memory"):
        _grader_decode(header)


# ----------------------------------------------------------------------------- workers

needs_landlock = pytest.mark.skipif(sandbox.landlock_abi() < 1, reason="no Landlock here")


def _started(tmp_path, protected):
    keep = frozenset(sandbox.descendants(__import__("os").getpid()))
    return sandbox.start_worker(tmp_path, {"cells": []}, sandbox.Limits(), keep, protected)


@needs_landlock
def test_each_start_gets_fresh_folders_and_a_verified_lock(tmp_path):
    course = str(sandbox.PACKAGE.parent)
    first = _started(tmp_path, [course])
    second = _started(tmp_path, [course])
    try:
        assert first.verified and second.verified, (first.isolation, second.isolation)
        assert "verified:" in first.isolation and "landlock abi" in first.isolation
        assert "seccomp: sockets denied" in first.isolation
        assert first.package != second.package and first.scratch != second.scratch
        assert not (first.package / "course_utils" / "grading" / "specs").exists()
        assert all(not (p.stat().st_mode & 0o222)
                   for p in (first.package / "course_utils").rglob("*"))
    finally:
        first.stop()
        second.stop()
    assert not first.package.exists() and not first.scratch.exists()


def test_an_unlocked_worker_is_reported_as_not_isolated(tmp_path):
    """Without the lock the probe's writes land, and the report says so (observed outside)."""
    worker = _started(tmp_path, None)
    try:
        assert not worker.verified
        assert "NOT isolated" in worker.isolation and "wrote" in worker.isolation
        assert not list(tmp_path.glob("probe-*")), "the grader removes what the probe wrote"
    finally:
        worker.stop()


def test_verification_judges_reads_by_their_content(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"the answer")
    probe = {"read": [str(secret)], "write": [str(tmp_path / "w")]}

    class Quiet:
        def received(self):
            return []

    read_it = {"probe": {"read": {str(secret): b"the answer".hex()}}}
    ok, why = sandbox.verify_isolation(read_it, probe, Quiet(), requested=True)
    assert not ok and f"read {secret}" in why
    lied = {"probe": {"read": {str(secret): "refused (Permission denied)"}}}
    (tmp_path / "w").write_text("x")  # the write landed, whatever the worker says
    ok, why = sandbox.verify_isolation(lied, probe, Quiet(), requested=True)
    assert not ok and "wrote" in why and not (tmp_path / "w").exists()
