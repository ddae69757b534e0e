"""Reading Hugging Face ``config.json`` fields: the rules every architecture's loader shares.

Each helper takes the architecture name (the prefix of its messages) and refuses, with
``ValueError``, a value kvjax would otherwise read differently from transformers, naming the
field, what was expected and what came: :func:`field` (absent: the default; null: refused unless
it has a meaning), :func:`check_bool`, :func:`check_int`, :func:`check_number` / :func:`number`
(JSON numbers and transformers' tagged non-finite floats), :func:`refuse` (a value kvjax does
not implement), and the RoPE parameters (:func:`rope_parameters`, :func:`rope_number`,
:func:`check_rope`).
"""

from __future__ import annotations

import math


_NO_NULL = object()


def field(arch: str, cfg: dict, name: str, default=None, *, null=_NO_NULL):
    """``cfg[name]``; absent: ``default`` (transformers' default). An explicit null is refused
    unless the field has a null meaning in transformers: ``null`` is then what it means here
    (e.g. ``position_embedding_type`` null is NoPE): never silently the default."""
    if name not in cfg:
        return default
    if cfg[name] is None:
        if null is _NO_NULL:
            raise ValueError(f"{arch}: config.json field {name} is null; expected a value (absent takes transformers' "
                             f"default {default!r}; null has no meaning for this field)")
        return null
    return cfg[name]


def check_bool(arch: str, cfg: dict, name: str, default: bool) -> bool:
    """A config.json bool field: ``true`` / ``false`` only (absent: ``default``). A string such as
    ``"false"`` (truthy in Python), a number or null is refused, naming the field."""
    v = cfg.get(name, default)
    if not isinstance(v, bool):
        raise ValueError(f"{arch}: config.json field {name} must be true or false, got {v!r}")
    return v


_FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def is_float_tag(v) -> bool:
    """transformers' JSON form of a non-finite float: ``{"__float__": "Infinity"}`` (or -Infinity, NaN)."""
    return isinstance(v, dict) and set(v) == {"__float__"} and v["__float__"] in _FLOAT_TAGS


def check_number(arch: str, name: str, v, *, positive: bool = False, lo: float | None = None,
                 allow_inf: bool = False, label: str = "config.json field") -> float:
    """A config.json number as a float: a JSON int / float (not a bool, not a string) or
    transformers' tagged ``{"__float__": "Infinity" | "-Infinity" | "NaN"}``. Refused, naming
    the field: anything else, NaN, an infinity (unless ``allow_inf``: ``+inf`` only), a value
    <= 0 when ``positive``, a value < ``lo``. Every module's numeric fields go through here.
    ``label`` names what ``name`` is a field of (a config built in code: ``"field"``)."""
    if is_float_tag(v):
        f = _FLOAT_TAGS[v["__float__"]]
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
        f = float(v)
    else:
        raise ValueError(f"{arch}: {label} {name} must be a number, got {v!r}")
    if positive and not f > 0:
        why = "> 0"
    elif lo is not None and not f >= lo:
        why = f">= {lo}"
    elif math.isnan(f) or (math.isinf(f) and not (allow_inf and f > 0)):
        why = "finite" + (" (or +inf)" if allow_inf else "")
    else:
        return f
    raise ValueError(f"{arch}: {label} {name} must be {why}, got {v!r}")


def number(arch: str, cfg: dict, name: str, default=None, *, positive: bool = False,
           lo: float | None = None, null=_NO_NULL) -> float | None:
    """config.json field ``name`` through :func:`check_number` (absent: ``default``; null: refused
    unless ``null`` says what it means, returned as is)."""
    v = field(arch, cfg, name, default, null=null)
    if v is None and null is not _NO_NULL:
        return None
    return check_number(arch, name, v, positive=positive, lo=lo)


def refuse(arch: str, name: str, got, why: str):
    raise ValueError(f"{arch}: config.json field {name}={got!r} is not supported ({why})")


def check_int_value(arch: str, name: str, v, lo: int = 1, *, label: str = "config.json field") -> int:
    """``v`` when it is an int (not a bool) >= ``lo``; refused naming the field otherwise (``label``
    as in :func:`check_number`)."""
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{arch}: {label} {name} must be an int >= {lo}, got {v!r}")
    return v


def check_int(arch: str, cfg: dict, name: str, default=None, lo: int = 1, *, null=_NO_NULL) -> int:
    """config.json field ``name`` (:func:`field`) through :func:`check_int_value`."""
    return check_int_value(arch, name, field(arch, cfg, name, default, null=null), lo)


def rope_parameters(arch: str, cfg: dict, types: tuple[str, ...] = ("default",)) -> dict:
    """The RoPE parameters transformers reads (``rope_scaling or rope_parameters``, each null or an
    object), with ``rope_type`` set; refused: the two fields both given and different (kvjax does
    not pick one silently), per-layer-type parameters (nested objects), ``rope_type`` and its
    legacy name ``type`` disagreeing, and a ``rope_type`` outside ``types`` (whichever field it
    came in)."""
    got = {}
    for name in ("rope_parameters", "rope_scaling"):
        v = cfg.get(name)
        if v is not None and not isinstance(v, dict):
            raise ValueError(f"{arch}: config.json field {name} must be an object, got {v!r}")
        got[name] = v
    rp, rs = got["rope_parameters"], got["rope_scaling"]
    if rp and rs and rp != rs:
        raise ValueError(f"{arch}: config.json fields rope_parameters={rp!r} and rope_scaling={rs!r} disagree "
                         f"(transformers reads rope_scaling when it is set); give one of them")
    rp = dict(rs or rp or {})
    if any(isinstance(v, dict) and not is_float_tag(v) for v in rp.values()):
        refuse(arch, "rope_parameters", rp, "one set of RoPE parameters (not per-layer-type ones)")
    if "rope_type" in rp and "type" in rp and rp["rope_type"] != rp["type"]:
        raise ValueError(f"{arch}: config.json rope parameters rope_type={rp['rope_type']!r} and "
                         f"type={rp['type']!r} disagree")
    rp["rope_type"] = rp.get("rope_type", rp.get("type", "default"))
    if rp["rope_type"] not in types:
        refuse(arch, "rope_parameters.rope_type", rp["rope_type"], f"implemented: {', '.join(types)}")
    return rp


def check_rope(arch: str, cfg: dict, *, default_theta: float = 10000.0, default_partial: float = 1.0,
               top_level_partial: bool = True) -> tuple[float, float]:
    """``(rope_theta, partial_rotary_factor)`` of plain RoPE; other ``rope_type`` s refused.
    ``top_level_partial=False``: a top-level ``partial_rotary_factor`` has no effect (transformers'
    Bamba pins it), only the rope parameters' one."""
    rp = rope_parameters(arch, cfg)
    theta = rope_number(arch, cfg, rp, "rope_theta", default_theta, positive=True)
    partial = rope_number(arch, cfg if top_level_partial else {}, rp, "partial_rotary_factor", default_partial,
                          positive=True)
    if partial > 1:
        raise ValueError(f"{arch}: config.json field partial_rotary_factor must be <= 1, got {partial!r}")
    return theta, partial


def rope_number(arch: str, cfg: dict, rp: dict, name: str, default, **kw) -> float:
    """RoPE parameter ``name``: from the rope parameters (named ``rope_parameters.name``), else the
    top-level field, else ``default``; through :func:`check_number`."""
    if name in rp:
        return check_number(arch, f"rope_parameters.{name}", rp[name], **kw)
    return number(arch, cfg, name, default, **kw)
