"""vLLM 0.33.0's own kernels as a differential-testing oracle (optional).

Each adapter takes numpy / JAX arrays with kvjax's argument conventions,
converts them bit for bit to torch (:mod:`kvjax.testing.convert`), calls
vLLM's function, and returns numpy arrays. Inputs are never modified: vLLM
updates its buffers in place, so the adapters hand it copies and return them.

Install (CPU, no CUDA packages): ``bash scripts/install_vllm_oracle.sh``
(``pip install --no-deps vllm==0.33.0 triton==3.8.0`` plus the light packages
the kernels' import chain needs, under a constraint that pins torch 2.13.0).

How vLLM runs here:

* With a CPU-only torch the kernels run in Triton's interpreter. Importing
  them needs ``TRITON_INTERPRET=1`` (read when ``@triton.jit`` decorates, so
  before vLLM's kernel modules are imported) and ``CUDA_VISIBLE_DEVICES=""``
  (else ``vllm.triton_utils`` finds no active driver and swaps Triton for a
  placeholder). The first call to :func:`available` (or any adapter) sets
  ``TRITON_INTERPRET=1`` for the process and sets ``CUDA_VISIBLE_DEVICES=""``
  only while vLLM is being imported, restoring the previous value after, so
  JAX never sees it changed. The variables vLLM's import sets for its own
  runtime (``TF_CPP_MIN_LOG_LEVEL``, ``TORCHINDUCTOR_*``, ...) are undone too.
  vLLM's logger is set up at import with ``VLLM_LOGGING_LEVEL=ERROR`` unless
  that variable is already set (it otherwise warns that its compiled ``_C``
  extension, built for a CUDA torch, is missing; the Triton kernels do not
  use it). If vLLM's kernel modules were imported earlier without the
  interpreter, :func:`available` says so.
* With a CUDA torch nothing is patched and the kernels run natively on
  ``cuda`` tensors.

Host-side GPU queries (interpreter mode only; each patched just around the call):

* ``triton_reshape_and_cache_flash`` asks ``current_platform`` whether the
  device has capability 8.0 / 8.9 (bf16 / fp8 caches) and
  ``torch.cuda.get_device_capability`` for its tile size. Both are answered
  with (9, 0), an H100, for the duration of the call
  (:func:`_pretend_gpu_capability`). The answer only picks the tile size.
* ``selective_state_update`` looks up a tuned launch config by GPU name; the
  call runs inside vLLM's ``override_ssm_config`` with vLLM's default
  heuristic config instead. The config only tiles the ``dim`` axis.

Known quirks of Triton's interpreter on CPU (checked with Triton 3.8.0):

* float -> float8_e4m3fn conversion is wrong: ties round up instead of to
  even, subnormals are mis-rounded, values beyond +-448 do not saturate
  (500 -> 256, 464 -> NaN, inf -> 256) and NaN becomes 384. On a GPU,
  Triton converts with ``cvt.rn.satfinite``: the documented rule
  ``saturate(x / scale)``, round to nearest even. fp8 results are returned as
  the interpreter computes them; compare fp8 bytes against the documented
  rule, except where every quotient is an fp8 value (then the interpreter is
  exact, which the oracle tests use for bitwise comparisons).
* bfloat16 arithmetic is wrong (``bf16 * bf16`` gives garbage) and float32 ->
  bfloat16 stores truncate instead of rounding to nearest even (bf16 loads and
  bf16 -> bf16 copies are exact). So ``selective_state_update`` and
  ``causal_conv1d_update`` run with every bfloat16 argument upcast to float32
  (exact) and their results cast back to bfloat16 with ``ml_dtypes`` (round to
  nearest even, as a GPU store does; untouched elements keep their bits). On a
  GPU, vLLM's conv kernel multiplies bf16 by bf16 in bf16, so the GPU result
  may differ from this by an ulp.
  float16 is handled exactly by the interpreter and is not upcast.

Argument differences from vLLM's signatures (documented per adapter): padded
``idx_mapping`` rows (-1) are trimmed before vLLM's combine kernel, as vLLM's
runner passes only the real rows; ``D`` / ``dt_bias`` default to zeros
(vLLM requires them); ``out`` buffers are allocated zero-filled.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import os
import sys
import types
import warnings
from unittest import mock

import numpy as np

from kvjax.testing.convert import to_numpy, to_torch, torch_dtype

__all__ = [
    "INSTALL_COMMAND",
    "VLLM_VERSION",
    "available",
    "causal_conv1d_update",
    "combine_sampled_and_draft_tokens",
    "interpreted",
    "reason",
    "selective_state_update",
    "triton_reshape_and_cache_flash",
    "use_interpreter_without_gpu",
]

VLLM_VERSION = "0.33.0"
INSTALL_COMMAND = "bash scripts/install_vllm_oracle.sh"
# What the host-side capability queries are told in interpreter mode: an H100.
PRETEND_CAPABILITY = (9, 0)

_KERNEL_MODULES = (
    "vllm.v1.worker.gpu.input_batch",
    "vllm.v1.attention.ops.triton_reshape_and_cache_flash",
    "vllm.model_executor.layers.mamba.ops.mamba_ssm",
    "vllm.model_executor.layers.mamba.ops.causal_conv1d",
)


def _no_cuda_torch() -> bool:
    """True when torch is installed and sees no CUDA device (the interpreter's case)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return not torch.cuda.is_available()


def use_interpreter_without_gpu() -> bool:
    """Set ``TRITON_INTERPRET=1`` now if torch sees no CUDA device; True if it is set.

    Triton reads the variable when ``@triton.jit`` decorates, and its own
    ``triton.language`` helpers (``tl.sum``, ...) are decorated when Triton is
    first imported -- which importing ``transformers``' models does. A process
    that imports those before the oracle (a test session) calls this first.
    """
    if os.environ.get("TRITON_INTERPRET") != "1" and "triton" not in sys.modules and _no_cuda_torch():
        os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_imported_compiled() -> bool:
    """True when Triton's language helpers were decorated without the interpreter."""
    lang = sys.modules.get("triton.language.standard")
    return lang is not None and type(getattr(lang, "sum", None)).__name__ == "JITFunction"


@contextlib.contextmanager
def _env(name: str, value: str):
    """Set environment variable ``name`` for the block, then restore it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _restore_env(snapshot: dict[str, str]) -> None:
    """Undo the environment variables vLLM's import sets for its own runtime.

    (``TF_CPP_MIN_LOG_LEVEL``, ``TORCHINDUCTOR_*``, ``TPU_SKIP_MDS_QUERY``, ... in
    0.33.0; none matters to the kernels used here, and JAX shares the process.)
    """
    for name in set(os.environ) - set(snapshot):
        del os.environ[name]
    for name, value in snapshot.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


@functools.cache
def _load() -> tuple[types.SimpleNamespace | None, str]:
    """Import vLLM's kernels once; ``(namespace, "")`` or ``(None, reason)``."""
    how = f"install it with `{INSTALL_COMMAND}`"
    try:
        import torch
    except ImportError:
        return None, f"torch is not installed (pip install torch==2.13.0), and vLLM needs it; then {how}"
    for pkg in ("vllm", "triton"):
        if importlib.util.find_spec(pkg) is None:
            return None, f"{pkg} is not installed: the vLLM {VLLM_VERSION} oracle is optional; {how}"
    version = importlib.metadata.version("vllm")
    if version != VLLM_VERSION:
        return None, f"vllm {version} is installed, the oracle is pinned to {VLLM_VERSION}; {how}"

    interpret = not torch.cuda.is_available()
    if interpret:
        stale = [m for m in _KERNEL_MODULES if m in sys.modules]
        if stale and os.environ.get("TRITON_INTERPRET") != "1":
            return None, (
                f"{stale} were imported before TRITON_INTERPRET=1 was set; import "
                "kvjax.testing.vllm (and call available()) before vLLM's kernels"
            )
        if _triton_imported_compiled():
            return None, (
                "triton was imported before TRITON_INTERPRET=1 was set (importing transformers' "
                "models imports it), so its tl.sum and friends cannot run in the interpreter; "
                "call kvjax.testing.vllm.use_interpreter_without_gpu() first, or start Python "
                "with TRITON_INTERPRET=1"
            )
        os.environ["TRITON_INTERPRET"] = "1"
        importing = _env("CUDA_VISIBLE_DEVICES", "")
    else:
        importing = contextlib.nullcontext()
    env_before = dict(os.environ)
    # vLLM configures its logger on import; keep it to errors unless the user chose a level.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        with importing, warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script_method in deps
            from vllm.model_executor.layers.mamba.ops import causal_conv1d as conv_mod
            from vllm.model_executor.layers.mamba.ops import mamba_ssm as ssm_mod
            from vllm.platforms import current_platform
            from vllm.platforms.interface import DeviceCapability
            from vllm.triton_utils import HAS_TRITON
            from vllm.v1.attention.ops import triton_reshape_and_cache_flash as kv_mod
            from vllm.v1.worker.gpu import input_batch
    except Exception as e:  # noqa: BLE001 - any import failure makes the oracle unavailable
        return None, f"vLLM {VLLM_VERSION} does not import ({type(e).__name__}: {e}); {how}"
    finally:
        _restore_env(env_before)
    if not HAS_TRITON:
        return None, "vLLM disabled Triton (no active driver; CUDA_VISIBLE_DEVICES must be empty on CPU)"
    if conv_mod.causal_conv1d_update.__module__ != conv_mod.__name__:
        return None, (
            f"vLLM picked its torch CPU conv ({conv_mod.causal_conv1d_update.__module__}) instead "
            f"of the Triton kernel: install the CUDA wheel of vllm=={VLLM_VERSION} with --no-deps"
        )
    if interpret:
        kernel = input_batch._combine_sampled_and_draft_tokens_kernel
        if type(kernel).__name__ != "InterpretedFunction":
            return None, "vLLM's Triton kernels were not built for the interpreter (TRITON_INTERPRET=1)"
    ns = types.SimpleNamespace(
        torch=torch,
        interpret=interpret,
        device="cpu" if interpret else "cuda",
        combine=input_batch.combine_sampled_and_draft_tokens,
        reshape_and_cache_flash=kv_mod.triton_reshape_and_cache_flash,
        selective_state_update=ssm_mod.selective_state_update,
        override_ssm_config=ssm_mod.override_ssm_config,
        default_ssm_config=getattr(ssm_mod, "_get_default_ssm_launch_config", None),
        causal_conv1d_update=conv_mod.causal_conv1d_update,
        current_platform=current_platform,
        DeviceCapability=DeviceCapability,
    )
    return ns, ""


def available() -> bool:
    """True when vLLM 0.33.0's kernels can run here (see :func:`reason` otherwise)."""
    return _load()[0] is not None


def reason() -> str:
    """Why the oracle is unavailable, with the install command; ``""`` when available."""
    return _load()[1]


def interpreted() -> bool:
    """True when vLLM's kernels run in Triton's CPU interpreter (False on a GPU).

    Raises:
      RuntimeError: the oracle is unavailable.
    """
    return _vllm().interpret


def _vllm() -> types.SimpleNamespace:
    ns, why = _load()
    if ns is None:
        raise RuntimeError(f"the vLLM oracle is unavailable: {why}")
    return ns


def _t(v, x, dtype=None):
    """``x`` (numpy/JAX, or already torch) as a torch tensor on the oracle's device, optionally cast."""
    t = x.to(v.device) if isinstance(x, v.torch.Tensor) else to_torch(x, device=v.device)
    return t if dtype is None else t.to(dtype)


def _opt(v, x, dtype=None):
    return None if x is None else _t(v, x, dtype)


@contextlib.contextmanager
def _pretend_gpu_capability(v):
    """Answer vLLM's host-side capability queries with :data:`PRETEND_CAPABILITY` (CPU only)."""
    if not v.interpret:
        yield
        return
    cap = v.DeviceCapability(*PRETEND_CAPABILITY)
    platform_cls = type(v.current_platform)
    with mock.patch.object(
        platform_cls, "get_device_capability", classmethod(lambda cls, device_id=0: cap)
    ), mock.patch.object(
        v.torch.cuda, "get_device_capability", lambda device=None: PRETEND_CAPABILITY
    ):
        yield


# --------------------------------------------------------------------------
# combine_sampled_and_draft_tokens (vllm/v1/worker/gpu/input_batch.py)
# --------------------------------------------------------------------------


def combine_sampled_and_draft_tokens(
    input_ids, idx_mapping, last_sampled_tokens, query_start_loc, seq_lens, prefill_len,
    draft_tokens, cu_num_logits, num_logits: int, num_new_sampled_tokens: int = 1,
):
    """vLLM's ``combine_sampled_and_draft_tokens`` -> ``(input_ids, logits_indices)`` numpy.

    Arguments as in :func:`pallas_kernels.token_combine.combine_sampled_and_draft_tokens`,
    converted to vLLM's buffer dtypes (int32, with ``last_sampled_tokens`` int64
    ``[MR, 1]`` and ``draft_tokens`` int64). vLLM has no padded rows: its runner
    passes ``idx_mapping[:num_reqs]``. So trailing -1 rows are trimmed here (an
    interior -1 row is a ``ValueError``); ``query_start_loc`` / ``seq_lens`` /
    ``cu_num_logits`` are passed whole, as in vLLM.

    Returns:
      ``input_ids`` int32 ``[T]`` and ``logits_indices`` int64 ``[num_logits]``.
      vLLM allocates ``logits_indices`` with ``torch.empty``; entries outside
      ``[0, cu_num_logits[num_reqs])`` are uninitialised there and reported as 0
      here (kvjax's documented value).
    """
    v = _vllm()
    torch = v.torch
    idx = np.asarray(idx_mapping).astype(np.int32)
    live = idx >= 0
    num_reqs = int(live.sum())
    if not live[:num_reqs].all():
        raise ValueError(
            f"padded (-1) rows must trail the real ones for vLLM's kernel; idx_mapping={idx.tolist()}"
        )
    ids = _t(v, input_ids, torch.int32)
    last = _t(v, last_sampled_tokens, torch.int64).reshape(-1, 1)
    drafts = _t(v, draft_tokens, torch.int64)
    cu = _t(v, cu_num_logits, torch.int32)
    li = v.combine(
        ids,
        _t(v, idx[:num_reqs], torch.int32),
        last,
        _t(v, query_start_loc, torch.int32),
        _t(v, seq_lens, torch.int32),
        _t(v, prefill_len, torch.int32),
        drafts,
        cu,
        int(num_logits),
        int(num_new_sampled_tokens),
    )
    li = to_numpy(li)
    written = int(cu[num_reqs]) if num_reqs else 0
    li[written:] = 0
    return to_numpy(ids), li


# --------------------------------------------------------------------------
# triton_reshape_and_cache_flash (vllm/v1/attention/ops/triton_reshape_and_cache_flash.py)
# --------------------------------------------------------------------------


def _per_tensor_scale(v, scale, name):
    if scale is None:
        return v.torch.ones(1, dtype=v.torch.float32, device=v.device)
    a = np.asarray(scale, np.float32)
    if a.size != 1:
        raise NotImplementedError(
            f"vLLM's Triton reshape_and_cache_flash takes a per-tensor {name}; got shape {list(a.shape)}"
        )
    return _t(v, a.reshape(1))


def triton_reshape_and_cache_flash(
    key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto", k_scale=None,
    v_scale=None,
):
    """vLLM's ``triton_reshape_and_cache_flash`` -> ``(key_cache, value_cache)`` numpy.

    ``key``/``value`` ``[T, H, D]``; caches ``[num_blocks, block_size, H, D]``
    (float8_e4m3fn for ``kv_cache_dtype="fp8"``); ``slot_mapping`` ``[N]`` (only
    the first N tokens are written; slot < 0 writes nothing). Scales: per-tensor
    only (``None`` = 1.0); a per-head scale is a ``NotImplementedError`` (vLLM's
    Triton kernel loads one scalar). In interpreter mode the fp8 bytes carry
    the interpreter's conversion errors (module docstring).
    """
    v = _vllm()
    kc, vc = _t(v, key_cache), _t(v, value_cache)
    with _pretend_gpu_capability(v):
        v.reshape_and_cache_flash(
            _t(v, key), _t(v, value), kc, vc, _t(v, slot_mapping), kv_cache_dtype,
            _per_tensor_scale(v, k_scale, "k_scale"), _per_tensor_scale(v, v_scale, "v_scale"),
        )
    return to_numpy(kc), to_numpy(vc)


# --------------------------------------------------------------------------
# Mamba decode kernels (vllm/model_executor/layers/mamba/ops/)
# --------------------------------------------------------------------------


def _float_args(v, arrays):
    """Torch tensors for ``arrays`` (None kept); bf16 upcast to fp32 in interpreter mode."""
    torch = v.torch
    ts = [_opt(v, a) for a in arrays]
    upcast = v.interpret and any(t is not None and t.dtype == torch.bfloat16 for t in ts)
    if upcast:
        ts = [t.float() if t is not None and t.dtype == torch.bfloat16 else t for t in ts]
    return ts


def _fit(t, shape):
    """``t`` broadcast to ``shape`` (a stride-0 expand, as vLLM's models pass tied dims)."""
    return t if tuple(t.shape) == tuple(shape) else t.expand(*shape)


def selective_state_update(
    state, x, dt, A, B, C, D=None, dt_bias=None, z=None, dt_softplus=False,
    state_batch_indices=None, dst_state_batch_indices=None, null_block_id=0,
    num_accepted_tokens=None, cu_seqlens=None,
):
    """vLLM's Triton ``selective_state_update`` -> ``(out, state)`` numpy.

    Shapes as in :func:`pallas_kernels.mamba.selective_state_update` (with or
    without the heads axis). Broadcast shapes of ``dt`` (``[T, H, 1]``), ``A``,
    ``D`` and ``dt_bias`` are expanded with stride 0, which vLLM detects as its
    tied-head-dim case. vLLM requires ``D`` and ``dt_bias``; ``None`` is passed
    as zeros (``dt + 0`` and ``out + x * 0`` are exact for finite ``x``).
    ``out`` starts zero-filled, so tokens no sequence covers (varlen) read 0.
    bfloat16 arguments run in float32 in interpreter mode (module docstring);
    ``out`` is returned in ``x``'s dtype and ``state`` in its own.
    """
    v = _vllm()
    torch = v.torch
    state_dtype, x_dtype = np.asarray(state).dtype, np.asarray(x).dtype
    st, xt, dtt, At, Bt, Ct, Dt, dtbt, zt = _float_args(v, (state, x, dt, A, B, C, D, dt_bias, z))
    heads = st.dim() == 4
    nheads_dim = tuple(st.shape[1:3]) if heads else (st.shape[1],)
    dtt = _fit(dtt, xt.shape)
    At = _fit(At, tuple(st.shape[1:]))
    Dt = torch.zeros(nheads_dim, dtype=torch.float32, device=v.device) if Dt is None else _fit(Dt, nheads_dim)
    dtbt = (
        torch.zeros(nheads_dim, dtype=torch.float32, device=v.device)
        if dtbt is None
        else _fit(dtbt, nheads_dim)
    )
    out = torch.zeros_like(xt)
    dstate = st.shape[-1]
    if v.interpret:
        cfg = v.default_ssm_config(dstate, False) if v.default_ssm_config else (16, 4)
        launch = v.override_ssm_config(cfg)
    else:
        launch = contextlib.nullcontext()
    with launch:
        v.selective_state_update(
            st, xt, dtt, At, Bt, Ct, Dt, dtbt, z=zt, dt_softplus=bool(dt_softplus),
            state_batch_indices=_opt(v, state_batch_indices),
            dst_state_batch_indices=_opt(v, dst_state_batch_indices),
            null_block_id=int(null_block_id), out=out,
            num_accepted_tokens=_opt(v, num_accepted_tokens),
            cu_seqlens=_opt(v, cu_seqlens),
        )
    return _back(out, x_dtype), _back(st, state_dtype, state)


def _back(t, dtype: np.dtype, original=None) -> np.ndarray:
    """Torch result ``t`` as numpy in ``dtype``, undoing an interpreter-mode upcast.

    The cast rounds to nearest even (``ml_dtypes``, as a GPU store does). Where
    ``original`` is given, elements that the kernel left untouched (their
    float32 bits equal the upcast original's) keep the original bits exactly,
    so NaN payloads in rows vLLM never wrote survive the float32 detour.
    """
    a = to_numpy(t)
    dtype = np.dtype(dtype)
    if a.dtype == dtype or a.dtype != np.float32:
        return a.astype(dtype)
    b = a.astype(dtype)
    if original is not None:
        orig = np.asarray(original)
        untouched = a.view(np.uint32) == orig.astype(a.dtype).view(np.uint32)
        b = np.where(untouched, orig, b)
    return b


def causal_conv1d_update(
    x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
    num_accepted_tokens=None, query_start_loc=None, max_query_len=-1, null_block_id=0,
):
    """vLLM's Triton ``causal_conv1d_update`` -> ``(out, conv_state)`` numpy.

    Shapes as in :func:`pallas_kernels.mamba.causal_conv1d_update`. ``out`` is
    vLLM's default: ``x`` cast to the state dtype and overwritten in place, so a
    skipped (null) row keeps ``x``; it is returned in ``x``'s dtype, as vLLM
    does. With ``query_start_loc`` and ``max_query_len < 1`` the longest query
    is taken from ``query_start_loc``. bfloat16 arguments run in float32 in
    interpreter mode (module docstring).
    """
    v = _vllm()
    state_dtype, x_dtype = np.asarray(conv_state).dtype, np.asarray(x).dtype
    # vLLM's first step, x.to(conv_state.dtype), done before any upcast so it rounds the same.
    x_in_state_dtype = _t(v, x, torch_dtype(state_dtype))
    xt, cst, wt, bt = _float_args(v, (x_in_state_dtype, conv_state, weight, bias))
    if query_start_loc is not None and max_query_len < 1:
        q = np.asarray(query_start_loc)
        max_query_len = int(np.diff(q).max()) if q.size > 1 else 0
    out = v.causal_conv1d_update(
        xt, cst, wt, bt, activation,
        conv_state_indices=_opt(v, conv_state_indices),
        num_accepted_tokens=_opt(v, num_accepted_tokens),
        query_start_loc=_opt(v, query_start_loc),
        max_query_len=int(max_query_len),
        null_block_id=int(null_block_id),
    )
    # A skipped row of out is x itself (bits kept when x already has the state dtype).
    x_orig = x if x_dtype == state_dtype else None
    return _back(out, x_dtype, x_orig), _back(cst, state_dtype, conv_state)
