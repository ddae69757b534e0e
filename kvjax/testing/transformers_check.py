"""transformers (torch) as the oracle of a served Hugging Face checkpoint.

Each finished request's prompt + output is run through transformers' own model
(``AutoModelForCausalLM.from_pretrained`` of the same directory, float32 on the
CPU), teacher-forced: the logits row before each output token is compared with
the row kvjax computed for it.

* Tokens: a greedy output token must be transformers' argmax, or within a near
  tie of it (``transformers_logit(argmax) - transformers_logit(token) <=
  tie_tolerance``); a sampled one must be what kvjax's sampler draws from
  transformers' row with the request's seed and position
  (:func:`kvjax.cli.demo.reference_tokens`).
* Logits: the largest absolute difference must be within ``logits_tolerance``.

Nothing is downloaded: the directory must hold ``config.json`` and the weights.
torch and transformers are test dependencies, imported when this module is.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

from kvjax.testing.asserts import greedy_match

#: Max abs logits difference by what kvjax computes in: float32 differs from transformers only
#: in op order (~1e-6 seen); bfloat16 weights and activations round every product (about 2**-8
#: relative); an fp8 KV cache (kv_cache_dtype fp8) rounds K/V, which transformers does not.
LOGITS_ATOL = {"float32": 1e-3, "bfloat16": 0.25, "fp8": 0.25}
#: a greedy token may differ from transformers' argmax only where the two logits are this close.
TIE_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "fp8": 0.1}


def load_transformers(model_dir: str):
    """transformers' model of ``model_dir`` in float32, for inference on the CPU (local files only)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              local_files_only=True)
    return model.eval()


def teacher_forced_logits(model, tokens: list[int]) -> np.ndarray:
    """float32 ``[len(tokens), vocab]``: transformers' logits after each prefix of ``tokens``."""
    with torch.no_grad():  # no cache: transformers' own cache needs an attention layer (Nemotron-H)
        out = model(torch.tensor([tokens], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy()


def check_requests(model_dir: str, finished, *, dtype: str = "float32", kv_cache_dtype: str = "auto",
                   sampler=None) -> dict:
    """Per request id: ``{"tokens_match", "near_ties", "max_logit_error", "matches_transformers"}``.

    ``finished``: :class:`~kvjax.host.scheduler.Request` objects with their kvjax logits rows
    (``req.logits``); ``sampler(req, logits_rows) -> tokens`` replays sampled requests (default:
    argmax for every request). ``dtype`` / ``kv_cache_dtype``: what kvjax computed in (the
    tolerances, :data:`LOGITS_ATOL`, follow the coarser of the two).
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    model = load_transformers(model_dir)
    kind = dtype if kv_cache_dtype == "auto" else "fp8"
    atol, tie = LOGITS_ATOL[kind], TIE_TOLERANCE[kind]
    results = {}
    for req in sorted(finished, key=lambda r: r.req_id):
        seq = req.prompt + req.output
        ref = teacher_forced_logits(model, seq)[len(req.prompt) - 1: len(seq) - 1]
        out = np.asarray(req.output)
        if req.temperature and sampler is not None:
            want = np.asarray(sampler(req, ref))
            ok = want == out
            ties = 0
        else:
            ok, near = greedy_match(ref, out, tie)
            ties = int(near.sum())
        got = np.stack(req.logits) if req.logits else np.zeros_like(ref)
        err = float(np.abs(got - ref).max()) if got.shape == ref.shape and got.size else float("inf")
        results[req.req_id] = {"tokens_match": bool(ok.all()), "near_ties": ties, "max_logit_error": err,
                               "matches_transformers": bool(ok.all() and err <= atol)}
    return results
