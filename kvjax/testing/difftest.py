"""Differential testing: every scenario through kvjax and the torch / vLLM implementations.

:func:`difftest` runs the scenarios of :mod:`kvjax.testing.scenarios` through
kvjax (the Pallas kernels or their references, and the state functions) and
through the implementations it is asked to compare with:

* ``"torch"``: :mod:`kvjax.testing.torch_ref`, what a torch runner would write;
* ``"vllm"``: vLLM 0.33.0's own kernels through :mod:`kvjax.testing.vllm`
  (optional: ``bash scripts/install_vllm_oracle.sh``).

It compares WHOLE outputs (entire caches, state pools, token buffers), each
the way its scenario says (:class:`kvjax.testing.scenarios.Compare`): bitwise
for copies and fp8 casts, exact for integers, a documented float tolerance
for the SSM / conv math. Every comparison is a row of a :class:`DiffReport`:
max abs error, max ULP error (in the output's own dtype), bitwise or not,
pass / FAIL / skip, and on failure which array differs, the first differing
index and both values.

vLLM is compared as ``tests/kernels/test_vllm_oracle.py`` does; where vLLM 0.33.0 (or
Triton's CPU interpreter) does something else on purpose or by a known bug,
the affected elements are either compared against the documented rule or
left out, and the row says so (``pass*`` in the table, with the reason in a
footnote) -- never a silent pass:

* fp8 casts in Triton's CPU interpreter are wrong (ties, saturation, NaN):
  written fp8 bytes whose quotient ``x / scale`` is not itself an fp8 value are
  compared with the documented rule ``saturate(x / scale)`` rounded to nearest
  even (the torch reference's bytes) instead of vLLM's; all other bytes are
  compared with vLLM's. On a GPU every byte is compared with vLLM's.
* per-head ``[H]`` fp8 scales: vLLM's Triton write takes one scale: skipped.
* bfloat16: the adapters run vLLM in float32 and round once (the interpreter's
  bf16 arithmetic is wrong); compared with the bf16 tolerance.
* ``causal_conv1d_update``, plain varlen, a sequence shorter than
  ``max_query_len``: vLLM shrinks that row's state window (a vLLM quirk); that
  conv-state row is not compared (outputs are).
* ``causal_conv1d_update``, speculative, ``num_accepted_tokens == 0``: vLLM
  reads window column -1; that sequence's outputs and state row are not compared.
* ``selective_state_update`` (non-speculative) with a valid source and a null
  destination: vLLM writes the null row, kvjax never does; the null row is
  not compared.
* ``combine_sampled_and_draft_tokens`` with a padded row before a real one:
  vLLM has no padded rows (its runner passes ``idx_mapping[:num_reqs]``): skipped.
* ops without a vLLM adapter are skipped with the reason.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import state as st
from kvjax.spec import KVGroupSpec
from pallas_kernels import backend as _backend, block_zero, kv_write, mamba, token_combine

from kvjax.testing import scenarios as _sc
from kvjax.testing import vllm as oracle
from kvjax.testing.convert import to_numpy, to_torch
from kvjax.testing.progress import Progress
from kvjax.testing.scenarios import Compare, Scenario

__all__ = ["AGAINST", "ArrayDiff", "DiffReport", "DiffRow", "VLLMUnavailable", "compare_arrays",
           "difftest"]

#: The implementations kvjax can be compared with.
AGAINST = ("torch", "vllm")
BACKENDS = ("reference", "pallas", "auto")


class VLLMUnavailable(RuntimeError):
    """``against`` names vLLM but its kernels cannot run here (the message says how to install it)."""


class _Skip(Exception):
    """This comparison cannot be made; the message says why."""


# --------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------


@dataclasses.dataclass
class ArrayDiff:
    """One output array of one comparison."""

    name: str
    compare: str  # Compare.describe()
    ok: bool
    bitwise: bool  # every compared element has identical bits (values for integers)
    max_abs: float  # max |kvjax - other| over compared elements (inf: NaN / inf mismatch)
    max_ulp: float  # max distance in units in the last place of the output dtype (ints: |diff|)
    reason: str = ""  # on failure: what differs, where, both values
    excluded: int = 0  # elements left out of the comparison (see notes)
    # "close" only: max of |got - want| / (atol + rtol * |want|) (<= 1 passes)
    tolerance_used: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)  # exclusions / rule substitutions


@dataclasses.dataclass
class DiffRow:
    """One (op, scenario, against) comparison."""

    op: str
    scenario: str
    against: str
    status: str  # "pass", "FAIL" or "skip"
    seed: int
    bitwise: bool | None = None
    max_abs: float | None = None
    max_ulp: float | None = None
    reason: str = ""  # FAIL: the first failing array's reason; skip: why
    notes: list[str] = dataclasses.field(default_factory=list)
    arrays: list[ArrayDiff] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"

    @property
    def key(self) -> str:
        return f"{self.op}/{self.scenario} vs {self.against}"


def _json_float(v):
    if v is None or np.isfinite(v):
        return v
    return str(v)


@dataclasses.dataclass
class DiffReport:
    """The result of :func:`difftest`: one :class:`DiffRow` per (op, scenario, against)."""

    rows: list[DiffRow]
    config: dict
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """No FAIL row, and at least one comparison was actually made."""
        return not self.failures and any(r.status == "pass" for r in self.rows)

    @property
    def failures(self) -> list[DiffRow]:
        return [r for r in self.rows if r.failed]

    def counts(self) -> dict:
        c = {"rows": len(self.rows), "pass": 0, "bitwise": 0, "pass_with_notes": 0, "skip": 0,
             "FAIL": 0}
        for r in self.rows:
            c[r.status] += 1
            c["bitwise"] += bool(r.status == "pass" and r.bitwise)
            c["pass_with_notes"] += bool(r.status == "pass" and r.notes)
        return c

    def summary(self) -> str:
        c = self.counts()
        verdict = "OK" if self.ok else ("FAILED" if c["FAIL"] else "NOTHING COMPARED")
        return (f"{verdict}: {c['rows']} comparisons: {c['pass']} pass ({c['bitwise']} bitwise, "
                f"{c['pass_with_notes']} with documented exclusions), {c['skip']} skipped, "
                f"{c['FAIL']} FAIL  [kvjax kernels: {self.config.get('kvjax_kernels')}, "
                f"seed {self.config.get('seed')}, {self.seconds:.1f} s]")

    def table(self, *, details: bool = True) -> str:
        """The op x scenario table (text), footnotes, the failures in full and a summary line."""
        header = ("op", "scenario", "vs", "max abs err", "max ulp", "bitwise", "result")
        notes: dict[str, tuple[int, set]] = {}  # reason -> (footnote number, array names)
        lines = []
        for r in self.rows:
            refs = []
            for n in ([r.reason] if r.status == "skip" else r.notes):
                who, _, why = n.partition(": ")
                num, names = notes.setdefault(why, (len(notes) + 1, set()))
                names.add(who)
                if num not in refs:
                    refs.append(num)
            result = {"pass": "pass*" if r.notes else "pass", "skip": "skip", "FAIL": "FAIL"}[r.status]
            if refs:
                result += " " + ",".join(f"[{i}]" for i in refs)
            lines.append((r.op, r.scenario, r.against, _fmt_err(r.max_abs), _fmt_err(r.max_ulp),
                          "-" if r.bitwise is None else ("yes" if r.bitwise else "no"), result))
        widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h)
                  for i, h in enumerate(header)]
        out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
               "  ".join("-" * w for w in widths)]
        out += ["  ".join(c.ljust(w) for c, w in zip(l, widths)).rstrip() for l in lines]
        if notes:
            out.append("")
            out += [f"[{i}] {', '.join(sorted(who))}: {why}" for why, (i, who) in notes.items()]
        if details and self.failures:
            out.append("")
            for r in self.failures:
                out.append(f"FAIL {r.key} (scenario seed {r.seed}):")
                bad = [a for a in r.arrays if not a.ok]
                out += [f"  {a.reason}" for a in bad] or [f"  {r.reason}"]
        out.append("")
        out.append(self.summary())
        return "\n".join(out)

    def to_json(self) -> dict:
        """A JSON-serialisable dict (non-finite errors as strings)."""
        def row(r: DiffRow) -> dict:
            d = dataclasses.asdict(r)
            for k in ("max_abs", "max_ulp"):
                d[k] = _json_float(d[k])
            for a in d["arrays"]:
                for k in ("max_abs", "max_ulp", "tolerance_used"):
                    a[k] = _json_float(a[k])
            return d
        return {"ok": self.ok, "summary": self.summary(), "counts": self.counts(),
                "config": self.config, "seconds": self.seconds, "rows": [row(r) for r in self.rows]}


def _fmt_err(v) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    if not np.isfinite(v):
        return "inf"
    if float(v).is_integer() and abs(v) < 1e6:
        return str(int(v))
    return f"{v:.2e}"


# --------------------------------------------------------------------------
# array comparison
# --------------------------------------------------------------------------

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _is_int(a: np.ndarray) -> bool:
    return a.dtype.kind in "iub"


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(_UINT[a.dtype.itemsize])


def _ordered(a: np.ndarray) -> np.ndarray:
    """Float bits -> int64 keys whose differences count representable values (ULPs)."""
    n = a.dtype.itemsize * 8
    b = _bits(a).astype(np.uint64)
    mag = (b & np.uint64((1 << (n - 1)) - 1)).astype(np.int64)
    return np.where((b >> np.uint64(n - 1)) == 1, -mag, mag)


def _fmt_value(a: np.ndarray, idx) -> str:
    v = a[idx]
    if _is_int(a):
        return str(int(v))
    return f"{float(v)!r} ({a.dtype}, 0x{int(_bits(a)[idx]):0{2 * a.dtype.itemsize}x})"


def compare_arrays(name: str, got, want, cmp: Compare, *, other: str = "other",
                   exclude: Sequence[tuple[np.ndarray, str]] = (),
                   notes: Sequence[str] = (), nan_payload: str | None = None) -> ArrayDiff:
    """Compare kvjax's ``got`` with ``want`` (the whole array) as ``cmp`` says.

    ``exclude``: ``(bool mask, reason)`` pairs of elements not to compare; each
    becomes a note. ``nan_payload``: if given, a bitwise comparison accepts two
    NaNs with different bits, noting this reason. ``other`` names ``want``'s
    implementation in the reason.
    """
    got, want = np.asarray(got), np.asarray(want)
    notes = list(notes)
    fail = dict(name=name, compare=cmp.describe(), ok=False, bitwise=False, max_abs=np.inf,
                max_ulp=np.inf, notes=notes)
    if got.shape != want.shape:
        return ArrayDiff(**fail, reason=f"{name}: shape {list(got.shape)} (kvjax) != "
                                        f"{list(want.shape)} ({other})")
    if _is_int(got) != _is_int(want) or (cmp.kind == "bitwise" and got.dtype != want.dtype):
        return ArrayDiff(**fail, reason=f"{name}: dtype {got.dtype} (kvjax) != {want.dtype} ({other})")
    keep = np.ones(got.shape, bool)
    for mask, why in exclude:
        mask = np.broadcast_to(np.asarray(mask, bool), got.shape)
        if (mask & keep).any():
            notes.append(f"{name}: elements not compared: {why}")
        keep &= ~mask
    excluded = int((~keep).sum())
    if _is_int(got):
        g, w = got.astype(np.int64), want.astype(np.int64)
        err = np.abs(g - w).astype(np.float64)
        same = g == w
        bad = ~same & keep
        ulp = err
        what = "differ"
    else:
        g, w = got.astype(np.float64), want.astype(np.float64)
        gn, wn = np.isnan(g), np.isnan(w)
        same = (_bits(got) == _bits(want)) if got.dtype == want.dtype else ((g == w) | (gn & wn))
        with np.errstate(invalid="ignore", over="ignore"):
            err = np.where(g == w, 0.0, np.abs(g - w))  # equal infinities: 0
        err = np.where(gn & wn, 0.0, np.where(gn | wn, np.inf, err))
        if got.dtype == want.dtype:
            ulp = np.abs(_ordered(got) - _ordered(want)).astype(np.float64)
            ulp = np.where(gn & wn, 0.0, np.where(gn | wn, np.inf, ulp))
        else:
            ulp = np.where(same, 0.0, np.inf)
        if cmp.kind == "close":
            with np.errstate(invalid="ignore"):
                within = err <= cmp.atol + cmp.rtol * np.abs(w)
            bad = ~(same | (gn & wn) | within) & keep
            what = f"outside rtol={cmp.rtol:g} atol={cmp.atol:g}"
        elif cmp.kind == "bitwise":
            bad = ~same & keep
            what = "differ bitwise"
            payload = bad & gn & wn
            if nan_payload is not None and payload.any():
                notes.append(f"{name}: {nan_payload}")
                bad &= ~payload
        else:  # exact values
            bad = ~((g == w) | (gn & wn)) & keep
            what = "differ"
    max_abs = float(err[keep].max()) if keep.any() else 0.0
    max_ulp = float(ulp[keep].max()) if keep.any() else 0.0
    bitwise = bool(same[keep].all())
    used = None
    if cmp.kind == "close" and not _is_int(got):
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(same | (gn & wn), 0.0, err / (cmp.atol + cmp.rtol * np.abs(w)))
        used = float(ratio[keep].max()) if keep.any() else 0.0
    if not bad.any():
        return ArrayDiff(name, cmp.describe(), True, bitwise, max_abs, max_ulp, notes=notes,
                         excluded=excluded, tolerance_used=used)
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    reason = (f"{name}: {int(bad.sum())} of {got.size} elements {what}; first at index {idx}: "
              f"kvjax {_fmt_value(got, idx)}, {other} {_fmt_value(want, idx)}")
    return ArrayDiff(name, cmp.describe(), False, bitwise, max_abs, max_ulp, reason=reason,
                     excluded=excluded, tolerance_used=used, notes=notes)


# --------------------------------------------------------------------------
# implementations: kvjax, torch, vLLM
# --------------------------------------------------------------------------


def _np(x) -> np.ndarray:
    return np.asarray(x)


#: The ops whose kvjax kernel and torch reference both take the scenario's arguments as they
#: are and return a tuple: the names of its outputs, in order.
_TUPLE_OUTPUTS = {
    "reshape_and_cache_flash": ("key_cache", "value_cache"),
    "selective_state_update": ("out", "state"),
    "causal_conv1d_update": ("out", "conv_state"),
    "selective_scan_varlen": ("out", "state"),
    "causal_conv1d_varlen": ("out", "conv_states"),
    "combine_sampled_and_draft_tokens": ("input_ids", "logits_indices"),
}
#: The pallas_kernels module of each of those ops (its function is looked up at call time).
_KERNEL_MODULE = {"reshape_and_cache_flash": kv_write, "selective_state_update": mamba,
                  "causal_conv1d_update": mamba, "selective_scan_varlen": mamba,
                  "causal_conv1d_varlen": mamba, "combine_sampled_and_draft_tokens": token_combine}


def _reqstate_outputs(stage: str, s, convert) -> dict[str, np.ndarray]:
    """``{"<stage>.<field>": array}`` for every compared request-state field of ``s``."""
    return {f"{stage}.{k}": convert(getattr(s, k)) for k in _sc.REQSTATE_FIELDS}


def _kvjax(op: str, a: dict, backend: str, interpret) -> dict[str, np.ndarray]:
    """Run ``op`` through kvjax. Kernels are looked up at call time (tests monkeypatch them)."""
    kw = dict(backend=backend, interpret=interpret)
    if op in _TUPLE_OUTPUTS:
        res = getattr(_KERNEL_MODULE[op], op)(**a, **kw)
        return {n: _np(x) for n, x in zip(_TUPLE_OUTPUTS[op], res)}
    if op == "concat_and_cache_mla":
        return {"kv_cache": _np(kv_write.concat_and_cache_mla(**a, **kw))}
    if op == "zero_blocks":
        out = block_zero.zero_blocks(a["caches"], a["block_ids"],
                                     kernel_blocks_per_block=a["kernel_blocks_per_block"], **kw)
        return {f"caches[{i}]": _np(c) for i, c in enumerate(out)}
    # State functions: jnp, no kernel backend.
    if op == "compute_slot_mapping":
        return {"slot_mapping": _np(st.compute_slot_mapping(**a))}
    if op == "gather_block_tables":
        spec = KVGroupSpec(a["block_size"], a["max_num_blocks"], a["kernel_block_size"],
                           a["sliding_window"])
        bt = st.BlockTables(tables=(jnp.asarray(a["tables"]),),
                            num_blocks=jnp.asarray(a["num_blocks"])[None], specs=(spec,),
                            num_cache_blocks=a["num_cache_blocks"])
        bt = bt.write_rows(a["write_rows"], [a["write_block_ids"]], a["write_num_new"][None],
                           a["write_overwrite"])
        (gathered,) = bt.gather(a["idx_mapping"], a["first_positions"])
        return {"tables": _np(bt.tables[0]), "num_blocks": _np(bt.num_blocks[0]),
                "gathered": _np(gathered)}
    if op == "request_state":
        s = st.RequestState(**{k: jnp.asarray(v) for k, v in a["state"].items()})
        added = s.add_requests(st.NewRequests(**a["new"]))
        updated = added.post_update(**a["post"])
        return {**_reqstate_outputs("added", added, _np),
                **_reqstate_outputs("updated", updated, _np)}
    raise ValueError(f"unknown op {op!r}")


def _to_torch_args(a: dict) -> dict:
    def conv(v):
        if isinstance(v, np.ndarray):
            return to_torch(v)
        if isinstance(v, list) and v and isinstance(v[0], np.ndarray):
            return [to_torch(x) for x in v]
        return v
    return {k: conv(v) for k, v in a.items()}


def _torch(op: str, a: dict) -> dict[str, np.ndarray]:
    """Run ``op`` through :mod:`kvjax.testing.torch_ref` (in place on copies of the inputs)."""
    from kvjax.testing import torch_ref as tr
    t = _to_torch_args(a)
    if op in _TUPLE_OUTPUTS:
        res = getattr(tr, op)(**t)
        return {n: to_numpy(x) for n, x in zip(_TUPLE_OUTPUTS[op], res)}
    if op == "concat_and_cache_mla":
        return {"kv_cache": to_numpy(tr.concat_and_cache_mla(**t))}
    if op == "zero_blocks":
        out = tr.zero_blocks(t["caches"], t["block_ids"], t["kernel_blocks_per_block"])
        return {f"caches[{i}]": to_numpy(c) for i, c in enumerate(out)}
    if op == "compute_slot_mapping":
        return {"slot_mapping": to_numpy(tr.compute_slot_mapping(**t))}
    if op == "gather_block_tables":
        tables, counts = t["tables"].clone(), t["num_blocks"].clone()
        r = a["block_size"] // a["kernel_block_size"]
        for u, row in enumerate(a["write_rows"].tolist()):
            if row >= 0:
                n = int(a["write_num_new"][u])
                tr.append_block_ids(tables, counts, row, a["write_block_ids"][u, :n].tolist(),
                                    bool(a["write_overwrite"][u]), r)
        gathered = tr.gather_block_tables(tables, counts, t["idx_mapping"], t["first_positions"],
                                          a["sliding_window"], a["kernel_block_size"])
        return {"tables": to_numpy(tables), "num_blocks": to_numpy(counts),
                "gathered": to_numpy(gathered)}
    if op == "request_state":
        s = tr.TorchRequestState(**{k: to_torch(v) for k, v in a["state"].items()})
        new = a["new"]
        for u, row in enumerate(new["rows"].tolist()):
            if row >= 0:
                n = int(new["num_tokens"][u])
                s.add_request(row, new["token_ids"][u, :n].tolist(), int(new["prompt_len"][u]),
                              int(new["num_computed_tokens"][u]), float(new["temperature"][u]),
                              float(new["top_p"][u]), int(new["top_k"][u]), int(new["seed"][u]))
        added = _reqstate_outputs("added", s, to_numpy)  # before post_update changes s in place
        s.post_update(**{k: to_torch(v) for k, v in a["post"].items()})
        return {**added, **_reqstate_outputs("updated", s, to_numpy)}
    raise ValueError(f"unknown op {op!r}")


_NO_VLLM_ADAPTER = {
    "concat_and_cache_mla": "vLLM 0.33.0 has concat_and_cache_mla only as a CUDA op (vllm._C), "
                            "absent from the CPU oracle",
    "zero_blocks": "vLLM's KVBlockZeroer zeroes through absolute device addresses (int64 "
                   "segment pointers), which have no CPU/interpreter counterpart",
    "selective_scan_varlen": "kvjax.testing.vllm has no adapter for vLLM's prefill scan "
                             "(mamba_chunk_scan_combined_varlen)",
    "causal_conv1d_varlen": "kvjax.testing.vllm has no adapter for vLLM's causal_conv1d_fn",
    "compute_slot_mapping": "vLLM's slot mapping is a method of its GPU runner's BlockTables "
                            "(UVA / staged-write buffers): no CPU adapter",
    "gather_block_tables": "vLLM's block tables live in its GPU runner's BlockTables "
                           "(UVA / staged-write buffers): no CPU adapter",
    "request_state": "vLLM's RequestState lives in its GPU runner (UVA / staged-write "
                     "buffers): no CPU adapter",
}

_FP8_RULE = ("compared with the documented rule saturate(x / scale), round to nearest even "
             "(the torch reference's bytes), not vLLM's: Triton's CPU interpreter converts "
             "float -> fp8 wrongly (ties up, no saturation, NaN -> 384; kvjax/testing/vllm.py)")
_CONV_SHORT = ("vLLM 0.33.0 quirk: a plain varlen sequence shorter than max_query_len shrinks "
               "its state window (tests/kernels/test_vllm_oracle.py xfail); outputs are compared")
_CONV_ACC0 = ("vLLM reads conv-state column -1 when num_accepted_tokens == 0 (kvjax reads "
              "offset 0; documented in causal_conv1d_update)")
_SSU_NULL_DST = ("vLLM's non-speculative path writes the null row for a valid src with a null "
                 "dst; kvjax never writes row null_block_id")


def _fp8_inexact_mask(a: dict, name: str, src: str, scale_name: str) -> np.ndarray:
    """bool cache-shaped: written fp8 elements whose quotient x/scale is not an fp8 value."""
    cache = a[name]
    nb, bs = cache.shape[:2]
    mask = np.zeros(cache.shape, bool).reshape(nb * bs, *cache.shape[2:])
    scale = np.float32(np.asarray(a[scale_name], np.float32).reshape(-1)[0])
    x = np.asarray(a[src]).astype(np.float32)
    fp8 = _sc.FP8
    for t, s in enumerate(np.asarray(a["slot_mapping"]).astype(np.int64).tolist()):
        if s < 0:
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            q = x[t] / scale
            exact = np.isfinite(q) & (np.abs(q) <= 448.0) & (q.astype(fp8).astype(np.float32) == q)
        mask[s] = ~exact
    return mask.reshape(cache.shape)


def _valid(i: int, n: int, null: int) -> bool:
    return i != null and 0 <= i < n


def _vllm(op: str, a: dict, torch_out: Callable[[], dict]):
    """vLLM's outputs, plus ``{output: [(mask, reason)]}`` exclusions and notes."""
    if op in _NO_VLLM_ADAPTER:
        raise _Skip(_NO_VLLM_ADAPTER[op])
    exclude: dict[str, list] = {}
    notes: list[str] = []
    if op == "combine_sampled_and_draft_tokens":
        idx = np.asarray(a["idx_mapping"])
        live = idx >= 0
        if not live[: int(live.sum())].all():
            raise _Skip("vLLM has no padded batch rows (its runner passes idx_mapping[:num_reqs]); "
                        "a padded row before a real one has no vLLM counterpart")
        ids, li = oracle.combine_sampled_and_draft_tokens(**a)
        return {"input_ids": ids, "logits_indices": li}, exclude, notes
    if op == "reshape_and_cache_flash":
        fp8 = a["kv_cache_dtype"] != "auto"
        if fp8 and any(np.asarray(a[s]).size != 1 for s in ("k_scale", "v_scale")):
            raise _Skip("vLLM's Triton reshape_and_cache_flash takes one per-tensor scale; "
                        "per-head [H] scales have no vLLM counterpart here")
        kc, vc = oracle.triton_reshape_and_cache_flash(**a)
        out = {"key_cache": kc, "value_cache": vc}
        if fp8 and oracle.interpreted():
            rule = torch_out()
            for name, src, scale in (("key_cache", "key", "k_scale"),
                                     ("value_cache", "value", "v_scale")):
                m = _fp8_inexact_mask(a, name, src, scale)
                if m.any():
                    out[name] = np.where(m, rule[name], out[name])
                    notes.append(f"{name}: written fp8 elements whose x / scale is not an fp8 "
                                 f"value are {_FP8_RULE}")
        return out, exclude, notes
    if op == "selective_state_update":
        out, state = oracle.selective_state_update(**a)
        sbi, dst = a["state_batch_indices"], a["dst_state_batch_indices"]
        null, L = a["null_block_id"], np.asarray(a["state"]).shape[0]
        if sbi is not None and dst is not None and a["num_accepted_tokens"] is None:
            s2 = np.asarray(sbi).reshape(len(sbi), -1)[:, 0]
            d2 = np.asarray(dst).reshape(len(dst), -1)[:, 0]
            cu = a["cu_seqlens"]
            lens = np.diff(cu) if cu is not None else np.ones(len(s2), int)
            hit = [b for b in range(len(lens)) if lens[b] > 0 and _valid(int(s2[b]), L, null)
                   and int(d2[b]) == null]
            if hit and 0 <= null < L:
                m = np.zeros(np.shape(state), bool)
                m[null] = True
                exclude["state"] = [(m, _SSU_NULL_DST)]
        return {"out": out, "state": state}, exclude, notes
    if op == "causal_conv1d_update":
        out, cs = oracle.causal_conv1d_update(**a)
        idx = np.asarray(a["conv_state_indices"]).reshape(len(a["conv_state_indices"]), -1)[:, 0]
        null, L = a["null_block_id"], np.asarray(a["conv_state"]).shape[0]
        qsl, acc = a["query_start_loc"], a["num_accepted_tokens"]
        x = np.asarray(a["x"])
        if qsl is not None:
            bounds = list(zip(np.asarray(qsl)[:-1].tolist(), np.asarray(qsl)[1:].tolist()))
            maxq = a["max_query_len"] if a["max_query_len"] >= 1 else max(e - s for s, e in bounds)
        else:
            n = x.shape[2] if x.ndim == 3 else 1
            bounds, maxq = [(0, n)] * len(idx), n
        m_state = np.zeros(np.shape(cs), bool)
        m_out = np.zeros(np.shape(out), bool)
        short = acc0 = False
        for b, (s, e) in enumerate(bounds):
            if e <= s or not _valid(int(idx[b]), L, null):
                continue
            if acc is None and qsl is not None and e - s < maxq:
                m_state[int(idx[b])] = short = True
            if acc is not None and int(acc[b]) == 0:
                m_state[int(idx[b])] = acc0 = True
                if qsl is not None:
                    m_out[s:e] = True
                else:
                    m_out[b] = True
        if short:
            exclude["conv_state"] = [(m_state, _CONV_SHORT)]
        if acc0:
            exclude.setdefault("conv_state", []).append((m_state, _CONV_ACC0))
            exclude["out"] = [(m_out, _CONV_ACC0)]
        return {"out": out, "conv_state": cs}, exclude, notes
    raise _Skip(f"no vLLM adapter for {op}")


# --------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------


def _normalize_against(against) -> tuple[str, ...]:
    if isinstance(against, str):
        against = AGAINST if against == "all" else (against,)
    against = tuple(dict.fromkeys(against))
    bad = [x for x in against if x not in AGAINST]
    if bad or not against:
        raise ValueError(f"against must be 'torch', 'vllm', 'all' or a tuple of {AGAINST}, got {against!r}")
    return against


def _vllm_install_message() -> str:
    """Why the oracle cannot run, and the install command once (``reason()`` may already name it)."""
    why = oracle.reason() or "kvjax.testing.vllm.available() is False"
    hint = ("" if oracle.INSTALL_COMMAND in why else
            f"\ninstall it (CPU only, no CUDA packages) with:\n    {oracle.INSTALL_COMMAND}")
    return f"the vLLM {oracle.VLLM_VERSION} oracle is unavailable: {why}{hint}"


_BF16_SCATTER_NAN = (
    "NaNs compared as values, not bits: the generic Pallas interpreter runs the GPU kernel "
    "body through XLA:CPU, which canonicalises bfloat16 NaNs (0x7fe5 -> 0x7fc0) in rows the "
    "kernel never writes; compiled on a GPU the kernel keeps them, and so do the references "
    "(pallas_kernels._xla.scatter_set) and the TPU kernels")


def _kvjax_nan_payload(sc: Scenario, got: dict, flavor: str) -> dict[str, str]:
    """bf16 outputs of the GPU flavour interpreted on XLA:CPU: NaN bits may change."""
    if _backend.platform() != "cpu" or flavor != "gpu":
        return {}
    return {n: _BF16_SCATTER_NAN for n, a in got.items()
            if a.dtype == _sc.BF16 and sc.compare_for(n).kind == "bitwise"}


def _row_from(sc: Scenario, impl: str, seed: int, got: dict, want: dict, exclude: dict,
              notes: list[str], nan_payload: dict[str, str]) -> DiffRow:
    arrays = []
    if set(got) != set(want):
        return DiffRow(sc.op, sc.name, impl, "FAIL", seed,
                       reason=f"outputs differ: kvjax {sorted(got)} vs {impl} {sorted(want)}")
    for name in got:
        arrays.append(compare_arrays(name, got[name], want[name], sc.compare_for(name),
                                     other=impl, exclude=exclude.get(name, ()),
                                     nan_payload=nan_payload.get(name)))
    all_notes = list(notes) + [n for a in arrays for n in a.notes]
    bad = [a for a in arrays if not a.ok]
    return DiffRow(
        sc.op, sc.name, impl, "FAIL" if bad else "pass", seed,
        bitwise=all(a.bitwise for a in arrays),
        max_abs=max((a.max_abs for a in arrays), default=0.0),
        max_ulp=max((a.max_ulp for a in arrays), default=0.0),
        reason=bad[0].reason if bad else "", notes=all_notes, arrays=arrays)


def _progress_reporter(progress, total: int):
    """``progress``: None/False, True (stderr), a stream, or ``callable(done, total, label)``."""
    if not progress:
        return None, None
    if callable(progress) and not hasattr(progress, "write"):
        return (lambda done, label: progress(done, total, label)), None
    bar = Progress(total, sys.stderr if progress is True else progress, unit="scenarios")
    return bar.update, bar.close


def difftest(against="torch", ops=None, cases: int = 4, seed: int = 0, backend: str = "auto",
             interpret: bool | None = None, progress=None) -> DiffReport:
    """Run every scenario of ``ops`` through kvjax and ``against``; compare whole outputs.

    Args:
      against: ``"torch"``, ``"vllm"``, ``"all"`` or a tuple of those names.
      ops: op names (:data:`kvjax.testing.scenarios.OPS`); default all.
      cases: random scenarios per op, on top of the adversarial ones.
      seed: base seed; each scenario draws from ``scenario_seed(seed, scenario)``.
      backend, interpret: kvjax kernel selection (:mod:`pallas_kernels._backend`):
        ``"reference"`` (jnp), ``"pallas"`` (the Pallas kernels; interpreted on a
        CPU), ``"auto"``. The state functions have no kernel backend.
      progress: None, True (a bar on stderr), a stream, or ``callable(done, total, label)``.

    Returns:
      A :class:`DiffReport` (``.ok``, ``.rows``, ``.table()``, ``.to_json()``).

    Raises:
      ValueError: bad ``against`` / ``ops`` / ``cases`` / ``backend``.
      VLLMUnavailable: ``against`` includes vLLM and it cannot run here.
    """
    impls = _normalize_against(against)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    choice = _backend.resolve(backend, interpret)
    scs = _sc.scenarios(ops, cases)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an int, got {seed!r}")
    config = dict(against=list(impls), ops=sorted({s.op for s in scs}, key=_sc.OPS.index),
                  cases=cases, seed=int(seed), backend=backend, interpret=interpret,
                  kvjax_kernels=choice.flavor + (" (interpret)" if choice.interpret else ""),
                  platform=_backend.platform(), jax_version=jax.__version__)
    if "vllm" in impls:
        if not oracle.available():
            raise VLLMUnavailable(_vllm_install_message())
        config["vllm"] = f"{oracle.VLLM_VERSION} ({'Triton interpreter' if oracle.interpreted() else 'GPU'})"
    update, close = _progress_reporter(progress, len(scs))
    rows: list[DiffRow] = []
    t_start = time.perf_counter()
    try:
        for done, sc in enumerate(scs):
            if update:
                update(done, sc.key)
            rows += _run_scenario(sc, impls, int(seed), backend, interpret, choice.flavor)
        if update:
            update(len(scs), "done")
    finally:
        if close:
            close()
    return DiffReport(rows, config, time.perf_counter() - t_start)


def _run_scenario(sc: Scenario, impls, seed: int, backend, interpret, flavor) -> list[DiffRow]:
    s = _sc.scenario_seed(seed, sc)
    inputs = sc.inputs(s)
    t0 = time.perf_counter()
    try:
        got = _kvjax(sc.op, copy.deepcopy(inputs), backend, interpret)
    except Exception as e:  # noqa: BLE001 - reported as a failure of every comparison
        return [DiffRow(sc.op, sc.name, impl, "FAIL", s, reason=f"kvjax raised {type(e).__name__}: {e}",
                        seconds=time.perf_counter() - t0) for impl in impls]
    t_kvjax = time.perf_counter() - t0
    nan_payload = _kvjax_nan_payload(sc, got, flavor)
    cache: dict[str, dict] = {}

    def torch_out():
        if "torch" not in cache:
            cache["torch"] = _torch(sc.op, copy.deepcopy(inputs))
        return cache["torch"]

    rows = []
    for impl in impls:
        t1 = time.perf_counter()
        exclude, notes = {}, []
        try:
            if impl == "torch":
                want = torch_out()
            else:
                want, exclude, notes = _vllm(sc.op, copy.deepcopy(inputs), torch_out)
        except _Skip as e:
            rows.append(DiffRow(sc.op, sc.name, impl, "skip", s, reason=f"{impl}: {e}"))
            continue
        except Exception as e:  # noqa: BLE001
            rows.append(DiffRow(sc.op, sc.name, impl, "FAIL", s,
                                reason=f"{impl} raised {type(e).__name__}: {e}"))
            continue
        row = _row_from(sc, impl, s, got, want, exclude, notes, nan_payload)
        row.seconds = t_kvjax + time.perf_counter() - t1
        rows.append(row)
    return rows

