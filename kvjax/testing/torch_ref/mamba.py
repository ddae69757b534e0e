"""Torch versions of the Mamba state ops, written the way a torch runner would.

The step functions follow vLLM's test references (``tests/kernels/mamba/utils.py``
``selective_state_update_ref`` and ``test_causal_conv1d.py``): batched torch ops
on gathered rows. The wrappers add what the kernels do with index tables — null
rows, the speculative per-token path, varlen — as plain Python loops over
sequences. Everything is in place on the state tensors (as in vLLM) and the
tensors are also returned. Math is float32; states keep their dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NULL_BLOCK_ID = 0


def _softplus(dt: torch.Tensor) -> torch.Tensor:
    return F.softplus(dt)  # beta=1, threshold=20: dt above 20 is returned as is


def ssm_step(h, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """One step for a batch of rows, float32. Returns (h_new, y).

    h [b, H, P, N]; x, z [b, H, P]; dt [b, H, P] or [b, H, 1]; A [H, P|1, N|1];
    B, C [b, G, N]; D, dt_bias [H, P] or [H, 1].
    """
    x = x.float()
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = _softplus(dt)
    nheads, ngroups = x.shape[1], B.shape[1]
    Bh = B.float().repeat_interleave(nheads // ngroups, dim=1)  # [b, H, N]
    Ch = C.float().repeat_interleave(nheads // ngroups, dim=1)
    dA = torch.exp(dt.unsqueeze(-1) * A.float())
    dB = dt.unsqueeze(-1) * Bh.unsqueeze(-2)
    h = h * dA + dB * x.unsqueeze(-1)
    y = torch.einsum("bhdn,bhn->bhd", h, Ch)
    if D is not None:
        y = y + x * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return h, y


def selective_state_update(state, x, dt, A, B, C, D=None, dt_bias=None, z=None,
                           dt_softplus=False, state_batch_indices=None,
                           dst_state_batch_indices=None, null_block_id=NULL_BLOCK_ID,
                           num_accepted_tokens=None, cu_seqlens=None):
    """kvjax's ``selective_state_update`` semantics in torch (in place on ``state``).

    Returns ``(out, state)``. Shapes as in kvjax (with or without the heads axis).
    """
    has_heads = state.dim() == 4
    if not has_heads:
        state4 = state.unsqueeze(1)
        x, dt, A, B, C = x.unsqueeze(1), dt.unsqueeze(1), A.unsqueeze(0), B.unsqueeze(1), C.unsqueeze(1)
        D = None if D is None else D.unsqueeze(0)
        dt_bias = None if dt_bias is None else dt_bias.unsqueeze(0)
        z = None if z is None else z.unsqueeze(1)
    else:
        state4 = state
    num_lines = state4.shape[0]
    T = x.shape[0]
    out = torch.zeros(x.shape, dtype=x.dtype)
    if cu_seqlens is None:
        bounds = [(t, t + 1) for t in range(T)]
    else:
        cu = cu_seqlens.tolist()
        bounds = list(zip(cu[:-1], cu[1:]))
    sbi = dsbi = None
    if state_batch_indices is not None:
        sbi = state_batch_indices.long()
        sbi = sbi.unsqueeze(1) if sbi.dim() == 1 else sbi
        dsbi = sbi if dst_state_batch_indices is None else dst_state_batch_indices.long()
        dsbi = dsbi.unsqueeze(1) if dsbi.dim() == 1 else dsbi
    spec = num_accepted_tokens is not None

    def ok(i):
        return i != null_block_id and 0 <= i < num_lines

    for b, (bos, eos) in enumerate(bounds):
        if eos == bos:
            continue
        col = max(int(num_accepted_tokens[b]) - 1, 0) if spec else 0
        if sbi is None:
            src, dst_row = b, b
        else:
            src = int(sbi[b, col])
            dst_row = int(dsbi[b, col]) if col < dsbi.shape[1] else -1
        src_ok = sbi is None or ok(src)
        h = state4[src].float().unsqueeze(0).clone() if src_ok else torch.zeros(
            (1,) + tuple(state4.shape[1:]), dtype=torch.float32)
        for i, t in enumerate(range(bos, eos)):
            sl = slice(t, t + 1)
            h, y = ssm_step(h, x[sl], dt[sl], A, B[sl], C[sl], D,
                            None if z is None else z[sl], dt_bias, dt_softplus)
            out[t] = y[0].to(out.dtype)
            if spec and src_ok and i < dsbi.shape[1] and ok(int(dsbi[b, i])):
                state4[int(dsbi[b, i])] = h[0].to(state4.dtype)
        if not spec and src_ok and (sbi is None or ok(dst_row)):
            state4[dst_row] = h[0].to(state4.dtype)
    if not has_heads:
        out = out.squeeze(1)
    return out, state


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None,
                         conv_state_indices=None, num_accepted_tokens=None,
                         query_start_loc=None, max_query_len=-1, null_block_id=NULL_BLOCK_ID):
    """kvjax's ``causal_conv1d_update`` semantics in torch (in place on ``conv_state``).

    Per sequence: ``seq = cat(window, x_b)``, ``out = conv1d(seq)`` (depthwise, no
    padding), new state = last ``width-1`` of ``seq`` (speculative: ``seq[1:]``).
    Returns ``(out, conv_state)``; null rows leave ``out == x``.
    """
    silu = activation in ("silu", "swish", True)
    num_lines, dim, S = conv_state.shape
    width = weight.shape[1]
    out = x.clone()
    if query_start_loc is None:
        x3 = x.unsqueeze(-1) if x.dim() == 2 else x  # [batch, dim, seqlen]
        o3 = out.unsqueeze(-1) if x.dim() == 2 else out  # a view: writes land in out
        seqs = [(x3[b], o3[b]) for b in range(x3.shape[0])]
    else:
        qsl = query_start_loc.tolist()
        seqs = [(x[qsl[b]:qsl[b + 1]].transpose(0, 1), out[qsl[b]:qsl[b + 1]].transpose(0, 1))
                for b in range(len(qsl) - 1)]
    for b, (xb, ob) in enumerate(seqs):
        if conv_state_indices is None:
            r = b
        else:
            ci = conv_state_indices
            r = int(ci[b] if ci.dim() == 1 else ci[b, 0])
        n = xb.shape[1]
        if r == null_block_id or not 0 <= r < num_lines or n == 0:
            continue  # no state access; out keeps x
        off = max(int(num_accepted_tokens[b]) - 1, 0) if num_accepted_tokens is not None else 0
        window = conv_state[r, :, off:off + width - 1].float()
        seq = torch.cat([window, xb.to(conv_state.dtype).float()], dim=-1)  # [dim, W-1+n]
        o = F.conv1d(seq.unsqueeze(0), weight.float().unsqueeze(1),
                     None if bias is None else bias.float(), groups=dim)[0]
        if silu:
            o = F.silu(o)
        ob.copy_(o.to(x.dtype))
        if num_accepted_tokens is None:
            conv_state[r, :, :width - 1] = seq[:, -(width - 1):].to(conv_state.dtype)
        else:
            conv_state[r, :, :width - 2 + n] = seq[:, 1:].to(conv_state.dtype)
    return out, conv_state


def causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, cache_indices,
                         has_initial_state, activation="silu", null_block_id=NULL_BLOCK_ID):
    """kvjax's ``causal_conv1d_varlen`` (vLLM ``causal_conv1d_fn``) in torch.

    ``x [dim, T]``; per request, ``F.conv1d`` over ``cat(initial window or zeros, x_r)``.
    Returns ``(out [dim, T], conv_states)``; skipped requests / pad tokens keep ``x``.
    """
    silu = activation in ("silu", "swish", True)
    dim = x.shape[0]
    width = weight.shape[1]
    out = x.clone()
    qsl = query_start_loc.tolist()
    for r in range(len(qsl) - 1):
        ci = int(cache_indices[r])
        bos, eos = qsl[r], qsl[r + 1]
        if ci == null_block_id or eos == bos:
            continue
        xr = x[:, bos:eos].to(conv_states.dtype).float()
        if bool(has_initial_state[r]):
            init = conv_states[ci, :, :width - 1].float()
        else:
            init = torch.zeros(dim, width - 1)
        seq = torch.cat([init, xr], dim=-1)
        o = F.conv1d(seq.unsqueeze(0), weight.float().unsqueeze(1),
                     None if bias is None else bias.float(), groups=dim)[0]
        if silu:
            o = F.silu(o)
        out[:, bos:eos] = o.to(x.dtype)
        conv_states[ci, :, :width - 1] = seq[:, -(width - 1):].to(conv_states.dtype)
    return out, conv_states


def selective_scan_varlen(x, dt, A, B, C, state, query_start_loc, cache_indices,
                          has_initial_state, D=None, dt_bias=None, z=None, dt_softplus=False,
                          null_block_id=NULL_BLOCK_ID):
    """kvjax's ``selective_scan_varlen`` (Mamba2, per-head scalar dt/A) in torch.

    ``x [T, H, P]``, ``dt [T, H]``, ``A [H]``, ``B, C [T, G, N]``, ``state [L, H, P, N]``.
    Returns ``(out, state)``; skipped requests and pad tokens output zeros.
    """
    T, H, P = x.shape
    out = torch.zeros(x.shape, dtype=x.dtype)
    qsl = query_start_loc.tolist()
    A3 = A.float().reshape(H, 1, 1)
    Dh = None if D is None else (D.float().reshape(H, 1) if D.dim() == 1 else D.float())
    bias = None if dt_bias is None else dt_bias.float().reshape(H, 1)
    for r in range(len(qsl) - 1):
        ci = int(cache_indices[r])
        bos, eos = qsl[r], qsl[r + 1]
        if ci == null_block_id or eos == bos:
            continue
        if bool(has_initial_state[r]):
            h = state[ci].float().unsqueeze(0).clone()
        else:
            h = torch.zeros((1,) + tuple(state.shape[1:]))
        for t in range(bos, eos):
            sl = slice(t, t + 1)
            h, y = ssm_step(h, x[sl], dt[sl].unsqueeze(-1), A3, B[sl], C[sl], Dh,
                            None if z is None else z[sl], bias, dt_softplus)
            out[t] = y[0].to(out.dtype)
        state[ci] = h[0].to(state.dtype)
    return out, state
