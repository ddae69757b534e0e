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


def test_refloor_counts_attention_and_keeps_the_weights_alone(tmp_path):
    """``--refloor`` recomputes an older row's floors with bench_model's: a fresh 8k prefill of
    DeepSeek-V2-Lite's shapes adds its causal attention's products (27 layers x 16 heads x
    (192 + 128) x 2 FLOPs for each of 8192 x 8193 / 2 pairs) to the weights' products, which stay
    as ``matmul_floor_params_us``; a row already on the new floor is not marked."""
    import bench_model as bm

    m = bm.build_model("deepseek-v2-lite")
    info = bm.count_params(m)
    new = bm.floors(info, m, phase="prefill", batch=1, context=8192, tokens=8192, bw=4e12, tflops=989.0)
    attn = 27 * 16 * (192 + 128) * 2 * 8192 * 8193 // 2
    assert new["attention_flops"] == attn
    assert abs(new["matmul_floor_us"] - new["matmul_floor_params_us"] - attn / 989e12 * 1e6) < 1e-6
    base = dict(preset="deepseek-v2-lite", impl="kvjax", phase="prefill", batch=1, context=8192,
                max_model_len=32768, device_us=100_000.0, copy_bw_TBps=4.0, matmul_tflops_floor=989.0)
    old = dict(base, byte_floor_us=new["byte_floor_us"], matmul_floor_us=new["matmul_floor_params_us"])
    current = dict(base, **new, floor_ratio=100_000.0 / new["matmul_floor_us"],
                   byte_ratio=100_000.0 / new["byte_floor_us"], matmul_fraction=new["matmul_floor_us"] / 1e5)
    rows = [old, current]
    assert merge_model_runs.refloor(rows) == 1
    assert old["floors_recomputed"] and "floors_recomputed" not in current
    assert old["matmul_floor_us"] == new["matmul_floor_us"] and old["matmul_fraction"] == new["matmul_floor_us"] / 1e5


def test_refloor_refuses_a_row_without_its_bandwidth():
    """A measured row without the bandwidth its byte floor was taken at is refused by name."""
    import pytest

    row = dict(preset="deepseek-v2-lite", impl="kvjax", phase="prefill", batch=1, context=2048,
               device_us=1.0, byte_floor_us=1.0, matmul_tflops_floor=989.0, source="old.json")
    with pytest.raises(ValueError, match="old.json has no copy_bw_TBps"):
        merge_model_runs.refloor([row])
