"""Issue 25, adversarial pass: hostile checkpoints give one clear ValueError each.

Each message names the file and the tensor (or field), what was expected and what came; the
error is kvjax's own (raised in kvjax, nothing chained). A config.json that lies about shapes is
refused before any weight byte is read. NaN / infinite weights are refused at load (an error,
not a warning: such a weight makes every logit NaN).
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import jax
import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("transformers")
st = pytest.importorskip("safetensors.numpy")

from kvjax.models import load_pretrained  # noqa: E402
from kvjax.models.hf import loader  # noqa: E402
from conftest import edit_config, refused  # noqa: E402

NAME = "bamba"
W = "model.layers.0.mamba.in_proj.weight"  # [292, 64] float32 in the test checkpoint


def copy(hf_checkpoint, tmp_path, *, weights: bool = True) -> str:
    src, dst = hf_checkpoint(NAME), tmp_path / "ckpt"
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if weights or not f.endswith(".safetensors"):
            shutil.copy(os.path.join(src, f), dst / f)
    return str(dst)


def rewrite(path, fn, file="model.safetensors"):
    f = os.path.join(path, file)
    tensors = st.load_file(f)
    fn(tensors)
    st.save_file(tensors, f)


def edit_header(path, fn, file="model.safetensors"):
    """Rewrite one safetensors header in place (JSON edited by ``fn``), data untouched."""
    f = os.path.join(path, file)
    data = open(f, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8: 8 + n])
    fn(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    open(f, "wb").write(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


# ------------------------------------------------------------------------------ the data


@pytest.mark.parametrize("keep", ["mid_tensor", "mid_header"])
def test_truncated_safetensors(keep, hf_checkpoint, tmp_path, no_weight_read):
    path = copy(hf_checkpoint, tmp_path)
    f = os.path.join(path, "model.safetensors")
    data = open(f, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    cut = 8 + n + (len(data) - 8 - n) // 2 if keep == "mid_tensor" else 8 + n // 2
    open(f, "wb").write(data[:cut])
    if keep == "mid_tensor":
        refused([r"^model\.safetensors: truncated safetensors file: tensor '[^']+' ends at byte \d+, "
                 rf"the file has {cut}$"], path)
    else:
        refused([r"^model\.safetensors: truncated", f"file of {cut}"], path)


@pytest.mark.parametrize("bad,dtype", [(np.nan, np.float32), (np.inf, np.float32), (-np.inf, np.float32),
                                       (np.nan, ml_dtypes.bfloat16), (np.inf, np.float16)])
def test_a_non_finite_weight_is_refused_at_load(bad, dtype, hf_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "_FINITE_CHUNK", 1000)  # the first bad value and the count span chunks
    path = copy(hf_checkpoint, tmp_path)

    def plant(t):
        a = t[W].astype(dtype)
        a[3, 5] = a[200, 1] = bad
        t[W] = a

    rewrite(path, plant)
    nan = 2 if np.isnan(bad) else 0
    refused([rf"^model\.safetensors: tensor '{W}' holds {nan} NaN and {2 - nan} infinite values",
             r"first at \[3, 5\]", "expected finite weights"], path)


def test_a_float64_weight_beyond_float32_is_refused(hf_checkpoint, tmp_path):
    path = copy(hf_checkpoint, tmp_path)

    def plant(t):
        a = t[W].astype(np.float64)
        a[7, 7] = 1e300
        t[W] = a

    rewrite(path, plant)
    refused([rf"tensor '{W}' holds 0 NaN and 1 infinite \(or beyond float32\) values", r"first at \[7, 7\]"],
            path)


@pytest.mark.parametrize("dtype,name", [(np.int32, "I32"), (np.int64, "I64"), (np.uint8, "U8"), (np.bool_, "BOOL")])
def test_a_non_float_weight_is_refused(dtype, name, hf_checkpoint, tmp_path, no_weight_read):
    path = copy(hf_checkpoint, tmp_path)
    rewrite(path, lambda t: t.__setitem__(W, (t[W] > 0).astype(dtype)))
    refused(rf"^model\.safetensors: tensor '{W}' has dtype {name}, expected a floating-point weight "
            r"\(F32, BF16, F16, F64\)$", path)


def test_other_float_dtypes_load_as_the_same_weights(hf_checkpoint, tmp_path):
    """float64 / float16 tensors are weights too: converted, values as the checkpoint's."""
    path = copy(hf_checkpoint, tmp_path)
    _, ref = load_pretrained(hf_checkpoint(NAME), dtype="float32")
    rewrite(path, lambda t: t.update({W: t[W].astype(np.float64),
                                      "lm_head.weight": t["lm_head.weight"].astype(np.float16)}))
    _, params = load_pretrained(path, dtype="float32")
    a, b = ({str(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(p)} for p in (ref, params))
    assert a.keys() == b.keys()
    changed = [k for k in a if not np.array_equal(a[k], b[k])]
    assert len(changed) == 1 and "lm_head" in changed[0], changed  # float16 rounds; float64 is exact
    np.testing.assert_allclose(a[changed[0]], b[changed[0]], rtol=1e-3, atol=1e-4)


# ------------------------------------------------------------------- names and shapes


def test_a_missing_tensor_names_the_files_and_the_expected_shape(hf_checkpoint, tmp_path, no_weight_read):
    path = copy(hf_checkpoint, tmp_path)
    rewrite(path, lambda t: t.pop(W))
    refused(rf"^checkpoint is missing tensor '{W}' \(expected shape \[292, 64\]\): not in "
            r"model\.safetensors, and config.json needs it$", path)


def test_an_extra_tensor_names_its_file(hf_checkpoint, tmp_path, no_weight_read):
    path = copy(hf_checkpoint, tmp_path)
    rewrite(path, lambda t: t.update({"model.layers.0.mamba.surprise": np.ones((3,), np.float32)}))
    refused(r"^model\.safetensors: checkpoint has unexpected tensor 'model\.layers\.0\.mamba\.surprise': "
            r"the config does not use it$", path)


@pytest.mark.parametrize("changes,match", [
    # consistent config, another model: the first tensor that disagrees is named, before any read
    (dict(hidden_size=32, mamba_expand=4),
     r"^model\.safetensors: checkpoint tensor 'model\.embed_tokens\.weight' has shape \[128, 64\], "
     r"expected \[128, 32\] \(from config.json\)$"),
    (dict(vocab_size=100), r"'model\.embed_tokens\.weight' has shape \[128, 64\], expected \[100, 64\]"),
    (dict(num_key_value_heads=4), r"'model\.layers\.1\.self_attn\.k_proj\.weight' has shape \[32, 64\], "
                                  r"expected \[64, 64\]"),
    (dict(num_hidden_layers=4), r"missing tensor 'model\.layers\.3\.input_layernorm\.weight'"),
    (dict(num_hidden_layers=2), r"unexpected tensor 'model\.layers\.2\.[^']+' \(and \d+ more\)"),
])
def test_a_config_that_lies_about_shapes_is_refused_before_any_weight_is_read(
        changes, match, hf_checkpoint, tmp_path, no_weight_read):
    path = copy(hf_checkpoint, tmp_path)
    edit_config(path, **changes)
    refused(match, path)


@pytest.mark.parametrize("changes,match", [
    (dict(hidden_size=48), "mamba_expand \\* hidden_size = 96"),
    (dict(hidden_size="64"), "hidden_size must be an int >= 1, got '64'"),
    (dict(hidden_size=-64), "hidden_size must be an int >= 1, got -64"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be > 0, got nan"),
])
def test_an_inconsistent_config_is_refused_with_no_weights_present(changes, match, hf_checkpoint, tmp_path):
    """Refused from config.json alone: the directory has no safetensors file at all."""
    path = copy(hf_checkpoint, tmp_path, weights=False)
    edit_config(path, **changes)
    refused(match, path)
    with pytest.raises(ValueError, match=match):
        loader.model_from_dir(path)


# --------------------------------------------------------------- headers and indexes


@pytest.mark.parametrize("field,value", [
    ("shape", ["a", 64]), ("shape", [-1, 64]), ("shape", [2.5, 64]), ("shape", 5),
    ("data_offsets", ["0", "10"]), ("data_offsets", [0, 1, 2]), ("data_offsets", [10, 0]),
    ("dtype", ["F32"]), ("dtype", None),
])
def test_a_malformed_header_entry_names_the_file_and_the_tensor(field, value, hf_checkpoint, tmp_path,
                                                                 no_weight_read):
    path = copy(hf_checkpoint, tmp_path)
    edit_header(path, lambda h: h[W].__setitem__(field, value))
    refused(rf"^model\.safetensors: malformed header entry for tensor '{W}': .* \(expected 'dtype' a name, "
            r"'shape' a list of ints >= 0, 'data_offsets' \[begin, end\]\)$", path)


def test_a_header_whose_sizes_disagree_names_both(hf_checkpoint, tmp_path, no_weight_read):
    path = copy(hf_checkpoint, tmp_path)
    edit_header(path, lambda h: h[W].__setitem__("shape", [146, 64]))
    refused(rf"^model\.safetensors: tensor '{W}' of shape \[146, 64\] F32 needs 37376 bytes, its header "
            r"gives 74752$", path)


def shard(path, weight_map_of):
    """The single file renamed part-1.safetensors and an index written by ``weight_map_of``."""
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "part-1.safetensors"))
    names = list(st.load_file(os.path.join(path, "part-1.safetensors")))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(weight_map_of({n: "part-1.safetensors" for n in names}), f)


@pytest.mark.parametrize("index,match", [
    (lambda wm: {"weight_map": {**wm, W: "part-2.safetensors"}},
     r"names 'part-2\.safetensors', which is not in"),
    (lambda wm: {"weight_map": list(wm)}, r"'weight_map' must map tensor names to file names, got a list"),
    (lambda wm: {"weight_map": {**wm, W: 3}}, rf"tensor '{W}' maps to 3, expected the name of a file in"),
    (lambda wm: {"weight_map": {**wm, W: "../other/model.safetensors"}},
     rf"tensor '{W}' maps to '\.\./other/model\.safetensors', expected the name of a file in"),
    (lambda wm: {"weight_map": {k: v for k, v in wm.items() if k != W}},
     rf"part-1\.safetensors: tensor '{W}' is not listed for this file"),
    (lambda wm: {"metadata": {}}, r"no valid 'weight_map'"),
])
def test_a_hostile_sharded_index(index, match, hf_checkpoint, tmp_path, no_weight_read):
    path = copy(hf_checkpoint, tmp_path)
    shard(path, index)
    refused([r"^(model\.safetensors\.index\.json|part-1\.safetensors)", match], path)


def test_a_sharded_checkpoint_loads(hf_checkpoint, tmp_path):
    """The index path itself works: two shards, every tensor listed once."""
    path = copy(hf_checkpoint, tmp_path)
    tensors = st.load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    names = sorted(tensors)
    parts = {"part-1.safetensors": names[::2], "part-2.safetensors": names[1::2]}
    for fn, ns in parts.items():
        st.save_file({n: tensors[n] for n in ns}, os.path.join(path, fn))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {n: fn for fn, ns in parts.items() for n in ns}}, f)
    load_pretrained(path, dtype="float32")


def test_a_weights_file_that_cannot_be_read(hf_checkpoint, tmp_path):
    path = copy(hf_checkpoint, tmp_path, weights=False)
    os.mkdir(os.path.join(path, "model.safetensors"))
    refused(r"^model\.safetensors: cannot be read \(Is a directory\)$", path)
