"""vLLM's selective_state_update tests, ported onto kvjax's ``selective_state_update``.

Source: vllm-project/vllm, ``tests/kernels/mamba/test_mamba_ssm.py`` at commit
2e0831b0ab951c8896d4dd5d6cb9c3350a4574de (``test_selective_state_update``,
``test_selective_state_update_varlen``, ``test_selective_state_update_with_batch_indices``,
``test_selective_state_update_with_heads_with_batch_indices``,
``test_selective_state_update_with_num_accepted_tokens``). The test logic and the torch
reference are re-written here; no peer code is copied. (The selective-scan tests of that
file test vLLM's CUDA prefill scan, whose layout kvjax's Mamba2 scan does not share;
``test_selective_state_update_varlen_with_num_accepted`` repeats the speculative test
without its output assertion.)

Conventions: vLLM pads state indices with ``PAD_SLOT_ID = -1`` and uses row 0 like any
other, so kvjax runs with ``null_block_id=PAD_SLOT_ID``. Precision differs on purpose
and has no switch: vLLM's reference rounds the new state to the state dtype before the
output, kvjax keeps it in float32 (``selective_state_update``'s docstring). So in the
bf16 cases an output element may miss vLLM's reference by more than vLLM's tolerance
if it is within bf16 rounding (``rtol = 2**-8``) of a float64 evaluation of the same
inputs; every other assertion is vLLM's, with vLLM's tolerances (float32 ``rtol=3e-4,
atol=1e-3``; bf16 ``1e-2, 5e-2`` / varlen ``5e-2, 1.5e-1`` / batch indices ``1e-1,
1e-1``). vLLM's largest bf16 case (dim 4096, ngroups 4, dstate 64, heads, batch
indices, z), where one element of 12,288 missed vLLM's reference in the run reported
in issue 26 (with this file's data, torch seed 0 on a CPU, none does), is also checked
against float64 on every element (``test_largest_bf16_case_against_float64``).

Sized for CI (the rest of each product and the interpreted Pallas flavours behind
``KVJAX_PEER_SLOW=1``): dim 2064 (no heads) or 2048 (heads), two cases per test (one
float32, one bf16, z and dstate differing; one for batch indices), and the largest
bf16 case with per-dim ``dt`` / ``A`` (``tie_hdim`` on: slow).
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
from pallas_kernels import selective_state_update

BF16_ROUNDING = 2.0 ** -8  # the largest relative error of rounding to bf16 (half an ulp)


def to_jax(t):
    if t is None:
        return None
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy().astype(ml_dtypes.bfloat16))
    return jnp.asarray(t.numpy())


def to_torch(a, dtype):
    return torch.from_numpy(np.asarray(a).astype(np.float32)).to(dtype)


def ssu_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """One SSM step per batch row, vLLM's reference rule: the new state is written back
    into ``state`` (its dtype) and the output is computed from that stored state.

    Shapes with or without the heads axis (``state [b, h, p, n]`` or ``[b, p, n]``, ...).
    """
    has_heads = state.dim() > 3
    if not has_heads:
        state_h = state.unsqueeze(1)
        x, dt, A, B, C = x.unsqueeze(1), dt.unsqueeze(1), A.unsqueeze(0), B.unsqueeze(1), C.unsqueeze(1)
        D = None if D is None else D.unsqueeze(0)
        z = None if z is None else z.unsqueeze(1)
        dt_bias = None if dt_bias is None else dt_bias.unsqueeze(0)
    else:
        state_h = state
    nheads, ngroups = state_h.shape[1], B.shape[1]
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    dA = torch.exp(dt.unsqueeze(-1) * A)  # [b, h, p, n]
    B = B.repeat_interleave(nheads // ngroups, dim=1)  # [b, h, n]
    C = C.repeat_interleave(nheads // ngroups, dim=1)
    dB = dt.unsqueeze(-1) * B.unsqueeze(2)
    state_h.copy_(state_h * dA + dB * x.unsqueeze(-1))
    out = torch.einsum("bhpn,bhn->bhp", state_h.to(C.dtype), C)
    if D is not None:
        out = out + (x * D).to(out.dtype)
    out = (out if z is None else out * F.silu(z)).to(x.dtype)
    return out if has_heads else out.squeeze(1)


def f64(*ts):
    return [None if t is None else t.double() for t in ts]


def assert_out_close(out, out_ref, rtol, atol, oracle=None):
    """vLLM's ``allclose(out, out_ref)``; in bf16 an element missing it passes if it is within
    bf16 rounding of the float64 ``oracle`` (kvjax's float32 state, documented)."""
    ok = torch.isclose(out.float(), out_ref.float(), rtol=rtol, atol=atol)
    if oracle is not None:
        ok |= torch.isclose(out.double(), oracle, rtol=BF16_ROUNDING, atol=1e-6)
    assert bool(ok.all()), (
        f"{int((~ok).sum())} of {ok.numel()} elements differ; max |out - ref| "
        f"{(out.float() - out_ref.float()).abs().max().item():.4g}"
    )


def tol(itype, bf16):
    return bf16 if itype == torch.bfloat16 else (3e-4, 1e-3)


ITYPES = [torch.float32, torch.bfloat16]


def plain_cases():
    for i, (itype, has_z) in enumerate(itertools.product(ITYPES, [False, True])):
        for dim, dstate in itertools.product([2048, 2048 + 16, 4096], [16, 64]):
            args = (dim, dstate, has_z, itype)
            ci = dim == 2048 + 16 and dstate == (16, 64)[i % 2] and i in (0, 3)
            yield pytest.param(*args) if ci else slow(*args)


@pytest.mark.parametrize("backend", flavours("pallas_tpu", "pallas_gpu"))
@pytest.mark.parametrize("dim, dstate, has_z, itype", plain_cases())
def test_selective_state_update(dim, dstate, has_z, itype, backend):
    rtol, atol = tol(itype, (1e-2, 5e-2))
    torch.manual_seed(0)
    batch = 1
    state = torch.randn(batch, dim, dstate, dtype=itype)
    x = torch.randn(batch, dim, dtype=itype)
    dt = torch.randn(batch, dim, dtype=itype)
    dt_bias = torch.rand(dim) - 4.0
    A = -torch.rand(dim, dstate) - 1.0
    B, C = torch.randn(batch, dstate), torch.randn(batch, dstate)
    D = torch.randn(dim)
    z = torch.randn_like(x) if has_z else None
    oracle = ssu_ref(*f64(state.clone(), x, dt, A, B, C, D, z, dt_bias), dt_softplus=True)
    state_ref = state.clone()

    out, new_state = selective_state_update(
        to_jax(state), to_jax(x), to_jax(dt), to_jax(A), to_jax(B), to_jax(C), to_jax(D),
        to_jax(dt_bias), to_jax(z), True, null_block_id=PAD_SLOT_ID, backend=backend,
    )
    out_ref = ssu_ref(state_ref, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)

    assert torch.allclose(to_torch(new_state, itype), state_ref, rtol=rtol, atol=atol)
    assert_out_close(to_torch(out, itype), out_ref, rtol, atol, oracle if itype == torch.bfloat16 else None)


def varlen_cases():
    for i, (itype, max_seq_len) in enumerate(itertools.product(ITYPES, [1, 2, 4])):
        for dim, dstate, has_z in itertools.product([2048, 2048 + 16, 4096], [16, 64], [False, True]):
            args = (dim, dstate, has_z, itype, max_seq_len)
            ci = dim == 2048 + 16 and max_seq_len == 4 and (dstate, has_z) == ((16, True), (64, False))[i % 2]
            yield pytest.param(*args) if ci else slow(*args)


@pytest.mark.parametrize("backend", flavours("pallas_tpu", "pallas_gpu"))
@pytest.mark.parametrize("dim, dstate, has_z, itype, max_seq_len", varlen_cases())
def test_selective_state_update_varlen(dim, dstate, has_z, itype, max_seq_len, backend):
    rtol, atol = tol(itype, (5e-2, 1.5e-1))
    torch.manual_seed(0)
    batch = 4
    counts = torch.randint(1, max_seq_len + 1, (batch,))
    total = int(counts.sum())
    cu_seqlens = torch.tensor([0] + torch.cumsum(counts, 0).tolist(), dtype=torch.int32)
    state = torch.randn(batch, dim, dstate, dtype=itype)
    x = torch.randn(total, dim, dtype=itype)
    dt = torch.randn(total, dim, dtype=itype)
    dt_bias = torch.rand(dim) - 4.0
    A = -torch.rand(dim, dstate) - 1.0
    B, C = torch.randn(total, dstate), torch.randn(total, dstate)
    D = torch.randn(dim)
    z = torch.randn_like(x) if has_z else None
    state_ref, state64 = state.clone(), state.double()

    out, new_state = selective_state_update(
        to_jax(state), to_jax(x), to_jax(dt), to_jax(A), to_jax(B), to_jax(C), to_jax(D),
        to_jax(dt_bias), to_jax(z), True, null_block_id=PAD_SLOT_ID, cu_seqlens=cu_seqlens.numpy(),
        backend=backend,
    )
    outs, oracle = [], []
    for s in range(batch):
        for t in range(int(cu_seqlens[s]), int(cu_seqlens[s + 1])):
            sl = slice(t, t + 1)
            zt = z[sl] if has_z else None
            outs.append(ssu_ref(state_ref[s:s + 1], x[sl], dt[sl], A, B[sl], C[sl], D=D, z=zt,
                                dt_bias=dt_bias, dt_softplus=True))
            oracle.append(ssu_ref(state64[s:s + 1], *f64(x[sl], dt[sl], A, B[sl], C[sl], D, zt, dt_bias),
                                  dt_softplus=True))
    out_ref, oracle = torch.cat(outs), torch.cat(oracle)

    assert torch.allclose(to_torch(new_state, itype), state_ref, rtol=rtol, atol=atol)
    assert_out_close(to_torch(out, itype), out_ref, rtol, atol, oracle if itype == torch.bfloat16 else None)


def batch_index_cases():
    for i, (itype, with_padding) in enumerate(itertools.product(ITYPES, [True, False])):
        for dim, dstate in itertools.product([2048, 2048 + 16, 4096], [16, 64]):
            args = (with_padding, dim, dstate, True, itype)
            ci = dim == 2048 + 16 and dstate == 16 and i == 2
            yield pytest.param(*args) if ci else slow(*args)


@pytest.mark.parametrize("backend", flavours("pallas_tpu", "pallas_gpu"))
@pytest.mark.parametrize("with_padding, dim, dstate, has_z, itype", batch_index_cases())
def test_selective_state_update_with_batch_indices(with_padding, dim, dstate, has_z, itype, backend):
    rtol, atol = tol(itype, (1e-1, 1e-1))
    torch.manual_seed(0)
    batch, padding = 3, 5 if with_padding else 0
    padded_batch, total_entries = batch + padding, 10 * batch
    state = torch.randn(total_entries, dim, dstate, dtype=itype)
    indices = torch.randperm(total_entries)[:batch].to(torch.int32)
    unused = torch.ones(total_entries, dtype=torch.bool)
    unused[indices] = False
    padded = torch.cat([indices, torch.full((padding,), PAD_SLOT_ID, dtype=torch.int32)])
    x = torch.randn(padded_batch, dim, dtype=itype)
    dt = torch.randn(padded_batch, dim, dtype=itype)
    dt_bias = torch.rand(dim) - 4.0
    A = -torch.rand(dim, dstate) - 1.0
    B, C = torch.randn(padded_batch, dstate), torch.randn(padded_batch, dstate)
    D = torch.randn(dim)
    z = torch.randn_like(x) if has_z else None
    state_ref = state[indices].clone()
    oracle = ssu_ref(*f64(state[indices], x[:batch], dt[:batch], A, B[:batch], C[:batch], D, z[:batch],
                          dt_bias), dt_softplus=True)

    out, new_state = selective_state_update(
        to_jax(state), to_jax(x), to_jax(dt), to_jax(A), to_jax(B), to_jax(C), to_jax(D),
        to_jax(dt_bias), to_jax(z), True, state_batch_indices=padded.numpy(),
        null_block_id=PAD_SLOT_ID, backend=backend,
    )
    out_ref = ssu_ref(state_ref, x[:batch], dt[:batch], A, B[:batch], C[:batch], D=D, z=z[:batch],
                      dt_bias=dt_bias, dt_softplus=True)

    new_state = to_torch(new_state, itype)
    if with_padding:
        assert torch.equal(new_state[unused], state[unused])
    assert torch.allclose(new_state[indices], state_ref, rtol=rtol, atol=atol)
    assert_out_close(to_torch(out, itype)[:batch], out_ref, rtol, atol,
                     oracle if itype == torch.bfloat16 else None)


def heads_case(dim, dstate, ngroups, has_z, tie_hdim, itype):
    """vLLM's heads + batch indices data: (state, indices, args..., kwargs)."""
    torch.manual_seed(0)
    batch, headdim = 3, 64
    nheads = dim // headdim
    state = torch.randn(10 * batch, nheads, headdim, dstate, dtype=itype)
    indices = torch.randperm(10 * batch)[:batch].to(torch.int32)
    x = torch.randn(batch, nheads, headdim, dtype=itype)
    if not tie_hdim:
        dt = torch.randn(batch, nheads, headdim, dtype=itype)
        dt_bias = torch.rand(nheads, headdim) - 4.0
        A = -torch.rand(nheads, headdim, dstate) - 1.0
        D = torch.randn(nheads, headdim)
    else:  # one value per head, repeated over the head dim (and dstate for A)
        dt = torch.randn(batch, nheads, dtype=itype)[:, :, None].expand(-1, -1, headdim)
        dt_bias = (torch.rand(nheads) - 4.0)[:, None].expand(-1, headdim)
        A = (-torch.rand(nheads) - 1.0)[:, None, None].expand(-1, headdim, dstate)
        D = torch.randn(nheads)[:, None].expand(-1, headdim)
    B = torch.randn(batch, ngroups, dstate)
    C = torch.randn(batch, ngroups, dstate)
    z = torch.randn_like(x) if has_z else None
    return state, indices, (x, dt, A, B, C), dict(D=D, z=z, dt_bias=dt_bias)


def run_heads(state, indices, args, kw, backend):
    x, dt, A, B, C = args
    return selective_state_update(
        to_jax(state), to_jax(x), to_jax(dt), to_jax(A), to_jax(B), to_jax(C), to_jax(kw["D"]),
        to_jax(kw["dt_bias"]), to_jax(kw["z"]), True, state_batch_indices=indices.numpy(),
        null_block_id=PAD_SLOT_ID, backend=backend,
    )


def heads_cases():
    ci_set = {
        (2048, 64, 4, True, True, torch.float32),
        (2048, 16, 1, False, False, torch.bfloat16),
    }
    for args in itertools.product([2048, 4096], [16, 64], [1, 4], [False, True], [False, True], ITYPES):
        yield pytest.param(*args) if args in ci_set else slow(*args)


@pytest.mark.parametrize("backend", flavours("pallas_tpu", "pallas_gpu"))
@pytest.mark.parametrize("dim, dstate, ngroups, has_z, tie_hdim, itype", heads_cases())
def test_selective_state_update_with_heads_with_batch_indices(
    dim, dstate, ngroups, has_z, tie_hdim, itype, backend
):
    rtol, atol = tol(itype, (1e-1, 1e-1))
    if itype == torch.float32:
        rtol, atol = 3e-4, 1e-3
    state, indices, args, kw = heads_case(dim, dstate, ngroups, has_z, tie_hdim, itype)
    state_ref = state[indices].clone()
    oracle = ssu_ref(*f64(state[indices], *args), **dict(zip(kw, f64(*kw.values()))), dt_softplus=True)

    out, new_state = run_heads(state, indices, args, kw, backend)
    out_ref = ssu_ref(state_ref, *args, **kw, dt_softplus=True)

    assert torch.allclose(to_torch(new_state, itype)[indices], state_ref, rtol=rtol, atol=atol)
    assert_out_close(to_torch(out, itype), out_ref, rtol, atol, oracle if itype == torch.bfloat16 else None)


@pytest.mark.parametrize("backend", flavours("pallas_tpu", "pallas_gpu"))
@pytest.mark.parametrize("tie_hdim", [False, slow(True)])
def test_largest_bf16_case_against_float64(tie_hdim, backend):
    """dim 4096, ngroups 4, dstate 64, heads, batch indices, z, bf16 (issue 26 item 3).

    vLLM's reference reads a bf16-rounded state (in issue 26's run one element missed
    vLLM's ``rtol = atol = 0.1``); kvjax's bf16 output must be within bf16 rounding of a
    float64 evaluation of the same inputs: relative ``2**-8`` (half an ulp), plus ``1e-3``
    absolute near zero. kvjax measures at most 0.95 of that bound here; an output
    computed from the bf16-rounded state, as vLLM's reference does, exceeds it.
    """
    state, indices, args, kw = heads_case(4096, 64, 4, True, tie_hdim, torch.bfloat16)
    oracle = ssu_ref(*f64(state[indices], *args), **dict(zip(kw, f64(*kw.values()))), dt_softplus=True)
    out, _ = run_heads(state, indices, args, kw, backend)
    out = to_torch(out, torch.float32).double()
    err = (out - oracle).abs()
    bound = BF16_ROUNDING * oracle.abs() + 1e-3
    assert bool((err <= bound).all()), (
        f"{int((err > bound).sum())} of {err.numel()} elements beyond bf16 rounding of float64; "
        f"max error {err.max().item():.3g}"
    )


def accepted_cases():
    ci = {(2048, 16, True, torch.float32, 4), (2048, 64, False, torch.bfloat16, 2)}
    for args in itertools.product([2048, 4096], [16, 64], [False, True], ITYPES, [2, 4]):
        yield pytest.param(*args) if args in ci else slow(*args)


@pytest.mark.parametrize("backend", flavours("pallas_tpu", "pallas_gpu"))
@pytest.mark.parametrize("dim, dstate, has_z, itype, max_seq_len", accepted_cases())
def test_selective_state_update_with_num_accepted_tokens(dim, dstate, has_z, itype, max_seq_len, backend):
    """Speculative decode: each sequence starts from the state of its last accepted token
    (column ``max(num_accepted - 1, 0)`` of ``state_batch_indices``) and stores the state
    after every token to its own ``dst_state_batch_indices`` slot."""
    rtol, atol = tol(itype, (5e-2, 1.5e-1))
    torch.manual_seed(0)
    batch = 4
    tokens_per_seq = torch.randint(1, max_seq_len + 1, (batch,))
    total = int(tokens_per_seq.sum())
    num_accepted = torch.randint(0, max_seq_len, (batch,))
    num_accepted[0], num_accepted[1] = 0, max_seq_len  # none accepted, all accepted
    cu_seqlens = torch.tensor([0] + torch.cumsum(tokens_per_seq, 0).tolist(), dtype=torch.int32)
    state = torch.randn(50, dim, dstate, dtype=itype)
    src = torch.full((batch, max_seq_len), PAD_SLOT_ID, dtype=torch.int32)
    initial_slots = torch.randint(0, 15, (batch,), dtype=torch.int32)
    for b in range(batch):
        src[b, max(int(num_accepted[b]) - 1, 0)] = initial_slots[b]
    dst = torch.full((batch, max_seq_len), PAD_SLOT_ID, dtype=torch.int32)
    dst_slot, next_slot = {}, 15
    for b in range(batch):
        for i in range(int(tokens_per_seq[b])):
            dst[b, i] = dst_slot[(b, i)] = next_slot
            next_slot += 1
    x = torch.randn(total, dim, dtype=itype)
    dt = torch.randn(total, dim, dtype=itype)
    dt_bias = torch.rand(dim) - 4.0
    A = -torch.rand(dim, dstate) - 1.0
    B, C = torch.randn(total, dstate), torch.randn(total, dstate)
    D = torch.randn(dim)
    z = torch.randn_like(x) if has_z else None

    states_ref, outs, oracle = {}, [], []
    for b in range(batch):
        slot = int(src[b, max(int(num_accepted[b]) - 1, 0)])
        h, h64 = state[slot:slot + 1].clone(), state[slot:slot + 1].double()
        for i, t in enumerate(range(int(cu_seqlens[b]), int(cu_seqlens[b + 1]))):
            sl = slice(t, t + 1)
            zt = z[sl] if has_z else None
            outs.append(ssu_ref(h, x[sl], dt[sl], A, B[sl], C[sl], D=D, z=zt, dt_bias=dt_bias,
                                dt_softplus=True))
            oracle.append(ssu_ref(h64, *f64(x[sl], dt[sl], A, B[sl], C[sl], D, zt, dt_bias),
                                  dt_softplus=True))
            states_ref[(b, i)] = h.clone()
    out_ref, oracle = torch.cat(outs), torch.cat(oracle)

    out, new_state = selective_state_update(
        to_jax(state), to_jax(x), to_jax(dt), to_jax(A), to_jax(B), to_jax(C), to_jax(D),
        to_jax(dt_bias), to_jax(z), True, state_batch_indices=src.numpy(),
        dst_state_batch_indices=dst.numpy(), null_block_id=PAD_SLOT_ID,
        num_accepted_tokens=num_accepted.numpy().astype(np.int32), cu_seqlens=cu_seqlens.numpy(),
        backend=backend,
    )

    assert_out_close(to_torch(out, itype), out_ref, rtol, atol, oracle if itype == torch.bfloat16 else None)
    new_state = to_torch(new_state, itype)
    for (b, i), slot in dst_slot.items():
        assert torch.allclose(new_state[slot], states_ref[(b, i)][0], rtol=rtol, atol=atol)
