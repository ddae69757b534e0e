"""``benchmarks/merge_model_runs.py``: rows replaced by a later part, and the merged matrix of a
preset is what the parts that still hold its kvjax rows ran."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import merge_model_runs  # noqa: E402


def _part(path, commit, matrix, rows):
    meta = dict(commit=commit, date="2026-11-29", presets=sorted(matrix), matrix=matrix,
                nvidia_smi="gpu", total_wall_s=10)
    rows = [dict(preset="p", impl="kvjax", phase=ph, batch=b, context=c, max_model_len=64, device_us=us)
            for ph, b, c, us in rows]
    with open(path, "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh)
    return str(path)


def test_replaced_rows_and_the_union_of_what_ran(tmp_path):
    decode = _part(tmp_path / "decode.json", "a", {"p": dict(decode=[[1024, [1, 16]]], prefill=[2048],
                                                               max_model_len=64)},
                   [("decode", 1, 1024, 10.0), ("decode", 16, 1024, 20.0), ("prefill", 1, 2048, 30.0)])
    long = _part(tmp_path / "long.json", "a", {"p": dict(decode=[], prefill=[8192], max_model_len=64)},
                 [("prefill", 1, 8192, 40.0)])
    again = _part(tmp_path / "again.json", "b", {"p": dict(decode=[[1024, [1, 16]], [4096, [1]]],
                                                             prefill=[2048], max_model_len=64)},
                  [("decode", 1, 1024, 9.0), ("decode", 16, 1024, 19.0), ("prefill", 1, 2048, 29.0),
                   ("decode", 1, 4096, 11.0)])
    out = tmp_path / "model.json"
    assert merge_model_runs.main([str(out), decode, long, "--replace-rows", again]) == 0
    doc = json.load(open(out))
    got = {(r["phase"], r["batch"], r["context"]): (r["device_us"], r["commit"]) for r in doc["rows"]}
    assert got == {("decode", 1, 1024): (9.0, "b"), ("decode", 16, 1024): (19.0, "b"),
                   ("prefill", 1, 2048): (29.0, "b"), ("decode", 1, 4096): (11.0, "b"),
                   ("prefill", 1, 8192): (40.0, "a")}
    # the first part holds no row now: the matrix joins the 8k part's and the replacing part's
    assert doc["meta"]["matrix"]["p"] == dict(decode=[[1024, [1, 16]], [4096, [1]]], prefill=[2048, 8192],
                                              max_model_len=64)
    assert doc["meta"]["commit"] == "a, b"


def test_prefill_from_part_adds_no_decode_batches_to_the_matrix(tmp_path):
    """A ``--prefill-from`` part keeps its kvjax prefill rows; its decode rows become
    ``kvjax-prefill-run``. The matrix (what the kvjax rows ran) takes its prefill sizes only:
    its decode batch 64 has no kvjax row (before 592072d the first part's matrix was kept and
    only its prefill list replaced; the union now joins the prefill part's decode batches)."""
    first = _part(tmp_path / "first.json", "a", {"p": dict(decode=[[1024, [1, 16]]], prefill=[2048],
                                                             max_model_len=64)},
                  [("decode", 1, 1024, 10.0), ("decode", 16, 1024, 20.0), ("prefill", 1, 2048, 30.0)])
    pre = _part(tmp_path / "pre.json", "b", {"p": dict(decode=[[1024, [64]]], prefill=[4096],
                                                         max_model_len=64)},
                [("decode", 64, 1024, 50.0), ("prefill", 1, 4096, 60.0)])
    out = tmp_path / "model.json"
    assert merge_model_runs.main([str(out), first, "--prefill-from", pre]) == 0
    doc = json.load(open(out))
    kv_decode = sorted(r["batch"] for r in doc["rows"] if r["impl"] == "kvjax" and r["phase"] == "decode")
    assert kv_decode == [1, 16]
    assert doc["meta"]["matrix"]["p"]["decode"] == [[1024, [1, 16]]]
    assert doc["meta"]["matrix"]["p"]["prefill"] == [4096]
