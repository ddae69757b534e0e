"""Checkpoint-loading rules found by an adversarial pass (each refused before any weight is read,
with the field or tensor named, what was expected and what came; or read as transformers reads it).

The hybrid checkpoints come from ``conftest.hf_checkpoint`` (transformers' ``save_pretrained`` of
tiny random models); the DeepSeek-V3 ones are written here from :func:`deepseek_v3.random_tensors`
(a config.json plus one safetensors file). Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import struct

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")
st = pytest.importorskip("safetensors.numpy")

from kvjax.models import load_pretrained  # noqa: E402
from kvjax.models.hf import bamba, granite  # noqa: E402
from kvjax.models.hf import deepseek_v3 as ds  # noqa: E402
from kvjax.models.hf import loader  # noqa: E402
from conftest import edit_config, refused  # noqa: E402

DS_TINY = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=32,
    qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1,
    num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256,
    tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def copy(src, dst, *, weights: bool = True) -> str:
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if weights or not f.endswith(".safetensors"):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    return str(dst)


def assert_logits_match_transformers(path, prompt=(5, 17, 99, 3, 42, 7)):
    """kvjax's float32 logits of ``prompt`` from the checkpoint at ``path`` against transformers'."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, params = load_pretrained(path)
    ours = np.asarray(model.dense_logits(params, np.asarray(prompt)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    with torch.no_grad():
        ref = hf(torch.tensor([list(prompt)]), use_cache=False).logits[0].numpy()
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=2e-4)


def deepseek_checkpoint(path, *, layers: int | None = None, **changes) -> str:
    """A DeepSeek-V3 checkpoint directory: config.json (``DS_TINY`` + ``changes``) and
    ``model.safetensors`` of the tensors of ``layers`` layers (default: the config's), untied."""
    os.makedirs(path, exist_ok=True)
    cfg = dict(DS_TINY, **changes)
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    wcfg = dict(DS_TINY, tie_word_embeddings=False)
    if layers is not None:
        wcfg["num_hidden_layers"] = layers
    st.save_file(ds.random_tensors(ds.config_from_hf(wcfg), 0), os.path.join(path, "model.safetensors"))
    return str(path)


def config_refused(match, cfg: dict, tmp_path):
    """A config.json alone (no weights) is refused by model_from_dir with a message matching ``match``."""
    path = tmp_path / "cfg_only"
    os.makedirs(path, exist_ok=True)
    json.dump(cfg, open(path / "config.json", "w"))
    with pytest.raises(ValueError) as info:
        loader.model_from_dir(str(path))
    for m in [match] if isinstance(match, str) else match:
        assert re.search(m, str(info.value)), (m, str(info.value))
    return str(info.value)


def hf_config(hf_checkpoint, name, **changes) -> dict:
    cfg = json.load(open(os.path.join(hf_checkpoint(name), "config.json")))
    cfg.update(changes)
    return cfg


# ----------------------------------------------- 1. a tied config beside a stored lm_head


def _tied_checkpoint(name, hf_checkpoint, tmp_path):
    if name == "deepseek":
        return deepseek_checkpoint(tmp_path / "ds", tie_word_embeddings=True)
    path = copy(hf_checkpoint(name), tmp_path / "ckpt")
    edit_config(path, tie_word_embeddings=True)
    return path


@pytest.mark.parametrize("name", ["granite_rope_moe", "bamba", "deepseek"])
def test_a_tied_config_with_a_different_stored_head_is_refused(name, hf_checkpoint, tmp_path, monkeypatch):
    """transformers keeps a stored ``lm_head.weight`` that differs from the embedding when
    config.json says tied (it warns and does not tie); kvjax used to drop the stored head and use
    the embedding. Refused now, naming the tensor and the field, having read only those two."""
    path = _tied_checkpoint(name, hf_checkpoint, tmp_path)
    reads = []
    real = loader._reader

    def reader(tensors):
        get = real(tensors)

        def spy(n):
            reads.append(n)
            return get(n)
        return spy

    monkeypatch.setattr(loader, "_reader", reader)
    with pytest.raises(ValueError, match=r"'lm_head\.weight', different from 'model\.embed_tokens\.weight'.*"
                                         r"tie_word_embeddings=true.*transformers"):
        loader.load_pretrained(str(path), "float32")
    assert sorted(reads) == ["lm_head.weight", "model.embed_tokens.weight"]


@pytest.mark.parametrize("name", ["granite_rope_moe", "deepseek"])
def test_a_tied_config_with_a_copy_of_the_embedding_as_head_loads(name, hf_checkpoint, tmp_path):
    """A checkpoint that stores the tied head as a copy of the embedding (transformers ties the
    two) loads, and its logits are the same model's with the head dropped."""
    from safetensors.numpy import load_file, save_file

    path = _tied_checkpoint(name, hf_checkpoint, tmp_path)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(files) == 1, files
    f = os.path.join(path, files[0])
    w = load_file(f)
    w["lm_head.weight"] = w["model.embed_tokens.weight"].copy()
    save_file(w, f, metadata={"format": "pt"})
    model, params = loader.load_pretrained(str(path), "float32")
    del w["lm_head.weight"]
    save_file(w, f, metadata={"format": "pt"})
    model2, params2 = loader.load_pretrained(str(path), "float32")
    toks = jnp.asarray([5, 17, 9, 3])
    assert np.array_equal(np.asarray(model.dense_logits(params, toks)), np.asarray(model2.dense_logits(params2, toks)))


@pytest.mark.parametrize("name,field,value", [
    ("granite_rope_moe", "tie_word_embeddings", "false"),
    ("granite_rope_moe", "attention_bias", 0),
    ("granite_rope_moe", "mamba_conv_bias", "true"),
    ("bamba", "mlp_bias", 1),
    ("bamba", "mamba_proj_bias", "false"),
    ("nemotron_h", "use_conv_bias", "false"),
    ("nemotron_h", "norm_topk_prob", 1),
    ("nemotron_h", "mlp_bias", None),
    ("deepseek", "attention_bias", "false"),
    ("deepseek", "tie_word_embeddings", None),
])
def test_a_bool_field_must_be_a_bool(name, field, value, hf_checkpoint, tmp_path):
    """``"false"`` is a string (``bool("false")`` is True); 0 / 1 and null are not bools either."""
    cfg = dict(DS_TINY) if name == "deepseek" else hf_config(hf_checkpoint, name)
    cfg[field] = value
    config_refused(rf"config\.json field {field} must be true or false, got {re.escape(repr(value))}",
                   cfg, tmp_path)


#: The bool fields Granite-4.0-H and Bamba share: config.json field -> HybridConfig field.
SHARED_FLAGS = {"attention_bias": "attn_bias", "mamba_proj_bias": "mamba_proj_bias",
                "mamba_conv_bias": "mamba_conv_bias", "tie_word_embeddings": "tie_embeddings"}


@pytest.mark.parametrize("name", ["granite_rope_moe", "bamba"])
def test_granite_and_bamba_bool_fields_read_as_transformers(name, hf_checkpoint):
    """Absent, each takes transformers' default; given, its value lands in its own HybridConfig
    field (the others keep theirs)."""
    transformers = pytest.importorskip("transformers")
    module = {"granite_rope_moe": granite, "bamba": bamba}[name]
    bare = {k: v for k, v in hf_config(hf_checkpoint, name).items() if k not in SHARED_FLAGS}
    default = transformers.CONFIG_MAPPING[bare["model_type"]]()
    want = {ours: getattr(default, field) for field, ours in SHARED_FLAGS.items()}

    def read(cfg):
        c = module.config_from_hf(cfg)
        return {ours: getattr(c, ours) for ours in SHARED_FLAGS.values()}

    assert read(bare) == want
    for field, ours in SHARED_FLAGS.items():
        assert read(dict(bare, **{field: not want[ours]})) == dict(want, **{ours: not want[ours]}), field


# ------------------------------------------------ 2. DeepSeek-V3's MTP layers, and no others


@pytest.mark.parametrize("changes,match", [
    (dict(num_hidden_layers=2, num_nextn_predict_layers=0), r"unexpected tensor 'model\.layers\.2\.[^']+'"),
    (dict(num_hidden_layers=1, num_nextn_predict_layers=1), r"unexpected tensor 'model\.layers\.2\.[^']+'"),
    (dict(num_hidden_layers=1, num_mtp_layers=1), r"unexpected tensor 'model\.layers\.2\.[^']+'"),
    (dict(num_hidden_layers=2, num_nextn_predict_layers=-1), r"num_nextn_predict_layers must be an int >= 0"),
    (dict(num_hidden_layers=2, num_nextn_predict_layers=1, num_mtp_layers=2),
     r"num_nextn_predict_layers=1 and num_mtp_layers=2"),
])
def test_deepseek_ignores_only_its_mtp_layers(changes, match, tmp_path, no_weight_read):
    """Layers ``num_hidden_layers <= i < num_hidden_layers + num_nextn_predict_layers`` are the
    MTP layers (not part of the causal LM); any other layer beyond the config is refused (it
    used to be dropped without a word)."""
    refused(match, deepseek_checkpoint(tmp_path / "ds", layers=3, **changes))


@pytest.mark.parametrize("changes", [dict(num_hidden_layers=2), dict(num_hidden_layers=2, num_nextn_predict_layers=1),
                                     dict(num_hidden_layers=1, num_nextn_predict_layers=2)])
def test_deepseek_mtp_layers_are_skipped(changes, tmp_path):
    """The MTP layers' tensors are not read (num_nextn_predict_layers defaults to 1 as in transformers)."""
    model, params = load_pretrained(deepseek_checkpoint(tmp_path / "ds", layers=3, **changes))
    assert model.config.num_hidden_layers == changes["num_hidden_layers"]


# ------------------------------------------------------ 3. rope_scaling beside rope_parameters


LINEAR = {"rope_type": "linear", "factor": 4.0}


@pytest.mark.parametrize("name", ["granite_rope_moe", "bamba", "deepseek"])
@pytest.mark.parametrize("changes,match", [
    # transformers reads rope_scaling first (rope_scaling or rope_parameters): a linear RoPE here
    (dict(rope_scaling=LINEAR), r"rope_parameters=.* and rope_scaling=.* disagree"),
    (dict(rope_scaling=LINEAR, rope_parameters={}), r"rope_type='linear' is not supported"),
    (dict(rope_scaling=LINEAR, rope_parameters=None), r"rope_type='linear' is not supported"),
    (dict(rope_parameters={"type": "linear", "rope_type": None, "factor": 4.0}), r"rope_type=None"),
    (dict(rope_parameters={"type": "linear", "rope_type": "default", "factor": 4.0}), r"disagree"),
    (dict(rope_scaling="linear"), r"rope_scaling must be an object"),
])
def test_rope_scaling_and_rope_parameters(name, changes, match, hf_checkpoint, tmp_path):
    cfg = dict(DS_TINY) if name == "deepseek" else hf_config(hf_checkpoint, name)
    cfg.update(changes)
    config_refused(match, cfg, tmp_path)


@pytest.mark.parametrize("name", ["granite_rope_moe", "deepseek"])
def test_rope_scaling_equal_to_rope_parameters_is_read(name, hf_checkpoint, tmp_path):
    cfg = dict(DS_TINY) if name == "deepseek" else hf_config(hf_checkpoint, name)
    cfg["rope_scaling"] = dict(cfg["rope_parameters"])
    path = tmp_path / "cfg"
    os.makedirs(path)
    json.dump(cfg, open(path / "config.json", "w"))
    loader.model_from_dir(str(path))


# ------------------------------------------------- 4. safetensors offsets tile the data area


def write_header(path, header_text: str, data: bytes, file="model.safetensors"):
    raw = header_text.encode()
    raw += b" " * (-len(raw) % 8)
    open(os.path.join(path, file), "wb").write(struct.pack("<Q", len(raw)) + raw + data)


def read_st(path, file="model.safetensors"):
    data = open(os.path.join(path, file), "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def by_offset(header):
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _alias(h, data):  # a tensor's bytes are another's (same size): an overlap
    a, c = "model.layers.0.input_layernorm.weight", "model.layers.0.pre_ff_layernorm.weight"
    h[a]["data_offsets"] = list(h[c]["data_offsets"])
    return json.dumps(h), data


def _gap(h, data):  # the last tensor moved 8 bytes on: 8 unowned bytes before it
    last = by_offset(h)[-1]
    b, e = h[last]["data_offsets"]
    h[last]["data_offsets"] = [b + 8, e + 8]
    return json.dumps(h), data[:b] + bytes(8) + data[b:]


def _trailing(h, data):
    return json.dumps(h), data + bytes(16)


def _duplicate(h, data):  # the same name twice in the JSON object (json.loads keeps the last)
    first = by_offset(h)[0]
    text = json.dumps(h)
    return text[:-1] + ", " + json.dumps(first) + ": " + json.dumps(h[by_offset(h)[1]]) + "}", data


@pytest.mark.parametrize("corrupt,match", [
    (_alias, r"overlap"), (_gap, r"gap"), (_trailing, r"16 bytes after the last tensor"),
    (_duplicate, r"tensor '[^']+' is listed twice"),
])
def test_safetensors_offsets_must_tile_the_data(corrupt, match, hf_checkpoint, tmp_path, no_weight_read):
    """The safetensors library refuses these headers (``InvalidOffset`` / ``MetadataIncompleteBuffer``,
    a duplicate name); kvjax read them (the aliased norm loaded another tensor's bytes)."""
    path = copy(hf_checkpoint("bamba"), tmp_path / "ckpt")
    h, data = read_st(path)
    write_header(path, *corrupt(h, data))
    refused([r"^model\.safetensors: ", match], path)
    if corrupt is not _duplicate:
        with pytest.raises(Exception):
            st.load_file(os.path.join(path, "model.safetensors"))


# ------------------------------------------------------------------ 5. null config fields


@pytest.mark.parametrize("name,field", [
    ("granite_rope_moe", "embedding_multiplier"), ("granite_rope_moe", "logits_scaling"),
    ("granite_rope_moe", "residual_multiplier"), ("granite_rope_moe", "rms_norm_eps"),
    ("granite_rope_moe", "hidden_act"), ("granite_rope_moe", "mamba_d_head"),
    ("granite_rope_moe", "time_step_limit"), ("granite_rope_moe", "shared_intermediate_size"),
    ("bamba", "intermediate_size"), ("bamba", "mamba_n_heads"),
    ("nemotron_h", "routed_scaling_factor"), ("nemotron_h", "layer_norm_epsilon"),
    ("nemotron_h", "time_step_min"), ("nemotron_h", "mlp_hidden_act"), ("nemotron_h", "head_dim"),
    ("nemotron_h", "mamba_ssm_cache_dtype"),
])
def test_a_null_field_without_a_null_meaning_is_refused(name, field, hf_checkpoint, tmp_path):
    """transformers keeps a null as None (a TypeError in its forward, or an other model); kvjax used
    to read it as the default (Nemotron-H's routed_scaling_factor 1.5 became 1.0)."""
    arch = hf_config(hf_checkpoint, name)["architectures"][0]
    config_refused(rf"^{arch}: config\.json field {field} is null", hf_config(hf_checkpoint, name, **{field: None}),
                   tmp_path)


@pytest.mark.parametrize("field", [
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "hidden_act", "kv_lora_rank",
    "qk_rope_head_dim", "n_routed_experts", "n_shared_experts", "n_group", "topk_group", "num_experts_per_tok",
    "first_k_dense_replace", "max_position_embeddings",
])
def test_a_deepseek_null_field_without_a_null_meaning_is_refused(field, tmp_path):
    """DeepSeek-V3 reads its fields by the hybrids' rule: a null is refused as a null, naming the field,
    before any other check of its value."""
    config_refused(rf"^DeepseekV3ForCausalLM: config\.json field {field} is null; expected a value",
                   dict(DS_TINY, **{field: None}), tmp_path)


def test_a_deepseek_null_q_lora_rank_is_no_query_lora(tmp_path):
    """transformers' DeepSeek-V3 takes q_lora_rank null as a plain q_proj."""
    path = tmp_path / "d"
    os.makedirs(path)
    json.dump(dict(DS_TINY, q_lora_rank=None), open(path / "config.json", "w"))
    assert loader.model_from_dir(str(path)).config.q_lora_rank is None


def test_null_fields_that_mean_something_read_as_transformers(hf_checkpoint, tmp_path):
    """Granite: attention_multiplier null is 1/sqrt(head_dim) (transformers passes scaling=None to
    its attention); num_key_value_heads null is num_attention_heads (Granite and Bamba)."""
    cfg = hf_config(hf_checkpoint, "granite_rope_moe", attention_multiplier=None, num_key_value_heads=None)
    path = tmp_path / "g"
    os.makedirs(path)
    json.dump(cfg, open(path / "config.json", "w"))
    attn = loader.model_from_dir(str(path)).config.attn
    assert attn.sm_scale is None and attn.num_kv_heads == attn.num_heads == 4
    cfg = hf_config(hf_checkpoint, "bamba", num_key_value_heads=None)
    path = tmp_path / "b"
    os.makedirs(path)
    json.dump(cfg, open(path / "config.json", "w"))
    attn = loader.model_from_dir(str(path)).config.attn
    assert attn.num_kv_heads == attn.num_heads == 4


def test_granite_null_attention_multiplier_matches_transformers(hf_checkpoint, tmp_path):
    path = copy(hf_checkpoint("granite_rope_moe"), tmp_path / "g")
    edit_config(path, attention_multiplier=None)
    assert_logits_match_transformers(path)


# ------------------------------------------------------------------------ 6. numeric fields


INF, NAN = {"__float__": "Infinity"}, {"__float__": "NaN"}
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("name,changes,field", [
    ("granite_rope_moe", dict(rope_parameters={"rope_type": "default", "rope_theta": 0.0}), "rope_parameters.rope_theta"),
    ("granite_rope_moe", dict(rope_parameters={"rope_type": "default", "rope_theta": -500.0}),
     "rope_parameters.rope_theta"),
    ("granite_rope_moe", dict(embedding_multiplier=INF), "embedding_multiplier"),
    ("granite_rope_moe", dict(residual_multiplier="nan"), "residual_multiplier"),
    ("granite_rope_moe", dict(residual_multiplier="0.5"), "residual_multiplier"),
    ("granite_rope_moe", dict(attention_multiplier=NAN), "attention_multiplier"),
    ("granite_rope_moe", dict(rms_norm_eps=True), "rms_norm_eps"),
    ("granite_rope_moe", dict(logits_scaling=0), "logits_scaling"),
    ("granite_rope_moe", dict(time_step_limit=[0.0, "inf"]), "time_step_limit"),
    ("granite_rope_moe", dict(time_step_limit=[NAN, 1.0]), "time_step_limit"),
    ("bamba", dict(rope_parameters={"rope_type": "default", "rope_theta": NAN}), "rope_parameters.rope_theta"),
    ("bamba", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": "0.5"}),
     "rope_parameters.partial_rotary_factor"),
    ("nemotron_h", dict(layer_norm_epsilon=-1.0), "layer_norm_epsilon"),
    ("nemotron_h", dict(time_step_min="nan"), "time_step_min"),
    ("nemotron_h", dict(time_step_min=INF), "time_step_min"),
    ("nemotron_h", dict(routed_scaling_factor="nan"), "routed_scaling_factor"),
    ("nemotron_h", dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    ("deepseek", dict(rope_parameters=dict(YARN, attention_factor="nan")), "rope_parameters.attention_factor"),
    ("deepseek", dict(rope_parameters=dict(YARN, attention_factor=0.0)), "rope_parameters.attention_factor"),
    ("deepseek", dict(rope_parameters=dict(YARN, beta_fast="nan")), "rope_parameters.beta_fast"),
    ("deepseek", dict(rope_parameters=dict(YARN, beta_slow=-1.0)), "rope_parameters.beta_slow"),
    ("deepseek", dict(rope_parameters=dict(YARN, mscale=NAN)), "rope_parameters.mscale"),
    ("deepseek", dict(rope_parameters=dict(YARN, factor="4")), "rope_parameters.factor"),
    ("deepseek", dict(rope_parameters=dict(YARN, original_max_position_embeddings=64.5)),
     "original_max_position_embeddings"),
    ("deepseek", dict(rope_parameters={"rope_type": "default", "rope_theta": True}), "rope_parameters.rope_theta"),
    ("deepseek", dict(routed_scaling_factor="2.5"), "routed_scaling_factor"),
    ("deepseek", dict(rms_norm_eps=None), "rms_norm_eps"),
])
def test_a_numeric_field_must_be_a_usable_number(name, changes, field, hf_checkpoint, tmp_path):
    """Non-finite values, bools, strings (transformers writes infinities as {"__float__": ...}) and
    values <= 0 where the math needs > 0 are refused naming the field; they used to load (NaN
    logits, or a failure at the first forward)."""
    cfg = dict(DS_TINY) if name == "deepseek" else hf_config(hf_checkpoint, name)
    cfg.update(changes)
    config_refused(rf"field {re.escape(field)} (is null|must be)", cfg, tmp_path)


@pytest.mark.parametrize("changes,name,want", [
    (dict(rms_norm_eps=0.0), "rms_norm_eps", "> 0"),
    (dict(rope_theta=-1e4), "rope_theta", "> 0"),
    (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor", "> 0"),
    (dict(rms_norm_eps=float("inf")), "rms_norm_eps", "finite"),
    (dict(rope_theta=True), "rope_theta", "a number"),
    (dict(routed_scaling_factor="2.5"), "routed_scaling_factor", "a number"),
    (dict(rope_type="yarn", yarn_original_max_position_embeddings=64, yarn_factor=float("inf")), "yarn_factor",
     "finite"),
    (dict(rope_type="yarn", yarn_original_max_position_embeddings=64, yarn_factor=0), "yarn_factor", "> 0"),
    (dict(vocab_size=0), "vocab_size", "an int >= 1"),
    (dict(hidden_size=64.0), "hidden_size", "an int >= 1"),
    (dict(n_group=True), "n_group", "an int >= 1"),
    (dict(qk_rope_head_dim=1), "qk_rope_head_dim", "an int >= 2"),
    (dict(first_k_dense_replace=-1), "first_k_dense_replace", "an int >= 0"),
    (dict(rope_type="yarn", yarn_original_max_position_embeddings=0), "yarn_original_max_position_embeddings",
     "an int >= 1"),
])
def test_a_deepseek_config_built_in_code_is_checked_by_the_shared_field_rules(changes, name, want):
    """DeepseekV3Config checks its own sizes and scales (a config built in code never passes
    config_from_hf) by the config.json rules, naming the field, what it must be and what came."""
    good = ds.config_from_hf(DS_TINY)
    with pytest.raises(ValueError) as info:
        dataclasses.replace(good, **changes)
    assert re.fullmatch(rf"DeepSeek-V3 config: field {name} must be {re.escape(want)}, got "
                        rf"{re.escape(repr(changes[name]))}", str(info.value)), str(info.value)


def test_transformers_float_tags_are_read(hf_checkpoint, tmp_path):
    """transformers' own {"__float__": "Infinity"} (time_step_limit's max) still loads."""
    cfg = hf_config(hf_checkpoint, "granite_rope_moe", time_step_limit=[0.0, INF])
    path = tmp_path / "g"
    os.makedirs(path)
    json.dump(cfg, open(path / "config.json", "w"))
    assert loader.model_from_dir(str(path)).config.mamba.dt_limit == (0.0, float("inf"))


# ------------------------------------------------- 7. Bamba's top-level partial_rotary_factor


def _bamba_top_level_partial(hf_checkpoint, tmp_path, value):
    path = copy(hf_checkpoint("bamba"), tmp_path / "b")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["rope_parameters"].pop("partial_rotary_factor", None)
    cfg["partial_rotary_factor"] = value
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    return path


@pytest.mark.parametrize("value", [1.0, 0.25])
def test_bamba_top_level_partial_rotary_factor_is_pinned_to_half(value, hf_checkpoint, tmp_path):
    """transformers' BambaConfig sets partial_rotary_factor 0.5 whatever the top-level field says;
    only rope_parameters.partial_rotary_factor changes it. kvjax read the top-level value."""
    path = _bamba_top_level_partial(hf_checkpoint, tmp_path, value)
    attn = loader.model_from_dir(path).config.attn
    assert attn.rotary_dim == attn.head_dim // 2 == 8


def test_bamba_top_level_partial_rotary_factor_matches_transformers(hf_checkpoint, tmp_path):
    path = _bamba_top_level_partial(hf_checkpoint, tmp_path, 1.0)
    assert_logits_match_transformers(path)


# ------------------------------------------ 8. Nemotron-H's expert groups: DeepSeek's rule


@pytest.mark.parametrize("name", ["nemotron_h", "deepseek"])
@pytest.mark.parametrize("changes,match", [
    # nemotron_h: 4 experts in n_group=2, topk_group=1; deepseek: 8 experts in 2 groups, topk_group=1
    (dict(num_experts_per_tok=5), r"num_experts_per_tok=5 exceeds the \d experts of topk_group=1 groups"),
    (dict(n_group=4, topk_group=2, n_routed_experts=4),
     r"n_routed_experts=4 must split into n_group=4 groups of at least 2 experts"),
    (dict(n_group=3), r"n_routed_experts=\d must split into n_group=3 groups"),
    (dict(topk_group=3), r"topk_group=3 must be <= n_group=2"),
])
def test_expert_groups(name, changes, match, hf_checkpoint, tmp_path):
    """transformers scores a group by its two best experts (a group of one fails there) and picks
    num_experts_per_tok among the topk_group groups' experts (more would choose masked experts).
    Nemotron-H loaded both; the rule and its messages are DeepSeek-V3's, shared."""
    cfg = dict(DS_TINY) if name == "deepseek" else hf_config(hf_checkpoint, name)
    if name == "nemotron_h" and changes.get("num_experts_per_tok") == 5:
        changes = dict(changes, num_experts_per_tok=3)
        match = match.replace("5", "3")
    cfg.update(changes)
    config_refused(match, cfg, tmp_path)


# ----------------------------------------- 9. model.safetensors beside a sharded index


def test_a_single_file_beside_an_index_is_refused(hf_checkpoint, tmp_path, no_weight_read):
    """transformers reads model.safetensors when both are there; kvjax read the index's shards
    (here other weights). Refused as ambiguous, naming both, before any weight is read."""
    path = copy(hf_checkpoint("bamba"), tmp_path / "b")
    tensors = st.load_file(os.path.join(path, "model.safetensors"))
    st.save_file({k: v * 0.5 for k, v in tensors.items()}, os.path.join(path, "model-00001-of-00001.safetensors"))
    json.dump({"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in tensors}},
              open(os.path.join(path, "model.safetensors.index.json"), "w"))
    refused([r"model\.safetensors and model\.safetensors\.index\.json", r"transformers"], path)


@pytest.mark.parametrize("name", ["granite_rope_moe", "bamba", "deepseek"])
def test_per_layer_type_rope_parameters_are_refused_for_every_architecture(name, hf_checkpoint, tmp_path,
                                                                           no_weight_read):
    """Nested (per-layer-type) RoPE parameters: the shared rule refuses them (Granite and Bamba had
    taken the default theta silently; only DeepSeek refused them)."""
    path = (deepseek_checkpoint(tmp_path / "ds") if name == "deepseek"
            else copy(hf_checkpoint(name), tmp_path / "ckpt"))
    nested = {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    edit_config(path, rope_parameters=nested, rope_scaling=None)
    refused([r"rope_parameters", r"per-layer-type"], path)


def test_a_key_repeated_inside_a_tensor_entry_is_named_as_a_key(tmp_path):
    """The header's duplicate check runs on every JSON object: a key repeated inside one tensor's
    entry is not reported as a repeated tensor."""
    f = tmp_path / "model.safetensors"
    hdr = b'{"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    hdr += b" " * (-len(hdr) % 8)
    f.write_bytes(struct.pack("<Q", len(hdr)) + hdr + np.zeros(1, np.float32).tobytes())
    with pytest.raises(ValueError, match=r"key 'dtype' is listed twice"):
        loader._read_header(str(f))
