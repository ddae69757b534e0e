"""kv_layout="rpa" plumbing: config validation, cache shapes, the KV arrays the runner zeroes."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.cli.main import build_parser
from kvjax.models import TinyHybridConfig, init_caches
from kvjax.runner import RunnerConfig

CONFIG = TinyHybridConfig()


def test_rpa_caches_hold_one_combined_array_per_attention_layer():
    c = init_caches(CONFIG, 6, 4, 3, "fp8", kv_layout="rpa")
    assert c.value == () and len(c.key) == CONFIG.num_attn_layers
    for pages in c.key:
        assert pages.shape == (6, 4, 2 * CONFIG.num_kv_heads, CONFIG.head_dim)
        assert pages.dtype == np.dtype("float8_e4m3fn")
    # What the runner zeroes and poisons: every kv_pages array, and back.
    arrays = c.kv_arrays
    assert len(arrays) == CONFIG.num_attn_layers
    again = c.replace_kv_arrays([a + 1 for a in arrays])
    assert again.kv_layout == "rpa" and again.value == ()
    with pytest.raises(ValueError, match="expected 2 kv_pages arrays, got 4"):
        c.replace_kv_arrays(arrays * 2)


def test_kv_layout_is_validated():
    with pytest.raises(ValueError, match=r"kv_layout must be one of \('flash', 'rpa'\), got 'paged'"):
        RunnerConfig(kv_layout="paged")
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        init_caches(CONFIG, 6, 4, 3, kv_layout="RPA")


def test_demo_flag_reaches_the_runner_config():
    args = build_parser().parse_args(["demo", "--kv-layout", "rpa"])
    assert args.kv_layout == "rpa"
    assert build_parser().parse_args(["demo"]).kv_layout == "flash"
