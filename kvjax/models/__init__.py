"""A tiny hybrid (attention + Mamba2) model over the paged KV cache, and its dense oracle."""

from kvjax.models.caches import HybridCaches as HybridCaches, init_caches as init_caches
from kvjax.models.config import TinyHybridConfig as TinyHybridConfig
from kvjax.models.dense import dense_forward as dense_forward
from kvjax.models.hf.loader import load_pretrained as load_pretrained
from kvjax.models.tiny_hybrid import (
    TinyHybrid as TinyHybrid,
    TinyHybridModel as TinyHybridModel,
    forward_step as forward_step,
    init_params as init_params,
)



def default_model():
    """The model a :class:`~kvjax.runner.RunnerConfig` serves when none is named: the tiny hybrid."""
    return TinyHybridModel()


def as_model(model):
    """``model`` as a :class:`~kvjax.models.interface.Model`: a :class:`TinyHybridConfig` is taken as
    the tiny hybrid model of that config; anything else is returned as it is."""
    return TinyHybridModel(model) if isinstance(model, TinyHybridConfig) else model


__all__ = [
    "HybridCaches",
    "TinyHybrid",
    "TinyHybridConfig",
    "TinyHybridModel",
    "as_model",
    "default_model",
    "dense_forward",
    "forward_step",
    "init_caches",
    "init_params",
    "load_pretrained",
]
