"""vLLM's causal_conv1d tests, ported onto kvjax's ``causal_conv1d_update`` and
``causal_conv1d_varlen``.

Source: vllm-project/vllm, ``tests/kernels/mamba/test_causal_conv1d.py`` at commit
384eafa32628024ea6819bd9a81f4151fc13d823 (``test_causal_conv1d_update``,
``test_causal_conv1d_update_with_batch_gather``, ``test_causal_conv1d_varlen``). The test
logic and the torch references are re-written here; no peer code is copied.

Convention switched on: vLLM pads state indices with ``PAD_SLOT_ID = -1`` and uses row 0
like any other, so kvjax runs with ``null_block_id=PAD_SLOT_ID`` (kvjax's default
reserves row 0). vLLM's varlen batch is ``query_start_loc``'s: with ``seqlen=8`` its
data has 8 sequences for 10 or 13 ``cache_indices``, the rows past the sequences
being padding (kvjax accepts that since issue 26).

Kept: vLLM's data construction (``torch.manual_seed(0)``, the random split points,
the strided-channel inputs, random conv states), the torch references (conv in the
weight dtype), the assertions (``torch.equal`` on written and untouched states,
``allclose`` on outputs) and tolerances (bf16: ``rtol=1e-2, atol=5e-2``; float32:
``rtol=3e-4, atol=1e-3``).

Sized for CI (the rest behind ``KVJAX_PEER_SLOW=1``, with the interpreted flavours of
the update; the varlen op has only a reference): update, dim 2064 without activation and
bias and with both; batch gather, dim 2064, float32 / seqlen 1 / width 3 and bf16 /
seqlen 3 / width 3 (activation, bias, padding rotating); varlen, dim 64, seqlen 8 with
batch 10 (8 sequences for 10 or 13 cache indices) with and without padding, and seqlen
249 with batch 4 and padding. Every other case of vLLM's products runs with the slow switch.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from _flavours import flavours, slow
from kvjax.constants import PAD_SLOT_ID
from pallas_kernels import causal_conv1d_update, causal_conv1d_varlen

TORCH_TO_NP = {torch.float32: np.float32, torch.bfloat16: ml_dtypes.bfloat16}


def tol(itype):
    return (1e-2, 5e-2) if itype == torch.bfloat16 else (3e-4, 1e-3)


def to_jax(t):
    """A torch tensor as a contiguous jnp array of the same dtype (bf16 exactly)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy().astype(ml_dtypes.bfloat16))
    return jnp.asarray(t.numpy())


def to_torch(a, dtype):
    return torch.from_numpy(np.asarray(a).astype(np.float32)).to(dtype)


def conv_ref(x, weight, bias, initial_states, activation):
    """Causal depthwise conv of one sequence ``x [1, dim, L]`` (vLLM's ``causal_conv1d_ref``):
    returns ``(out, final_states [1, dim, width-1])``, both in ``x``'s dtype."""
    dtype_in = x.dtype
    x = x.to(weight.dtype)
    seqlen, width = x.shape[-1], weight.shape[1]
    if initial_states is None:
        out = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[1])
    else:
        x = torch.cat([initial_states, x], dim=-1)
        out = F.conv1d(x, weight.unsqueeze(1), bias, padding=0, groups=x.shape[1])
    out = out[..., :seqlen]
    final = F.pad(x, (width - 1 - x.shape[-1], 0)).to(dtype_in)
    out = out if activation is None else F.silu(out)
    return out.to(dtype_in), final


def update_ref(x, conv_state, weight, bias, activation):
    """vLLM's ``causal_conv1d_update_ref`` without ``cache_seqlens``: updates ``conv_state``."""
    dtype_in = x.dtype
    seqlen, state_len = x.shape[-1], conv_state.shape[-1]
    x_new = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    conv_state.copy_(x_new[:, :, -state_len:])
    out = F.conv1d(x_new, weight.unsqueeze(1), bias, padding=0, groups=x.shape[1])[:, :, -seqlen:]
    return (out if activation is None else F.silu(out)).to(dtype_in)


def update_cases():
    for dim, silu, bias in itertools.product([2048, 2048 + 16, 4096], [False, True], [False, True]):
        ci = dim == 2048 + 16 and silu == bias
        yield pytest.param(dim, silu, bias) if ci else slow(dim, silu, bias)


@pytest.mark.parametrize("backend", flavours("pallas_tpu", "pallas_gpu"))
@pytest.mark.parametrize("dim, silu_activation, has_bias", update_cases())
def test_causal_conv1d_update(dim, silu_activation, has_bias, backend):
    itype, width, seqlen, batch = torch.bfloat16, 4, 1, 2
    rtol, atol = tol(itype)
    torch.manual_seed(0)
    x = torch.randn(batch, dim, seqlen, dtype=itype)
    conv_state = torch.randn(batch, dim, width - 1, dtype=itype)
    weight = torch.randn(dim, width, dtype=itype)
    bias = torch.randn(dim, dtype=itype) if has_bias else None
    conv_state_ref = conv_state.clone()
    activation = "silu" if silu_activation else None
    indices = np.arange(batch, dtype=np.int32)  # row 0 is a real row: vLLM's convention

    out, new_state = causal_conv1d_update(
        to_jax(x), to_jax(conv_state), to_jax(weight), None if bias is None else to_jax(bias),
        activation, indices, null_block_id=PAD_SLOT_ID, backend=backend,
    )
    out_ref = update_ref(x, conv_state_ref, weight, bias, activation)

    assert torch.equal(to_torch(new_state, itype), conv_state_ref)
    assert torch.allclose(to_torch(out, itype), out_ref, rtol=rtol, atol=atol)


def gather_cases():
    rotate = list(itertools.product([False, True], [False, True], [True, False]))
    for i, (itype, seqlen, width) in enumerate(
        itertools.product([torch.float32, torch.bfloat16], [1, 3], [3, 4])
    ):
        for silu, bias, padding in itertools.product([False, True], [False, True], [True, False]):
            for dim in (2048 + 16, 4096):
                args = (3, padding, dim, width, seqlen, bias, silu, itype)
                ci = dim == 2048 + 16 and i in (0, 6) and (silu, bias, padding) == rotate[i % len(rotate)]
                yield pytest.param(*args) if ci else slow(*args)


@pytest.mark.parametrize("backend", flavours("pallas_tpu", "pallas_gpu"))
@pytest.mark.parametrize(
    "batch_size, with_padding, dim, width, seqlen, has_bias, silu_activation, itype", gather_cases()
)
def test_causal_conv1d_update_with_batch_gather(
    batch_size, with_padding, dim, width, seqlen, has_bias, silu_activation, itype, backend
):
    rtol, atol = tol(itype)
    torch.manual_seed(0)
    padding = 5 if with_padding else 0
    padded_batch = batch_size + padding
    total_entries = 10 * batch_size
    x = torch.randn(padded_batch, seqlen, dim, dtype=itype).transpose(1, 2)
    state_indices = torch.randperm(total_entries)[:batch_size].to(torch.int32)
    unused = torch.ones(total_entries, dtype=torch.bool)
    unused[state_indices] = False
    padded_indices = torch.cat([state_indices, torch.full((padding,), PAD_SLOT_ID, dtype=torch.int32)])
    conv_state = torch.randn(total_entries, width - 1, dim, dtype=itype).transpose(1, 2)
    conv_state_before = conv_state.clone()
    weight = torch.randn(dim, width, dtype=itype)
    bias = torch.randn(dim, dtype=itype) if has_bias else None
    conv_state_ref = conv_state[state_indices].clone()
    activation = "silu" if silu_activation else None

    out, new_state = causal_conv1d_update(
        to_jax(x), to_jax(conv_state), to_jax(weight), None if bias is None else to_jax(bias),
        activation, padded_indices.numpy(), null_block_id=PAD_SLOT_ID, backend=backend,
    )
    out_ref = update_ref(x[:batch_size], conv_state_ref, weight, bias, activation)

    new_state = to_torch(new_state, itype)
    assert torch.equal(new_state[state_indices], conv_state_ref)
    assert torch.equal(new_state[unused], conv_state_before[unused])
    assert torch.allclose(to_torch(out, itype)[:batch_size], out_ref, rtol=rtol, atol=atol)


def varlen_cases():
    for batch, padding, dim, seqlen in itertools.product([4, 10], [True, False], [64, 4096], [8, 249, 4096]):
        args = (batch, padding, dim, seqlen)
        ci = dim == 64 and (batch, seqlen, padding) in ((10, 8, True), (10, 8, False), (4, 249, True))
        yield pytest.param(*args) if ci else slow(*args)


@pytest.mark.parametrize("batch, with_padding, dim, seqlen", varlen_cases())
def test_causal_conv1d_varlen(batch, with_padding, dim, seqlen):
    itype, width, activation = torch.bfloat16, 4, "silu"
    rtol, atol = tol(itype)
    torch.manual_seed(0)
    padding = 3 if with_padding else 0
    nsplits = batch + padding - 1
    eos = torch.randperm(seqlen - 1)[:nsplits].sort().values
    seqlens = torch.diff(torch.cat([torch.tensor([-1]), eos, torch.tensor([seqlen - 1])])).tolist()
    assert sum(seqlens) == seqlen and all(s > 0 for s in seqlens)
    total_entries = batch * 10
    cumsum = torch.cat([torch.zeros(1, dtype=torch.int32),
                        torch.cumsum(torch.tensor(seqlens), 0).to(torch.int32)])
    x = torch.randn(1, seqlen, 4096 + dim + 64, dtype=itype).transpose(1, 2)[:, 4096:4096 + dim, :]
    weight = torch.randn(dim, width, dtype=itype)
    bias = torch.randn(dim, dtype=itype)
    final_states = torch.randn(total_entries, width - 1, dim, dtype=itype).transpose(1, 2)
    final_states_ref = final_states.clone()
    has_initial = torch.randint(0, 2, (cumsum.shape[0] - 1,), dtype=torch.bool)
    state_indices = torch.randperm(total_entries, dtype=torch.int32)[:batch]
    padded_indices = torch.cat([state_indices, torch.full((padding,), PAD_SLOT_ID, dtype=torch.int32)])

    out, new_states = causal_conv1d_varlen(
        to_jax(x[0]), to_jax(weight), to_jax(bias), to_jax(final_states), cumsum.numpy(),
        padded_indices.numpy(), has_initial.numpy(), activation, null_block_id=PAD_SLOT_ID,
    )

    outs_ref = []
    for i, x_s in enumerate(torch.split(x, seqlens, dim=-1)):
        row = int(padded_indices[i])
        if row == PAD_SLOT_ID:
            continue
        o, final = conv_ref(x_s, weight, bias, final_states_ref[row:row + 1] if has_initial[i] else None,
                            activation)
        final_states_ref[row] = final[0]
        outs_ref.append(o)
    out_ref = torch.cat(outs_ref, dim=2)[0]

    new_states = to_torch(new_states, itype)
    assert torch.allclose(new_states[state_indices], final_states_ref[state_indices], rtol=rtol, atol=atol)
    assert torch.allclose(to_torch(out, itype)[:, :out_ref.shape[-1]], out_ref, rtol=rtol, atol=atol)
