"""Mamba state kernels: decode-step updates and prefill scans with null-row masking.

Public API (argument names and order mirror vLLM 0.33; every function returns the
updated arrays instead of writing them in place — donate them at the enclosing jit):

* :func:`selective_state_update` (``mamba_ssu.py``) — SSM decode step, incl. the
  speculative multi-token path and varlen; reference / TPU / GPU.
* :func:`causal_conv1d_update` (``mamba_conv.py``) — conv decode step; reference /
  TPU / GPU.
* :func:`selective_scan_varlen` (``mamba_scan.py``) — Mamba2 prefill scan over a
  packed batch; fresh requests start from zero, null rows are skipped (jnp).
* :func:`causal_conv1d_varlen` (``mamba_conv.py``) — conv prefill over a packed
  batch, same masking (jnp).
* :class:`Columns` (``mamba_common.py``) — a decode operand given as columns of a wider
  array (vLLM's strided views of one projection), read in place by the GPU kernels.

Sentinel: a state index equal to ``null_block_id`` (``NULL_BLOCK_ID = 0``) names the
reserved null row. It is never read (a zero state / window is used instead) and never
written, whatever the implementation; tests poison it with NaN.

``*_reference`` names are the same functions pinned to ``backend="reference"``.
"""

from __future__ import annotations

from pallas_kernels.mamba_common import Columns
from pallas_kernels.mamba_conv import ConvConfig, causal_conv1d_update, causal_conv1d_varlen
from pallas_kernels.mamba_scan import DEFAULT_CHUNK_SIZE, selective_scan_varlen
from pallas_kernels.mamba_ssu import SSUConfig, selective_state_update

__all__ = [
    "Columns",
    "ConvConfig",
    "DEFAULT_CHUNK_SIZE",
    "SSUConfig",
    "causal_conv1d_update",
    "causal_conv1d_update_reference",
    "causal_conv1d_varlen",
    "selective_scan_varlen",
    "selective_scan_varlen_reference",
    "selective_state_update",
    "selective_state_update_reference",
]


def selective_state_update_reference(*args, **kwargs):
    """:func:`selective_state_update` with ``backend="reference"`` (pure jnp)."""
    return selective_state_update(*args, backend="reference", **kwargs)


def causal_conv1d_update_reference(*args, **kwargs):
    """:func:`causal_conv1d_update` with ``backend="reference"`` (pure jnp)."""
    return causal_conv1d_update(*args, backend="reference", **kwargs)


def selective_scan_varlen_reference(*args, **kwargs):
    """:func:`selective_scan_varlen` with ``backend="reference"`` (token-by-token scan)."""
    return selective_scan_varlen(*args, backend="reference", **kwargs)
