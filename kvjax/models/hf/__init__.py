"""Hugging Face checkpoints: the loader and the architectures it serves.

``load_pretrained(path, dtype=..., mesh=...) -> (model, params)`` (:mod:`kvjax.models.hf.loader`)
reads a local directory (kvjax never downloads one). Architectures: Granite-4.0-H
(:mod:`~kvjax.models.hf.granite`), Bamba (:mod:`~kvjax.models.hf.bamba`), Nemotron-H
(:mod:`~kvjax.models.hf.nemotron_h`), all on the shared hybrid decoder of
:mod:`~kvjax.models.hf.hybrid`, and DeepSeek-V3 (:mod:`~kvjax.models.hf.deepseek_v3`). Every
architecture reads its ``config.json`` fields through :mod:`~kvjax.models.hf.fields`.
"""

from kvjax.models.hf.hybrid import HybridConfig as HybridConfig, HybridModel as HybridModel
from kvjax.models.hf.loader import (
    ARCHITECTURES as ARCHITECTURES,
    eos_token_ids as eos_token_ids,
    load_pretrained as load_pretrained,
)

__all__ = ["ARCHITECTURES", "HybridConfig", "HybridModel", "eos_token_ids", "load_pretrained"]
