"""Compression on the wire: 16-bit payloads and pulls, top-k with error feedback (no MPI)."""

import numpy as np
import pytest
import torch

from hpcps.errors import UserError
from hpcps.transport.compress import Codec, Half, TopK, make_codec

BOUNDS = [(0, 600), (600, 1000)]  # two shards' slices of a 1000-value vector


def _grad(seed, n=1000):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-3, 1, n)


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_a_16_bit_push_is_half_the_bytes_and_the_shard_reads_the_rounded_gradient(name, dtype):
    codec, plain = make_codec(name), make_codec("none")
    g = _grad(0)
    out = codec.new_push_buffer(BOUNDS)
    assert out.nbytes * 2 == plain.new_push_buffer(BOUNDS).nbytes
    codec.encode(g, out, BOUNDS)
    for (lo, hi), (a, b) in zip(BOUNDS, codec.push_bounds(BOUNDS)):
        seen = codec.gradient(out[a:b], hi - lo)
        assert seen.dtype == dtype and torch.equal(seen, g[lo:hi].to(dtype))  # torch's round to nearest even
        assert torch.equal(codec.values(out[a:b]), seen)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_a_16_bit_slot_holds_the_rounded_parameters_and_a_pull_widens_them_exactly(name):
    codec = make_codec(name)
    params = _grad(1).numpy()
    slot = np.empty(len(params), codec.pull_dtype)
    codec.encode_params(params, slot)
    out = np.empty(len(params), np.float32)
    codec.decode_params(slot, out)
    expected = torch.from_numpy(params).to(codec.torch_dtype).float().numpy()
    assert slot.nbytes * 2 == params.nbytes
    assert np.array_equal(out, expected) and not np.array_equal(out, params)


def test_without_compression_payloads_and_slots_are_the_fp32_values():
    codec = make_codec("none")
    assert type(codec) is Codec and codec.identity_push and codec.identity_pull
    g = _grad(2)
    out = codec.new_push_buffer(BOUNDS)
    codec.encode(g, out, BOUNDS)
    assert np.array_equal(out, g.numpy()) and torch.equal(codec.gradient(out[:600], 600), g[:600])


def _sent(codec, out, bounds):
    """The dense vector a top-k push carries (as the shards see it, slice by slice)."""
    return torch.cat([codec.gradient(out[a:b], hi - lo) for (lo, hi), (a, b) in zip(bounds, codec.push_bounds(bounds))])


def test_topk_sends_the_largest_of_each_slice_and_conserves_the_gradient_mass_exactly():
    codec = TopK(0.05)
    out = codec.new_push_buffer(BOUNDS)
    assert len(out) == 2 * (30 + 20)  # k = ceil(0.05 n) indices and values per slice
    total_sent, total_grad = torch.zeros(1000, dtype=torch.float64), torch.zeros(1000, dtype=torch.float64)
    for step in range(20):
        g = _grad(10 + step)
        before = codec.residual.clone() if codec.residual is not None else torch.zeros(1000)
        codec.encode(g, out, BOUNDS)
        sent = _sent(codec, out, BOUNDS)
        # elementwise and exactly: sent + residual = residual before + gradient (one fp32 addition)
        assert torch.equal(sent + codec.residual, before + g)
        assert torch.equal((sent != 0) & (codec.residual != 0), torch.zeros(1000, dtype=torch.bool))
        for (lo, hi) in BOUNDS:  # what went is the largest in magnitude of its slice
            acc = (before + g)[lo:hi].abs()
            k = codec.k(hi - lo)
            assert int((sent[lo:hi] != 0).sum()) == k
            assert acc[sent[lo:hi] != 0].min() >= acc[sent[lo:hi] == 0].max()
        total_sent += sent.double()
        total_grad += g.double()
    # over the run: everything sent plus what is still held is every gradient pushed, none lost or twice
    assert torch.allclose(total_sent + codec.residual.double(), total_grad, rtol=0, atol=1e-5)


def test_topk_leaves_the_residual_alone_for_a_non_finite_gradient_or_a_skipped_step():
    codec = TopK(0.1)
    out = codec.new_push_buffer(BOUNDS)
    codec.encode(_grad(3), out, BOUNDS)
    held = codec.residual.clone()
    bad = _grad(4)
    bad[700] = float("nan")
    codec.encode(bad, out, BOUNDS)
    assert torch.equal(codec.residual, held)
    a, b = codec.push_bounds(BOUNDS)[1]
    assert not torch.isfinite(codec.values(out[a:b])).all()  # the shard sees the NaN and drops the push
    codec.encode(_grad(5), out, BOUNDS, keep=False)
    assert torch.equal(codec.residual, held)


@pytest.mark.parametrize("spec", ["zip", "topk:0", "topk:1", "topk:x", "bf8", "topk:"])
def test_unknown_compression_is_a_user_error_naming_the_choices(spec):
    with pytest.raises(UserError, match="expected none, bf16, fp16 or topk:RATIO"):
        make_codec(spec)


def test_the_names_the_run_file_records():
    assert make_codec("topk:0.010").name == "topk:0.01"
    assert isinstance(make_codec("bf16"), Half)
    assert make_codec("bf16").describe() == {"name": "bf16", "push_bytes_per_value": 2.0, "pull_bytes_per_value": 2}
