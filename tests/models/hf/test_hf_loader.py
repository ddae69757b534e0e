"""Bad checkpoints give one clear ValueError, raised by kvjax's own checks (no chained traceback).

Config errors come before any weight is read: those cases delete ``model.safetensors`` first,
so reading a weight would fail differently. Tensor errors come from the safetensors headers.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
st = pytest.importorskip("safetensors.numpy")

from kvjax.models import load_pretrained  # noqa: E402
from kvjax.models.hf import loader  # noqa: E402


def copy_checkpoint(src, dst, *, weights: bool = True):
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if weights or not f.endswith(".safetensors"):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    return dst


def edit_config(path, **changes):
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is _DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(cfg_file, "w") as f:
        json.dump(cfg, f)


_DROP = object()


def raises_clear(match, fn, *args, **kw):
    """``fn`` raises a ValueError matching ``match``, raised by this project's code (kvjax, or the
    rule owners in pallas_kernels it calls) with nothing chained."""
    with pytest.raises(ValueError, match=match) as info:
        fn(*args, **kw)
    e = info.value
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__), repr(e.__context__)
    where = info.traceback[-1].path.as_posix()
    assert "/kvjax/" in where or "/pallas_kernels/" in where, where
    return e


# (checkpoint, config changes, message): every one refused before any weight is read
REFUSED = [
    ("granite_rope_moe", dict(architectures=["LlamaForCausalLM"]), "architecture 'LlamaForCausalLM' is not supported"),
    ("granite_rope_moe", dict(architectures=[]), "architectures"),
    ("granite_rope_moe", dict(position_embedding_type="alibi"), "position_embedding_type='alibi'"),
    ("granite_rope_moe", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
     "rope_type='yarn'"),
    ("granite_rope_moe", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("granite_rope_moe", dict(sliding_window=8), "sliding_window=8"),
    ("granite_rope_moe", dict(layer_types=["mamba", "sliding_attention", "mamba"]), "layer_types='sliding_attention'"),
    ("granite_rope_moe", dict(mamba_d_head=16), "mamba_d_head=16"),
    ("granite_rope_moe", dict(time_step_limit=[1.0, 0.5]), "time_step_limit"),
    ("granite_rope_moe", dict(num_attention_heads=3), "num_key_value_heads"),
    ("bamba", dict(attn_layer_indices=[7]), "attn_layer_indices"),
    ("bamba", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}),
     "partial_rotary_factor"),
    ("nemotron_h", dict(mlp_hidden_act="gelu"), "mlp_hidden_act='gelu'"),
    ("nemotron_h", dict(mamba_hidden_act="relu"), "mamba_hidden_act='relu'"),
    ("nemotron_h", dict(sliding_window=16), "sliding_window=16"),
    ("nemotron_h", dict(layers_block_type=["mamba", "conv"]), "layers_block_type='conv'"),
    ("nemotron_h", dict(mamba_ssm_cache_dtype="float64"), "mamba_ssm_cache_dtype"),
    ("nemotron_h", dict(n_group=3), "n_group"),
    ("nemotron_h", dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    ("nemotron_h", dict(vocab_size=0), "vocab_size"),
    ("nemotron_h", dict(quantization_config={"quant_method": "fp8"}), "quantization_config='fp8'"),
    ("granite_nope_dense", dict(logits_scaling=0), "logits_scaling"),
]


@pytest.mark.parametrize("name,changes,match", REFUSED, ids=[f"{n}-{next(iter(c))}" for n, c, _ in REFUSED])
def test_config_refused_before_any_weight_is_read(name, changes, match, hf_checkpoint, tmp_path):
    path = copy_checkpoint(hf_checkpoint(name), tmp_path / "ckpt", weights=False)
    edit_config(path, **changes)
    raises_clear(match, load_pretrained, path)


def test_legacy_pattern_and_layer_names_are_read(hf_checkpoint, tmp_path):
    """Nemotron-H's hybrid_override_pattern and Granite's 'mamba' / 'attention' names."""
    path = copy_checkpoint(hf_checkpoint("nemotron_h"), tmp_path / "n")
    edit_config(path, layers_block_type=_DROP, hybrid_override_pattern="ME*-")
    _, cfg = loader.config_from_dir(path)
    assert [b.kind for b in cfg.blocks] == ["mamba", "moe", "attn", "mlp"]
    path = copy_checkpoint(hf_checkpoint("granite_rope_moe"), tmp_path / "g", weights=False)
    edit_config(path, layer_types=["mamba", "attention", "mamba"])
    _, cfg = loader.config_from_dir(path)
    assert [b.kind for b in cfg.blocks][::2] == ["mamba", "attn", "mamba"]


def rewrite_weights(path, fn):
    f = os.path.join(path, "model.safetensors")
    tensors = st.load_file(f)
    fn(tensors)
    st.save_file(tensors, f)


def test_missing_tensor(hf_checkpoint, tmp_path):
    path = copy_checkpoint(hf_checkpoint("granite_rope_moe"), tmp_path / "c")
    rewrite_weights(path, lambda t: t.pop("model.layers.0.mamba.dt_bias"))
    raises_clear(r"missing tensor 'model.layers.0.mamba.dt_bias' \(expected shape \[4\]\)", load_pretrained, path)


def test_wrong_shape(hf_checkpoint, tmp_path):
    path = copy_checkpoint(hf_checkpoint("nemotron_h"), tmp_path / "c")

    def shrink(t):
        t["backbone.layers.2.mixer.k_proj.weight"] = t["backbone.layers.2.mixer.k_proj.weight"][:16]

    rewrite_weights(path, shrink)
    raises_clear(r"'backbone.layers.2.mixer.k_proj.weight' has shape \[16, 64\], expected \[32, 64\]",
                 load_pretrained, path)


def test_unexpected_tensor(hf_checkpoint, tmp_path):
    path = copy_checkpoint(hf_checkpoint("bamba"), tmp_path / "c")
    rewrite_weights(path, lambda t: t.update({"model.layers.9.extra.weight": np.zeros((2, 2), np.float32)}))
    raises_clear("unexpected tensor 'model.layers.9.extra.weight'", load_pretrained, path)


def test_a_config_that_disagrees_with_the_weights(hf_checkpoint, tmp_path):
    """A consistent config for a different model: the first tensor that does not fit is named."""
    path = copy_checkpoint(hf_checkpoint("granite_rope_moe"), tmp_path / "c")
    edit_config(path, num_local_experts=0)  # the checkpoint has routed experts
    raises_clear("unexpected tensor 'model.layers.0.block_sparse_moe", load_pretrained, path)


@pytest.mark.parametrize("keep", [4, 100, -40])
def test_truncated_safetensors(keep, hf_checkpoint, tmp_path):
    path = copy_checkpoint(hf_checkpoint("bamba"), tmp_path / "c")
    f = os.path.join(path, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[:keep])
    raises_clear("truncated|not valid JSON", load_pretrained, path)


def test_bad_paths_and_arguments(hf_checkpoint, tmp_path):
    raises_clear("local checkpoint directory", load_pretrained, tmp_path / "nowhere")
    raises_clear("no config.json", load_pretrained, tmp_path)
    raises_clear("dtype must be one of", load_pretrained, hf_checkpoint("bamba"), dtype="float16")
    path = copy_checkpoint(hf_checkpoint("bamba"), tmp_path / "c", weights=False)
    raises_clear("no model.safetensors", load_pretrained, path)
    (tmp_path / "c" / "config.json").write_text("{not json")
    raises_clear("not valid JSON", load_pretrained, path)


def test_index_naming_a_missing_file(hf_checkpoint, tmp_path):
    path = copy_checkpoint(hf_checkpoint("bamba"), tmp_path / "c")
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "part-1.safetensors"))
    names = list(st.load_file(os.path.join(path, "part-1.safetensors")))
    weight_map = {n: "part-1.safetensors" for n in names}
    weight_map[names[0]] = "part-2.safetensors"
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    raises_clear("names 'part-2.safetensors', which is not in", load_pretrained, path)


def test_architecture_module_not_written_yet(monkeypatch, hf_checkpoint, tmp_path):
    monkeypatch.setitem(loader.ARCHITECTURES, "FutureForCausalLM", "kvjax.models.hf.not_written")
    path = copy_checkpoint(hf_checkpoint("bamba"), tmp_path / "c", weights=False)
    edit_config(path, architectures=["FutureForCausalLM"])
    raises_clear("'FutureForCausalLM' is not yet supported", load_pretrained, path)


def test_model_from_dir_reads_no_weight(hf_checkpoint, tmp_path):
    path = copy_checkpoint(hf_checkpoint("nemotron_h"), tmp_path / "c", weights=False)
    model = loader.model_from_dir(path, "bfloat16")
    assert model.config.dtype == "bfloat16" and model.config.architecture == "NemotronHForCausalLM"
    edit_config(path, mlp_hidden_act="gelu")
    raises_clear("mlp_hidden_act='gelu'", loader.model_from_dir, path)


def test_eos_token_ids(hf_checkpoint, tmp_path):
    path = copy_checkpoint(hf_checkpoint("bamba"), tmp_path / "c", weights=False)
    assert loader.eos_token_ids(path) == (2,)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [5, 7]}, f)
    assert loader.eos_token_ids(path) == (5, 7)
    os.remove(os.path.join(path, "generation_config.json"))
    edit_config(path, eos_token_id=None)
    assert loader.eos_token_ids(path) == ()
