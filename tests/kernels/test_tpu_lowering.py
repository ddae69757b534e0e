"""Every public TPU kernel lowers for TPU (Mosaic) on this CPU, at serving-like shapes.

``jax.export.export(jax.jit(f), platforms=("tpu",))`` runs Mosaic's Python lowering
without a TPU: block shapes and tiling rules, supported ops and dtypes, scalar
prefetch. The exported module must hold exactly the op's own Mosaic kernel: one
``tpu_custom_call`` whose ``kernel_name`` is the op's (:data:`KERNELS`), carrying a
serialized Mosaic body, with the cache aliased to the output where the op writes in
place. An op that fell back to its XLA reference (no call), or ran another op's kernel,
or two, fails. What only a chip checks (Mosaic's compiler passes, VMEM limits,
numerics, speed) is ``benchmarks/tpu_check.py``'s job.

``selective_scan_varlen`` and ``causal_conv1d_varlen`` have no TPU kernel (they are
jnp only, whatever the backend), so there is nothing Mosaic-specific to lower.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels import tpu_target

SD = jax.ShapeDtypeStruct
BF16, F32, FP8, I32 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.int32
TPU = dict(backend="pallas_tpu", interpret=False)
MOSAIC = "tpu_custom_call"
# Case-name prefix -> the kernel_name of its op's Mosaic kernel. The Mamba updates'
# kernels are unnamed (Pallas calls them "kernel").
KERNELS = {"flash": "kv_write_tpu", "mla": "kv_write_tpu", "pages": "kv_pages_tpu",
           "zero": "zero_blocks_tpu", "rpa": "ragged_paged_attention_kernel", "ssu": "kernel",
           "conv": "kernel", "combine": "combine_sampled_and_draft_tokens_tpu"}
# Ops whose output is a new array (no cache updated in place).
NOT_IN_PLACE = {"rpa"}
# A serialized Mosaic module in the call's backend config (JSON, quotes escaped as \22).
BODY = re.compile(r'custom_call_config\\22: \{\\22body\\22: \\22[A-Za-z0-9+/=]{16,}')


def mosaic_calls(text: str) -> list[dict]:
    """The Mosaic custom calls of an exported module's text, one dict each: ``kernel_name``,
    ``has_body`` (a serialized Mosaic module in its backend config), ``aliased`` (an
    output aliases an operand)."""
    calls = []
    for line in text.splitlines():
        if f"stablehlo.custom_call @{MOSAIC}(" not in line:
            continue
        name = re.search(r'kernel_name = "([^"]*)"', line)
        calls.append(dict(
            kernel_name=name.group(1) if name else None,
            has_body=bool(BODY.search(line)),
            aliased="output_operand_aliases" in line,
        ))
    return calls


def assert_own_kernel(name: str, text: str) -> None:
    """``text`` lowers case ``name``'s op to exactly its own Mosaic kernel (see the docstring)."""
    prefix = name.split("-")[0]
    calls = mosaic_calls(text)
    want = dict(kernel_name=KERNELS[prefix], has_body=True, aliased=prefix not in NOT_IN_PLACE)
    assert calls == [want], f"{name}: Mosaic calls {calls}, want [{want}]"


def _flash(T, H, D, bs, dtype, fp8=False, num_blocks=40):
    cache = FP8 if fp8 else dtype
    args = (SD((T, H, D), dtype), SD((T, H, D), dtype), SD((num_blocks, bs, H, D), cache),
            SD((num_blocks, bs, H, D), cache), SD((T,), I32))
    extra = ("fp8", SD((H,), F32), SD((), F32)) if fp8 else ()

    def f(k, v, kc, vc, sm, *scales):
        return pk.reshape_and_cache_flash(k, v, kc, vc, sm, *extra[:1], *scales, **TPU)

    return f, args + extra[1:]


def _mla(T, L, R, bs, dtype, fp8=False, num_blocks=40):
    args = (SD((T, L), dtype), SD((T, R), dtype), SD((num_blocks, bs, L + R), FP8 if fp8 else dtype),
            SD((T,), I32))

    def f(kv_c, k_pe, cache, sm, *scale):
        return pk.concat_and_cache_mla(kv_c, k_pe, cache, sm, *(("fp8",) if fp8 else ()), *scale,
                                       **TPU)

    return f, args + ((SD((), F32),) if fp8 else ())


def _pages(T, H, D, bs, dtype, fp8=False, packed=False, num_pages=40):
    cache = FP8 if fp8 else dtype
    p = 4 // jnp.dtype(cache).itemsize
    row = (2 * H // p, p, D) if packed else (2 * H, D)
    args = (SD((T, H, D), dtype), SD((T, H, D), dtype), SD((num_pages, bs) + row, cache),
            SD((T,), I32))
    extra = ("fp8", SD((H,), F32), SD((), F32)) if fp8 else ()

    def f(k, v, pages, sm, *scales):
        return pk.write_kv_pages(k, v, pages, sm, *extra[:1], *scales, **TPU)

    return f, args + extra[1:]


def _rpa(T, Hq, Hkv, D, ps, W, R, dtype, fp8=False, num_pages=40):
    """JAX's ragged paged attention (``T`` query tokens, ``R`` rows of ``W`` pages)."""
    args = (SD((T, Hq, D), dtype), SD((num_pages, ps, 2 * Hkv, D), FP8 if fp8 else dtype),
            SD((R,), I32), SD((R, W), I32), SD((R + 1,), I32), SD((1,), I32))
    scales = dict(k_scale=0.5, v_scale=0.25) if fp8 else {}

    def f(*a):
        return pk.ragged_paged_attention(*a, sm_scale=D**-0.5, **scales, **TPU)

    return f, args


def _zero(n_ids, r, shapes_dtypes):
    args = tuple(SD(s, d) for s, d in shapes_dtypes) + (SD((n_ids,), I32),)

    def f(*a):
        return pk.zero_blocks(list(a[:-1]), a[-1], kernel_blocks_per_block=r, **TPU)

    return f, args


def _ssu(T, H, P, Ns, G, state_dtype, x_dtype, mode="decode", L=33, W=4):
    """mode: "decode" (one token per sequence), "spec" (W-token windows), "varlen"."""
    n = T if mode == "decode" else T // W
    idx = SD((n, W) if mode == "spec" else (n,), I32)
    args = [SD((L, H, P, Ns), state_dtype), SD((T, H, P), x_dtype), SD((T, H, 1), x_dtype),
            SD((H, 1, 1), F32), SD((T, G, Ns), x_dtype), SD((T, G, Ns), x_dtype),
            SD((H, P), F32), SD((H, 1), F32), SD((T, H, P), x_dtype), idx]
    if mode == "spec":
        args += [SD((n,), I32), SD((n + 1,), I32)]
    elif mode == "varlen":
        args += [SD((n + 1,), I32)]

    def f(state, x, dt, A, B, C, D, dt_bias, z, idx, *rest):
        acc, cu = (rest if mode == "spec" else (None, rest[0] if rest else None))
        return pk.selective_state_update(state, x, dt, A, B, C, D, dt_bias, z, True, idx, idx,
                                         num_accepted_tokens=acc, cu_seqlens=cu, **TPU)

    return f, tuple(args)


def _conv(batch, dim, width, S, dtype, mode="decode", q=1, L=33):
    """mode: "decode" ([batch, dim]), "spec" ([batch, dim, q] + num_accepted), "varlen"."""
    x = {"decode": (batch, dim), "spec": (batch, dim, q), "varlen": (batch * q, dim)}[mode]
    args = [SD(x, dtype), SD((L, dim, S), dtype), SD((dim, width), dtype), SD((dim,), dtype),
            SD((batch,), I32)]
    if mode == "spec":
        args.append(SD((batch,), I32))
    if mode == "varlen":
        args.append(SD((batch + 1,), I32))

    def f(x, cs, w, b, idx, *rest):
        kw = {}
        if mode == "spec":
            kw["num_accepted_tokens"] = rest[0]
        if mode == "varlen":
            kw.update(query_start_loc=rest[0], max_query_len=q)
        return pk.causal_conv1d_update(x, cs, w, b, "silu", idx, **kw, **TPU)

    return f, tuple(args)


def _combine(T, R, MR, S, num_new=1):
    num_logits = R * (S + num_new) or 1
    args = (SD((T,), I32), SD((R,), I32), SD((MR, 1), I32), SD((R + 1,), I32), SD((R,), I32),
            SD((MR,), I32), SD((MR, S), I32), SD((R + 1,), I32))

    def f(*a):
        return pk.combine_sampled_and_draft_tokens(*a, num_logits, num_new, **TPU)

    return f, args


def test_every_public_tpu_op_is_covered():
    # no TPU flavour: the varlen Mamba ops (jnp), paged_attention (GPU kernel; the TPU path is
    # ragged_paged_attention over the rpa layout), grouped_matmul and moe_route (GPU kernels;
    # their jnp references on TPU) and group_tiles (a jnp helper)
    ops = {n for n in pk.__all__ if n[0].islower()} - {"selective_scan_varlen",
                                                        "causal_conv1d_varlen", "paged_attention",
                                                        "grouped_matmul", "moe_route", "group_tiles"}
    prefixes = {"reshape_and_cache_flash": "flash", "concat_and_cache_mla": "mla",
                "write_kv_pages": "pages", "zero_blocks": "zero",
                "ragged_paged_attention": "rpa",
                "selective_state_update": "ssu", "causal_conv1d_update": "conv",
                "combine_sampled_and_draft_tokens": "combine"}
    assert ops <= set(prefixes), f"add lowering cases for {sorted(ops - set(prefixes))}"
    for op, prefix in prefixes.items():
        assert any(c.startswith(prefix + "-") for c in CASES), op


KV = [((64, 16, 8, 128), BF16), ((64, 16, 8, 128), BF16)]
CASES = {
    # reshape_and_cache_flash: decode / prefill token counts, block sizes 16 and 128,
    # bf16 / fp32 / fp8 caches, head sizes 128, 64 and non-power-of-two 80 / 96.
    "flash-decode-bf16-bs16": _flash(8, 8, 128, 16, BF16),
    "flash-prefill-bf16-bs128": _flash(2048, 8, 128, 128, BF16),
    "flash-decode-f32-d80-bs16": _flash(5, 4, 80, 16, F32),
    "flash-prefill-f32-d96-bs128": _flash(300, 2, 96, 128, F32),
    "flash-decode-fp8-bs16": _flash(8, 8, 128, 16, BF16, fp8=True),
    "flash-prefill-fp8-d80-bs128": _flash(520, 4, 80, 128, BF16, fp8=True),
    "flash-decode-h1-d64-bs16": _flash(3, 1, 64, 16, BF16),
    # concat_and_cache_mla: DeepSeek (512 + 64) and non-power-of-two latents.
    "mla-decode-bf16-bs16": _mla(8, 512, 64, 16, BF16),
    "mla-prefill-bf16-bs128": _mla(1024, 512, 64, 128, BF16),
    "mla-decode-f32-l320r48-bs16": _mla(6, 320, 48, 16, F32),
    "mla-decode-fp8-bs16": _mla(8, 512, 64, 16, BF16, fp8=True),
    "mla-prefill-fp8-l320r48-bs128": _mla(200, 320, 48, 128, BF16, fp8=True),
    # write_kv_pages: ragged-paged-attention layout, plain and packed (rank 5).
    "pages-decode-bf16-bs16": _pages(8, 8, 128, 16, BF16),
    "pages-prefill-bf16-packed-bs128": _pages(1024, 4, 128, 128, BF16, packed=True),
    "pages-decode-f32-d80-bs16": _pages(5, 2, 80, 16, F32),
    "pages-prefill-fp8-packed-bs128": _pages(300, 4, 128, 128, BF16, fp8=True, packed=True),
    # ragged_paged_attention (JAX's kernel): decode and prefill, bf16 and fp8 pages.
    "rpa-decode-bf16-ps16": _rpa(8, 8, 2, 128, 16, 8, 8, BF16),
    "rpa-prefill-fp8-ps128": _rpa(512, 8, 2, 128, 128, 4, 4, BF16, fp8=True),
    # zero_blocks: KV caches of both block sizes plus state pools, 1 and 2 kernel blocks
    # per logical block, one id (decode-sized) and many.
    "zero-kv-bs16": _zero(1, 1, KV),
    "zero-kv-bs128-r2": _zero(64, 2, [((64, 128, 8, 128), BF16), ((64, 128, 8, 80), F32)]),
    "zero-mixed-fp8-state": _zero(
        7, 1, [((33, 16, 4, 96), FP8), ((33, 4, 64, 128), F32), ((33, 256, 3), BF16)]
    ),
    # selective_state_update: decode, speculative windows, varlen; f32/bf16 states.
    "ssu-decode-f32": _ssu(8, 4, 64, 128, 1, F32, BF16),
    "ssu-decode-bf16-p80-n48": _ssu(5, 6, 80, 48, 2, BF16, BF16),
    "ssu-spec-f32": _ssu(16, 4, 64, 128, 2, F32, BF16, mode="spec"),
    "ssu-varlen-f32-prefill": _ssu(256, 8, 64, 128, 1, F32, F32, mode="varlen", W=64),
    # causal_conv1d_update: decode, speculative, varlen; power-of-two and odd dims.
    "conv-decode-bf16": _conv(8, 256, 4, 3, BF16),
    "conv-decode-f32-dim200": _conv(5, 200, 4, 3, F32),
    "conv-spec-bf16": _conv(4, 256, 4, 6, BF16, mode="spec", q=4),
    "conv-varlen-f32-prefill": _conv(4, 384, 4, 3, F32, mode="varlen", q=64),
    # combine_sampled_and_draft_tokens: with and without drafts, num_new 1 and 0.
    "combine-decode-drafts": _combine(64, 4, 8, 2),
    "combine-one-row-no-drafts": _combine(16, 1, 3, 0),
    "combine-prefill-num-new-0": _combine(4096, 64, 128, 3, num_new=0),
}


def _export(f, args, target=None):
    fresh = lambda *a: f(*a)  # noqa: E731 - a new function: nothing cached from earlier traces
    if target is None:  # a bare export, as a user would write it
        return jax.export.export(jax.jit(fresh), platforms=("tpu",))(*args)
    return tpu_target.export(fresh, *args, target=target)


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_lowers_for_tpu(name):
    f, args = CASES[name]
    assert_own_kernel(name, _export(f, args).mlir_module())


def test_a_fallback_to_the_reference_is_caught():
    # The same op with backend="reference": plain XLA, no Mosaic call; the check says so.
    args = (SD((40, 16, 8, 128), BF16), SD((3,), I32))
    text = _export(lambda c, i: pk.zero_blocks([c], i, backend="reference"), args).mlir_module()
    assert mosaic_calls(text) == []
    with pytest.raises(AssertionError, match="zero-kv-bs16: Mosaic calls \\[\\]"):
        assert_own_kernel("zero-kv-bs16", text)


@pytest.mark.parametrize("target", sorted(tpu_target.TARGETS))
def test_kernels_lower_for_each_target(target):
    # One representative per op for every generation: the target, not the local
    # device, answers Mosaic's chip questions.
    for name in ("flash-decode-fp8-bs16", "mla-decode-bf16-bs16", "pages-decode-bf16-bs16", "zero-kv-bs16",
                 "ssu-spec-f32", "conv-spec-bf16", "combine-decode-drafts", "rpa-decode-bf16-ps16"):
        f, args = CASES[name]
        assert_own_kernel(name, _export(f, args, target=target).mlir_module())


# --------------------------------------------------------------------------
# Target resolution (pallas_kernels.tpu_target)
# --------------------------------------------------------------------------


def test_resolve_order(monkeypatch):
    monkeypatch.delenv(tpu_target.TARGET_ENV, raising=False)
    assert tpu_target.resolve().name == tpu_target.DEFAULT_TARGET  # CPU host: the default
    assert tpu_target.resolve("v5e").name == "v5e"
    assert tpu_target.resolve("TPU v6 lite").name == "v6e"  # a JAX device kind
    monkeypatch.setenv(tpu_target.TARGET_ENV, "v5p")
    assert tpu_target.resolve().name == "v5p"  # static config beats the default
    assert tpu_target.resolve("v7").name == "v7"  # an explicit target beats both
    with tpu_target.lowering("v7") as t:
        assert t.name == "v7" and tpu_target.resolve().name == "v7"
    monkeypatch.setenv(tpu_target.TARGET_ENV, "v9")
    with pytest.raises(ValueError, match=tpu_target.TARGET_ENV):
        tpu_target.resolve()
    with pytest.raises(ValueError, match="target must be"):
        tpu_target.resolve("TPU v99")


def test_lowering_keeps_the_callers_mesh_axes():
    mesh = jax.sharding.AbstractMesh((2, 2), ("data", "model"))
    with jax.sharding.use_abstract_mesh(mesh), tpu_target.lowering("v5e"):
        inner = jax.sharding.get_abstract_mesh()
        assert inner.axis_names == ("data", "model") and inner.axis_sizes == (2, 2)
        assert inner.abstract_device.device_kind == "TPU v5 lite"


def test_rpa_block_sizes_come_from_the_target_off_chip():
    # On this CPU JAX's tuning table would ask the local device (and fail): explicit sizes.
    assert tpu_target.rpa_block_sizes(300, 5) == {"num_kv_pages_per_block": 128,
                                                  "num_queries_per_block": 5}
    assert tpu_target.rpa_block_sizes(3, 4096) == {"num_kv_pages_per_block": 3,
                                                   "num_queries_per_block": 32}


def test_explicit_target_never_asks_the_local_device(monkeypatch):
    # With Mosaic's table of extra device kinds emptied, "cpu" is unknown to Mosaic:
    # lowering under an explicit target must not need it, nor register anything.
    registry = {}
    monkeypatch.setattr(tpu_target._mosaic_tpu_info, "registry", registry)
    monkeypatch.setattr(tpu_target, "_registered_fallback", {})
    tpu_target._mosaic_tpu_info.get_tpu_info.cache_clear()
    f, args = CASES["combine-decode-drafts"]  # its lowering asks Mosaic for the chip
    assert_own_kernel("combine-decode-drafts", _export(f, args, target="v5e").mlir_module())
    assert registry == {}
    tpu_target._mosaic_tpu_info.get_tpu_info.cache_clear()


# --------------------------------------------------------------------------
# benchmarks/tpu_check.py: its dry run (TPU interpreter + Mosaic export)
# --------------------------------------------------------------------------


def _tpu_check(monkeypatch):
    root = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("tpu_check", root / "benchmarks" / "tpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "tpu_check", module)  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


def test_tpu_check_dry_run_on_the_smallest_case(capsys, monkeypatch):
    tpu_check = _tpu_check(monkeypatch)
    assert tpu_check.main(["--dry-run", "--only", "reshape_and_cache_flash T=4 H=2 D=128 bs=16 bf"]) == 0
    out = capsys.readouterr().out
    assert "PASS check reshape_and_cache_flash" in out and "PASS lower" in out
    assert "2/2 checks passed" in out
    # The timing loop and the in-place check (donated calls) on the reference, which runs anywhere.
    case = tpu_check.all_cases(sizes=("small",))[0]
    assert tpu_check.time_us(case, "reference", iters=2, repeats=1) > 0
    assert tpu_check.in_place(case, "reference") == ""  # XLA:CPU scatters in place too


def test_vmem_budget():
    MiB = 1 << 20
    assert tpu_target.vmem_buffer_bytes((8192, 64), BF16) == 8192 * 128 * 2  # lanes pad to 128
    assert tpu_target.vmem_buffer_bytes((5,), F32) == 8 * 128 * 4  # one row, one tile
    assert tpu_target.vmem_buffer_bytes((2, 33, 130), FP8) == 2 * 64 * 256  # 32-row fp8 tiles
    fits = [("x", (4096, 128), F32, 2)]  # 4 MiB
    tpu_target.check_vmem("op", fits, hint="h", target="v5e")
    over = fits * 5  # 20 MiB: over v5e's 16 MiB, under v6e's 32 MiB
    with pytest.raises(ValueError, match=r"op: .* 20\.0 MiB .* v5e scoped VMEM limit of 16 MiB; h"):
        tpu_target.check_vmem("op", over, hint="h", target="v5e")
    tpu_target.check_vmem("op", over, hint="h", target="v6e")
    assert tpu_target.TARGETS["v6e"].scoped_vmem_bytes == 32 * MiB


@pytest.mark.parametrize("name, f_args", [
    ("ssu", _ssu(8192, 1, 64, 128, 1, F32, BF16)),  # ~24 MiB: all tokens of a head per block
    ("conv", _conv(4, 16384, 4, 3, F32)),  # ~18 MiB: [dim, S] state rows pad S to 128 lanes
])
def test_shapes_beyond_the_targets_vmem_are_rejected_before_lowering(name, f_args):
    f, args = f_args
    with pytest.raises(ValueError, match=r"needs about .* MiB of VMEM .* v5e scoped VMEM limit"):
        _export(f, args, target="v5e")
    assert_own_kernel(name, _export(f, args, target="v6e").mlir_module())  # 32 MiB: fits
