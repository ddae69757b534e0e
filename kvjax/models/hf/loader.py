"""Load a local Hugging Face checkpoint directory: ``load_pretrained(path) -> (model, params)``.

kvjax never downloads anything: ``path`` is a directory already on disk, holding
``config.json`` and ``model.safetensors`` (or a sharded ``model.safetensors.index.json`` and
its files; both at once is refused as ambiguous), as ``transformers``' ``save_pretrained`` writes it.

Order of work, so that a bad checkpoint fails fast and says why (``ValueError`` naming the
field or tensor, what was expected and what came):

1. ``config.json`` is parsed; ``architectures[0]`` picks a module from :data:`ARCHITECTURES`
   (an unknown one is refused, naming the supported ones);
2. the module turns the config into a frozen model config, refusing any field value it does
   not implement — before any weight is read;
3. the safetensors headers (only) are read: every tensor the config needs must be there
   with its shape and a floating-point dtype (:data:`FLOAT_DTYPES`), none may be left over,
   every file must hold the bytes its header promises (a truncated file is refused here), its
   tensors' byte ranges must tile its data area exactly (no overlap, gap, duplicate name or
   trailing bytes, as the safetensors library requires), an index may name only files of the
   directory, and a stored ``lm_head.weight`` beside a tied config must have the embedding's
   shape and dtype;
4. such a head is read with the embedding and must equal it bit for bit (transformers ties an
   equal copy and keeps a different head untied: refused, before any other weight is read);
   tensors are read one by one (memory-mapped), converted to the requested dtype and placed:
   each is first checked to hold finite values only: a NaN or infinite weight (or a float64
   one beyond float32's range) is refused with a ``ValueError`` naming the file, the tensor,
   the count and the first index, not loaded with a warning (it would make every logit NaN);
   with ``mesh`` each with its own ``NamedSharding`` right after it is read (attention and
   Mamba heads over ``"model"``, routed experts over ``"data"``), so the whole model is
   never on one device first.

**The architecture protocol.** A module registered in :data:`ARCHITECTURES` provides:

* ``config_from_hf(cfg: dict) -> config``: a frozen, hashable config from ``config.json``'s
  dict; ``ValueError`` naming any unsupported field value. If the config dataclass has a
  ``dtype`` field, the loader sets it to the requested dtype.
* ``expected_tensors(config) -> dict[name, shape]``: every checkpoint tensor it reads.
* ``params_from_tensors(config, get, dtype, put=None) -> params``: the param pytree, reading
  tensors through ``get(name) -> np.ndarray`` (memory-mapped, read on access). ``put``
  (optional in the signature) is ``put(path, host_array) -> leaf``, called once per leaf as
  soon as it is built (``path`` a tuple of dict keys / sequence indices); the loader's
  ``put`` places the leaf on the device(s). A module without ``put`` gets its params placed
  afterwards.
* ``Model`` (or a class named as the architecture without ``ForCausalLM``, e.g. ``DeepseekV3``):
  ``Model(config)``, or ``Model(config, dtype=dtype)`` when it takes ``dtype``, implementing
  :class:`kvjax.models.interface.Model`.
* optionally ``ignored_tensor(config, name) -> bool``: tensors present in checkpoints that
  the architecture does not use (transformers does not load them either).

With ``mesh`` the leaf's PartitionSpec comes from ``model.param_spec(path)`` when the model
has it, else from ``model.param_partitioning`` of the params' shapes; with a ``"model"``
axis of ``M > 1`` each leaf is first reordered by ``model.layout_leaf(path, array, M)``
(else the whole host tree goes through ``model.layout_for_shards``).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import math
import os
import struct
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding

from kvjax.models.hf.hybrid import path_tuple

# architectures[0] -> the module implementing it (imported when first used).
ARCHITECTURES: dict[str, str] = {
    "GraniteMoeHybridForCausalLM": "kvjax.models.hf.granite",
    "BambaForCausalLM": "kvjax.models.hf.bamba",
    "NemotronHForCausalLM": "kvjax.models.hf.nemotron_h",
    "DeepseekV3ForCausalLM": "kvjax.models.hf.deepseek_v3",
}
DTYPES = ("float32", "bfloat16")

_ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


def architecture_module(name: str):
    """The module implementing ``architectures[0] == name``; ValueError if there is none."""
    if name not in ARCHITECTURES:
        raise ValueError(f"config.json: architecture {name!r} is not supported "
                         f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    try:
        return importlib.import_module(ARCHITECTURES[name])
    except ModuleNotFoundError as e:
        if e.name == ARCHITECTURES[name]:
            raise ValueError(f"config.json: architecture {name!r} is not yet supported "
                             f"({ARCHITECTURES[name]} is not written yet)") from None
        raise


# ---------------------------------------------------------------------------- safetensors


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _read_header(file: str) -> dict[str, _TensorInfo]:
    """Every tensor of one safetensors file, from its header alone (nothing else is read)."""
    name = os.path.basename(file)
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{name}: not a safetensors file (truncated: {size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"{name}: truncated safetensors file (header of {n} bytes, file of {size})")
            raw = f.read(n)
    except OSError as e:
        raise ValueError(f"{name}: cannot be read ({e.strerror or e})") from None
    def unique(pairs):  # every JSON object of the header: the top level's values are its tensors' entries
        seen = set()
        for k, _ in pairs:
            if k in seen:
                what = "tensor" if any(isinstance(v, dict) for _, v in pairs) else "key"
                raise ValueError(f"{name}: safetensors header: {what} {k!r} is listed twice")
            seen.add(k)
        return dict(pairs)

    try:
        header = json.loads(raw, object_pairs_hook=unique)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{name}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{name}: safetensors header must be a JSON object")
    out = {}
    for tname, info in header.items():
        if tname == "__metadata__":
            continue
        if isinstance(info, dict):
            dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        else:
            dtype = shape = offsets = None
        if not (isinstance(shape, list) and all(_is_count(d) for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
                and offsets[0] <= offsets[1] and isinstance(dtype, str)):
            raise ValueError(f"{name}: malformed header entry for tensor {tname!r}: {info!r} (expected "
                             f"'dtype' a name, 'shape' a list of ints >= 0, 'data_offsets' [begin, end])")
        if dtype not in _ST_DTYPES:
            raise ValueError(f"{name}: tensor {tname!r} has dtype {dtype!r}, expected one of "
                             f"{sorted(_ST_DTYPES)}")
        dt = _ST_DTYPES[dtype]
        begin, end = offsets
        shape = tuple(shape)
        nbytes = math.prod(shape) * dt.itemsize
        if end - begin != nbytes:
            raise ValueError(f"{name}: tensor {tname!r} of shape {list(shape)} {dtype} needs {nbytes} "
                             f"bytes, its header gives {end - begin}")
        if 8 + n + end > size:
            raise ValueError(f"{name}: truncated safetensors file: tensor {tname!r} ends at byte "
                             f"{8 + n + end}, the file has {size}")
        out[tname] = _TensorInfo(file, dt, shape, 8 + n + begin, nbytes)
    _check_tiling(name, out, 8 + n, size)
    return out


def _check_tiling(name: str, tensors: dict[str, _TensorInfo], start: int, size: int) -> None:
    """The tensors' byte ranges must tile the data area ``[start, size)`` exactly, in offset
    order: no overlap, no gap, no byte after the last one (the safetensors library's rule)."""
    at, prev, gap = start, None, None
    for tname, t in sorted(tensors.items(), key=lambda kv: (kv[1].offset, kv[1].nbytes)):
        if t.offset < at:  # an overlap is named before any gap (an aliased tensor leaves both)
            raise ValueError(f"{name}: safetensors header: tensor {tname!r} (bytes {t.offset - start}.."
                             f"{t.offset - start + t.nbytes}) overlaps {prev!r} (which ends at {at - start}); "
                             f"expected each tensor's bytes to start where the previous one's end")
        if t.offset > at and gap is None:
            gap = (f"{name}: safetensors header: a gap of {t.offset - at} bytes before tensor {tname!r} "
                   f"(it starts at {t.offset - start}, "
                   f"{'the data area starts at 0' if prev is None else f'{prev!r} ends at {at - start}'}); "
                   f"expected the tensors to tile the data area")
        at, prev = t.offset + t.nbytes, tname
    if gap is not None:
        raise ValueError(gap)
    if at != size:
        raise ValueError(f"{name}: safetensors file has {size - at} bytes after the last tensor's "
                         f"(the header accounts for {at - start} bytes of data, the file holds {size - start})")


def _index_checkpoint(path: str) -> dict[str, _TensorInfo]:
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index) and os.path.exists(single):
        raise ValueError(f"{path}: holds both model.safetensors and model.safetensors.index.json: which weights "
                         f"are meant is ambiguous (transformers would read model.safetensors and ignore the "
                         f"index); remove one of them")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"model.safetensors.index.json: no valid 'weight_map' ({e!r})") from None
        except OSError as e:
            raise ValueError(f"model.safetensors.index.json: cannot be read ({e.strerror or e})") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"model.safetensors.index.json: 'weight_map' must map tensor names to file "
                             f"names, got a {type(weight_map).__name__}")
        for tname, fn in weight_map.items():
            if not isinstance(fn, str) or not fn or os.path.basename(fn) != fn or fn in (".", ".."):
                raise ValueError(f"model.safetensors.index.json: tensor {tname!r} maps to {fn!r}, expected "
                                 f"the name of a file in the checkpoint directory")
        files = sorted(set(weight_map.values()))
        for fn in files:
            if not os.path.exists(os.path.join(path, fn)):
                raise ValueError(f"model.safetensors.index.json names {fn!r}, which is not in {path}")
        tensors: dict[str, _TensorInfo] = {}
        for fn in files:
            full = os.path.join(path, fn)
            for tname, info in _read_header(full).items():
                if weight_map.get(tname) != fn:
                    raise ValueError(f"{fn}: tensor {tname!r} is not listed for this file in "
                                     f"model.safetensors.index.json")
                tensors[tname] = info
        listed = set(weight_map) - set(tensors)
        if listed:
            raise ValueError(f"model.safetensors.index.json lists tensor {sorted(listed)[0]!r}, "
                             f"which its file does not hold")
        return tensors
    if os.path.exists(single):
        return _read_header(single)
    raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")


#: Checkpoint dtypes a weight may have: floating point. fp8 weights come with quantisation scales
#: (``quantization_config``), which the architectures refuse.
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_FLOAT_NP = {_ST_DTYPES[d] for d in FLOAT_DTYPES}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def _reader(tensors: dict[str, _TensorInfo]):
    """``get(name) -> np.ndarray`` (memory-mapped). Each tensor is checked on its first read: every
    value finite (a NaN or infinite weight is a ``ValueError`` naming the file, the tensor, the
    count and the first index), and float64 values within float32's range."""
    checked: set[str] = set()

    def get(name: str) -> np.ndarray:
        try:
            t = tensors[name]
        except KeyError:
            raise ValueError(f"checkpoint has no tensor {name!r}") from None
        if t.nbytes == 0:
            return np.zeros(t.shape, t.dtype)
        raw = np.memmap(t.file, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.nbytes,))
        arr = raw.view(t.dtype).reshape(t.shape)
        if name not in checked:
            check_finite(name, arr, os.path.basename(t.file))
            checked.add(name)
        return arr

    return get


_FINITE_CHUNK = 1 << 22  # elements checked at a time (bounded temporaries on large tensors)


def check_finite(name: str, arr: np.ndarray, where: str = "checkpoint") -> None:
    """``ValueError`` when the weight ``arr`` holds a NaN or an infinity (or, as float64, a value
    float32 cannot hold): the count of each and the first index."""
    if arr.dtype not in _FLOAT_NP or arr.size == 0:
        return
    wide = arr.dtype == np.float64
    limit = np.finfo(np.float32).max

    def ok(x):
        good = np.isfinite(x)
        if wide:
            good &= np.abs(np.where(good, x, 0.0)) <= limit
        return good

    flat = arr.reshape(-1)
    for start in range(0, flat.size, _FINITE_CHUNK):
        good = ok(flat[start:start + _FINITE_CHUNK])
        if good.all():
            continue
        first = [int(i) for i in np.unravel_index(start + int(np.argmin(good)), arr.shape)]
        bad = int(sum((~ok(flat[i:i + _FINITE_CHUNK])).sum() for i in range(0, flat.size, _FINITE_CHUNK)))
        nan = int(sum(np.isnan(flat[i:i + _FINITE_CHUNK]).sum() for i in range(0, flat.size, _FINITE_CHUNK)))
        what = f"{nan} NaN and {bad - nan} infinite" + (" (or beyond float32)" if wide else "")
        raise ValueError(f"{where}: tensor {name!r} holds {what} values (first at {first}: "
                         f"{float(arr[tuple(first)])}); expected finite weights")


def _file_of(t) -> str:
    f = getattr(t, "file", None)
    return os.path.basename(f) if f else "checkpoint"


HEAD = "lm_head.weight"
TIED_EMBEDDING = "model.embed_tokens.weight"  # the embedding a tied head is, in every tying architecture here


def tied_head_stored(expected: dict[str, tuple[int, ...]], tensors: dict[str, Any]) -> bool:
    """A tied config (no ``lm_head.weight`` expected) whose checkpoint stores one of the
    embedding's shape and dtype: legal only as a copy (:func:`check_tied_head`)."""
    if HEAD in expected or HEAD not in tensors or TIED_EMBEDDING not in tensors:
        return False
    h, e = tensors[HEAD], tensors[TIED_EMBEDDING]
    return tuple(h.shape) == tuple(e.shape) and np.dtype(h.dtype) == np.dtype(e.dtype)


def check_tied_head(expected, tensors, get) -> None:
    """A tied config's stored head must equal the embedding, bit for bit: transformers ties the
    two when they are equal and keeps the stored head when they differ (a model kvjax's tied
    config does not describe). Reads those two tensors only; a different head is a ValueError
    naming the tensors and the field, before any other weight is read."""
    if not tied_head_stored(expected, tensors):
        return
    head, embed = get(HEAD), get(TIED_EMBEDDING)  # one shape and dtype: compared as bytes
    if not np.array_equal(head.view(np.uint8), embed.view(np.uint8)):
        raise ValueError(
            f"{_file_of(tensors[HEAD])}: checkpoint stores {HEAD!r}, different from {TIED_EMBEDDING!r}, but "
            f"config.json has tie_word_embeddings=true: transformers then keeps the stored head and does "
            f"not tie; kvjax refuses the contradiction (set tie_word_embeddings to false to use the stored "
            f"head, or remove the tensor to tie)")


def check_tensors(expected: dict[str, tuple[int, ...]], tensors: dict[str, Any], ignored=None) -> None:
    """Missing, wrong-shape, non-float and unexpected tensors, each a ValueError naming the file
    (when ``tensors`` come from :func:`_read_header`) and the tensor, what config.json implies and
    what came."""
    files = sorted({_file_of(t) for t in tensors.values()}) or ["checkpoint"]
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {list(shape)}): not in "
                             f"{', '.join(files)}, and config.json needs it")
        t = tensors[name]
        got = tuple(t.shape)
        if got != tuple(shape):
            raise ValueError(f"{_file_of(t)}: checkpoint tensor {name!r} has shape {list(got)}, expected "
                             f"{list(shape)} (from config.json)")
        dtype = np.dtype(t.dtype)
        if dtype not in _FLOAT_NP:
            raise ValueError(f"{_file_of(t)}: tensor {name!r} has dtype {_ST_NAMES.get(dtype, dtype.name)}, "
                             f"expected a floating-point weight ({', '.join(FLOAT_DTYPES)})")
    extra = sorted(n for n in tensors if n not in expected and not (ignored and ignored(n)))
    if tied_head_stored(expected, tensors):  # checked by value when read (check_tied_head)
        extra.remove(HEAD)
    elif HEAD in extra:
        raise ValueError(f"{_file_of(tensors[HEAD])}: checkpoint stores {HEAD!r} but config.json has "
                         f"tie_word_embeddings=true, and it is not a copy of {TIED_EMBEDDING!r} (another "
                         f"shape or dtype): transformers would keep it and not tie")
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ValueError(f"{_file_of(tensors[extra[0]])}: checkpoint has unexpected tensor {extra[0]!r}{more}: "
                         f"the config does not use it")


# ------------------------------------------------------------------------------ loading


def read_config(path: str) -> dict:
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise ValueError(f"path must be a local checkpoint directory, got {path!r}")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise ValueError(f"{path}: no config.json")
    try:
        with open(cfg_file) as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_file}: must hold a JSON object")
    return cfg


def config_from_dir(path: str, dtype: str = "float32"):
    """``(module, config)`` of a checkpoint directory: config.json only, no weight read."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    cfg = read_config(path)
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ValueError(f"config.json: 'architectures' must be a non-empty list of names, got {archs!r}")
    module = architecture_module(archs[0])
    config = module.config_from_hf(cfg)
    if dataclasses.is_dataclass(config) and any(f.name == "dtype" for f in dataclasses.fields(config)):
        config = dataclasses.replace(config, dtype=dtype)
    return module, config


def eos_token_ids(path) -> tuple[int, ...]:
    """The checkpoint's end-of-sequence ids: ``generation_config.json``'s ``eos_token_id`` if the
    directory has one, else ``config.json``'s (an int, a list or null -> a tuple)."""
    gen = os.path.join(os.fspath(path), "generation_config.json")
    src = None
    if os.path.exists(gen):
        try:
            with open(gen) as f:
                src = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{gen}: not valid JSON ({e})") from None
    if not isinstance(src, dict) or src.get("eos_token_id") is None:
        src = read_config(os.fspath(path))
    eos = src.get("eos_token_id")
    ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
        raise ValueError(f"eos_token_id must be a non-negative int or a list of them, got {eos!r}")
    return tuple(ids)


def _make_model(module, config, dtype: str):
    arch = getattr(module, "ARCH", None) or getattr(module, "ARCHITECTURE", "")
    cls = getattr(module, "Model", None) or getattr(module, arch.removesuffix("ForCausalLM"), None)
    if cls is None:
        raise ValueError(f"{module.__name__} defines no Model class")
    if "dtype" in inspect.signature(cls).parameters:
        return cls(config, dtype=dtype)
    return cls(config)


def default_dtype() -> str:
    """``"float32"`` on a CPU (parity with transformers), ``"bfloat16"`` on an accelerator."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def model_from_dir(path, dtype: str | None = None):
    """The model of a checkpoint directory from its ``config.json`` alone (no weight is read):
    unsupported architectures and fields are refused here. ``dtype`` as in :func:`load_pretrained`."""
    dtype = default_dtype() if dtype is None else dtype
    module, config = config_from_dir(os.fspath(path) if isinstance(path, os.PathLike) else path, dtype)
    return _make_model(module, config, dtype)


def load_pretrained(path, dtype: str | None = None, mesh=None):
    """``(model, params)`` of the Hugging Face checkpoint directory ``path`` (see the module
    docstring). ``dtype``: ``"float32"`` or ``"bfloat16"``; None: :func:`default_dtype`.
    ``mesh``: a ``jax.sharding.Mesh`` with axes ``("data", "model")`` to place the params on,
    or None (the default device)."""
    dtype = default_dtype() if dtype is None else dtype
    path = os.fspath(path) if isinstance(path, os.PathLike) else path
    module, config = config_from_dir(path, dtype)
    model = _make_model(module, config, dtype)
    tensors = _index_checkpoint(path)
    ignored = getattr(module, "ignored_tensor", None)
    expected = module.expected_tensors(config)
    check_tensors(expected, tensors, None if ignored is None else (lambda n: ignored(config, n)))

    M = 1
    spec_of = None
    if mesh is not None:
        if tuple(mesh.axis_names) != ("data", "model"):
            raise ValueError(f"mesh axes must be ('data', 'model'), got {tuple(mesh.axis_names)}")
        M = int(mesh.shape["model"])
        if hasattr(model, "check_mesh"):
            model.check_mesh(int(mesh.shape["data"]), M)
        if hasattr(model, "param_spec"):
            spec_of = model.param_spec
        else:
            shapes = jax.eval_shape(lambda: model.init_params(0))
            flat = jax.tree_util.tree_flatten_with_path(model.param_partitioning(shapes))[0]
            table = {path_tuple(p): s for p, s in flat}
            spec_of = table.__getitem__
    per_leaf = M == 1 or hasattr(model, "layout_leaf")

    def put(leaf_path, arr):
        if mesh is None:
            return jax.device_put(arr)
        if M > 1:
            arr = model.layout_leaf(leaf_path, arr, M)
        return jax.device_put(arr, NamedSharding(mesh, spec_of(leaf_path)))

    def host(leaf_path, arr):
        return arr

    accepts_put = "put" in inspect.signature(module.params_from_tensors).parameters
    get = _reader(tensors)
    check_tied_head(expected, tensors, get)
    if accepts_put and per_leaf:
        params = module.params_from_tensors(config, get, dtype, put=put)
    else:
        params = (module.params_from_tensors(config, get, dtype, put=host) if accepts_put
                  else module.params_from_tensors(config, get, dtype))
        if M > 1:
            params = model.layout_for_shards(params, M)
            flat, treedef = jax.tree_util.tree_flatten_with_path(params)
            params = jax.tree_util.tree_unflatten(treedef, [
                jax.device_put(np.asarray(a), NamedSharding(mesh, spec_of(path_tuple(p)))) for p, a in flat])
        else:
            params = jax.tree_util.tree_map_with_path(lambda p, a: put(path_tuple(p), np.asarray(a)), params)
    return model, params
