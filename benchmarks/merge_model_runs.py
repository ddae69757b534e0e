"""Merge several ``bench_model.py --gpu-run`` results into one ``<date>-<gpu>-model.json``.

A real-size run of every preset, its transformers peers and its profiles does not fit one
9-minute device call; each call runs part of the matrix (``--preset``, ``--decode``,
``--prefill``, ``--peers-only``). This joins their rows (each row keeps the ``commit`` and
``source`` it came from) and lists the parts in ``meta["parts"]``:

    python benchmarks/merge_model_runs.py OUT.json PART.json [PART.json ...]

``--baseline PART.json`` adds rows measured at a shorter ``max_model_len`` as
``impl: "kvjax-short-table"`` (the attention-vs-``max_model_len`` comparison).
``--prefill-from PART.json`` takes that part's kvjax prefill rows in place of the other parts'
kvjax prefill rows of the same presets (a later run on newer code); its other rows are kept
under ``impl: "kvjax-prefill-run"``. ``--replace-presets PART.json`` (repeatable) takes every row
of the presets that part measured, kvjax and transformers, in place of the other parts' rows of
those presets (a later run of a whole preset, its peers in the same run). ``--replace-rows
PART.json`` (repeatable): each of that part's rows replaces the other parts' row of the same
preset, impl, phase, batch, context and ``max_model_len``; rows it did not measure are kept (a
later run of some rows, e.g. the kvjax rows without their peers).

``--refloor``: every measured kvjax row's floors recomputed by ``bench_model.floors`` (the
preset's shapes, the row's own copy bandwidth and TFLOP/s), so that rows measured under an older
floor read as the newer ones; a row so changed is marked ``floors_recomputed``, and the merged
``meta`` takes bench_model's current method text (it defines the floors).
"""

from __future__ import annotations

import argparse
import json
import os


def _union(a: dict | None, b: dict) -> dict:
    """Two parts' matrices of one preset as one: their decode batches per context and their
    prefill sizes joined (the other fields from ``a``, the first part)."""
    if a is None:
        return dict(b)
    decode = {}
    for ctx, batches in list(a.get("decode") or []) + list(b.get("decode") or []):
        decode.setdefault(ctx, set()).update(batches)
    return dict(a, decode=[[c, sorted(bs)] for c, bs in sorted(decode.items())],
                prefill=sorted(set(a.get("prefill") or []) | set(b.get("prefill") or [])))


def _key(r: dict) -> tuple:
    return tuple(r.get(k) for k in ("preset", "impl", "phase", "batch", "context", "max_model_len"))


def refloor(rows: list) -> int:
    """Recompute the floors of every measured kvjax row in place (see the module docstring);
    returns how many changed."""
    import bench_model as bm

    models, changed = {}, 0
    for r in rows:
        if not (str(r.get("impl", "")).startswith("kvjax") and r.get("device_us") and r.get("byte_floor_us")):
            continue
        if r["preset"] not in models:
            m = bm.build_model(r["preset"])
            models[r["preset"]] = (m, bm.count_params(m))
        m, info = models[r["preset"]]
        missing = [k for k in ("copy_bw_TBps", "matmul_tflops_floor") if not r.get(k)]
        if missing:
            raise ValueError(f"--refloor: row {r['preset']} {r['phase']} b={r['batch']} ctx={r['context']} of "
                             f"{r.get('source')} has no {', '.join(missing)} (the floors' bandwidth and TFLOP/s)")
        tokens = r["batch"] if r["phase"] == "decode" else r["context"]
        fl = bm.floors(info, m, phase=r["phase"], batch=r["batch"], context=r["context"], tokens=tokens,
                       bw=r["copy_bw_TBps"] * 1e12, tflops=r["matmul_tflops_floor"])
        new = dict(fl, **bm.floor_ratios(r["device_us"], fl))
        if any(r.get(k) is None or abs(r[k] - v) > 1e-6 * max(1.0, abs(v)) for k, v in new.items()):
            r.update(new, floors_recomputed=True)
            changed += 1
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("parts", nargs="+")
    ap.add_argument("--baseline", action="append", default=[])
    ap.add_argument("--prefill-from")
    ap.add_argument("--replace-presets", action="append", default=[])
    ap.add_argument("--replace-rows", action="append", default=[])
    ap.add_argument("--refloor", action="store_true")
    a = ap.parse_args(argv)
    rows, parts, meta = [], [], None
    # (path, mode): "part", "baseline", "prefill" (--prefill-from) or "replace" (--replace-presets)
    inputs = ([(p, "part") for p in a.parts] + [(p, "baseline") for p in a.baseline]
              + ([(a.prefill_from, "prefill")] if a.prefill_from else [])
              + [(p, "replace") for p in a.replace_presets] + [(p, "rows") for p in a.replace_rows])
    for path, mode in inputs:
        doc = json.load(open(path))
        m = doc["meta"]
        meta = meta or dict(m)
        parts.append({"source": os.path.basename(path), "commit": m.get("commit"), "date": m.get("date"),
                      "presets": m.get("presets"), "matrix": m.get("matrix"), "gpu": m.get("nvidia_smi"),
                      "total_wall_s": m.get("total_wall_s"), "baseline": mode == "baseline",
                      "prefill_from": mode == "prefill", "replaces_presets": mode == "replace",
                      "replaces_rows": mode == "rows"})
        if mode == "replace":
            mine = {r["preset"] for r in doc["rows"]}
            rows = [q for q in rows if q["preset"] not in mine]
        for r in doc["rows"]:
            r = dict(r, source=os.path.basename(path), commit=m.get("commit"))
            if mode == "prefill":
                if r["impl"] == "kvjax" and r["phase"] == "prefill":
                    rows = [q for q in rows if not (q["impl"] == "kvjax" and q["phase"] == "prefill"
                                                    and q["preset"] == r["preset"] and q["source"] != r["source"])]
                elif r["impl"] == "kvjax":
                    r["impl"] = "kvjax-prefill-run"
            elif mode == "baseline":
                r["impl"] = "kvjax-short-table"
            elif mode == "rows":
                rows = [q for q in rows if _key(q) != _key(r)]
            rows.append(r)
    meta["parts"] = parts
    meta["presets"] = sorted({r["preset"] for r in rows})
    meta["matrix"] = {}
    for p in parts:  # a replacing part's matrix first, then the part that measured the kvjax rows
        if p["replaces_presets"]:
            for name, mx in (p["matrix"] or {}).items():
                meta["matrix"][name] = mx
    def measured(p):
        return {r["preset"] for r in rows if r["source"] == p["source"] and r["impl"] == "kvjax"}

    for p in parts:  # every other part that still holds kvjax rows of a preset: the union of what they ran
        if not (p["baseline"] or p["replaces_presets"] or p["prefill_from"]):
            for name, mx in (p["matrix"] or {}).items():
                if name in measured(p):
                    meta["matrix"][name] = _union(meta["matrix"].get(name), mx)
    for p in parts:  # a --prefill-from part's kvjax rows are its prefill rows: its sizes replace the lists
        if p["prefill_from"]:
            for name, mx in (p["matrix"] or {}).items():
                if name in measured(p):
                    meta["matrix"][name] = dict(meta["matrix"].get(name) or dict(mx, decode=[]),
                                                prefill=mx["prefill"])
    meta["total_wall_s"] = sum(p["total_wall_s"] or 0 for p in parts)
    meta["commit"] = ", ".join(sorted({str(p["commit"]) for p in parts}))
    if a.refloor:
        import bench_model as bm

        print(f"floors recomputed in {refloor(rows)} rows")
        meta["method_short"], meta["method"] = bm.METHOD_SHORT, bm.METHOD  # they describe the floors
    with open(a.out, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(f"{a.out}: {len(rows)} rows from {len(parts)} parts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
