"""Every kernel config checks its sizes by one rule (``pallas_kernels.contract.static_int``
through ``check_config_ints``): each field declared ``int`` (or ``int | None``) refuses a bool,
a float, a string and 0 by ``Config.field`` name, and takes a numpy int as a plain int."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pallas_kernels import contract
from pallas_kernels.block_zero import ZeroBlocksConfig
from pallas_kernels.grouped_matmul import GroupedMatmulConfig
from pallas_kernels.kv_write import KVWriteConfig
from pallas_kernels.mamba_conv import ConvConfig
from pallas_kernels.mamba_scan import ScanConfig
from pallas_kernels.mamba_ssu import SSUConfig
from pallas_kernels.moe_route import MoERouteConfig
from pallas_kernels.paged_attention import PagedAttentionConfig

CONFIGS = (ZeroBlocksConfig, GroupedMatmulConfig, KVWriteConfig, ConvConfig, ScanConfig, SSUConfig,
           MoERouteConfig, PagedAttentionConfig)


def _int_fields(cls):
    return [f for f in dataclasses.fields(cls) if str(f.type).replace(" ", "") in ("int", "int|None")]


def test_every_config_module_is_listed():
    """A config added to pallas_kernels without a place here would go unchecked."""
    import importlib
    import pkgutil

    import pallas_kernels

    found = set()
    for m in pkgutil.iter_modules(pallas_kernels.__path__):
        mod = importlib.import_module(f"pallas_kernels.{m.name}")
        found |= {v for k, v in vars(mod).items()
                  if k.endswith("Config") and dataclasses.is_dataclass(v) and v.__module__ == mod.__name__}
    assert found == set(CONFIGS)


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_sizes_refused_by_name(cls):
    fields = _int_fields(cls)
    assert fields, cls
    for f in fields:
        for bad in (True, 2.0, "2", 0, -4):
            with pytest.raises(ValueError, match=rf"^{cls.__name__}\.{f.name} must be (a power of two|an int >= 1)"
                                                 rf"{' or None' if 'None' in str(f.type) else ''}, got {bad!r}$"):
                cls(**{f.name: bad})


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_numpy_ints_taken_as_plain_ints(cls):
    for f in _int_fields(cls):
        default = getattr(cls(), f.name)
        v = np.int64(default if default is not None else 16)
        cfg = cls(**{f.name: v})
        assert type(getattr(cfg, f.name)) is int and getattr(cfg, f.name) == v
        assert cfg == cls(**{f.name: int(v)}) and hash(cfg) == hash(cls(**{f.name: int(v)}))


@pytest.mark.parametrize("cls", [c for c in CONFIGS if "gpu_num_warps" in {f.name for f in dataclasses.fields(c)}],
                         ids=lambda c: c.__name__)
def test_warps_are_a_power_of_two(cls):
    """Triton refuses other warp counts ("num_warps must be a power of 2"), far from the config."""
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\.gpu_num_warps must be a power of two"):
        cls(gpu_num_warps=3)
    assert cls(gpu_num_warps=8).gpu_num_warps == 8


def test_powers_of_two_where_named():
    assert contract.static_int("n", 8, power_of_two=True) == 8
    with pytest.raises(ValueError, match=r"^n must be a power of two, got 12$"):
        contract.static_int("n", 12, power_of_two=True)
    with pytest.raises(ValueError, match=r"^PagedAttentionConfig.gpu_max_kv_splits must be a power of two, got 96$"):
        PagedAttentionConfig(gpu_max_kv_splits=96)
    with pytest.raises(ValueError, match=r"^GroupedMatmulConfig.gpu_block_n must be a power of two or None, got 48$"):
        GroupedMatmulConfig(gpu_block_n=48)
    assert contract.static_int("n", None, optional=True) is None
    with pytest.raises(ValueError, match=r"^n must be an int >= 1, got None$"):
        contract.static_int("n", None)
