"""Package hygiene of ``pallas_kernels``, read from the source with ``ast``.

* No module of ``pallas_kernels`` uses another module's underscore names
  (``from pallas_kernels.kv_write import _x``, or ``kv_write._x`` on an imported
  module): what several kernels share lives in a shared module under a public name
  (``contract``, ``fp8``, ``segments``, ``gpu_tiling``, ``backend``, ...). Package-private
  modules (``_xla``, ``_backend``) may be imported inside the package; their
  underscore names may not.
* Nothing outside ``pallas_kernels`` (``kvjax``, the tests) imports
  ``pallas_kernels._backend``: tools use the public :mod:`pallas_kernels.backend`.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

from pallas_kernels import backend

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = "pallas_kernels"


def _module_names() -> set[str]:
    return {p.stem for p in (ROOT / PKG).glob("*.py") if p.stem != "__init__"}


def underscore_uses(source: str, own: str, modules: set[str]) -> list[str]:
    """Every use, in module ``own``'s ``source``, of an underscore name of another module
    of the package: ``from pallas_kernels.m import _x`` (or ``from .m import _x``), and
    ``alias._x`` where ``alias`` is bound to a package module by an import."""
    tree = ast.parse(source)
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .m import x / from . import m
                mod = f"{PKG}.{node.module}" if node.module else PKG
            else:
                mod = node.module or ""
            if mod == PKG:  # from pallas_kernels import m [as a]: binds a module alias
                for a in node.names:
                    if a.name in modules:
                        aliases[a.asname or a.name] = a.name
                continue
            if not mod.startswith(PKG + "."):
                continue
            other = mod.split(".")[1]
            for a in node.names:
                if a.name.startswith("_") and other != own:
                    found.append(f"{own}: from {mod} import {a.name} (line {node.lineno})")
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == PKG and len(parts) == 2 and a.asname:
                    aliases[a.asname] = parts[1]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            base = node.value
            if isinstance(base, ast.Name) and base.id in aliases and aliases[base.id] != own:
                found.append(f"{own}: {base.id}.{node.attr} ({PKG}.{aliases[base.id]}, "
                             f"line {node.lineno})")
            elif (isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name)
                  and base.value.id == PKG and base.attr in modules and base.attr != own):
                found.append(f"{own}: {PKG}.{base.attr}.{node.attr} (line {node.lineno})")
    return found


def private_backend_imports(source: str) -> list[str]:
    """Every import of ``pallas_kernels._backend`` (any spelling) in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == f"{PKG}._backend" or node.module.startswith(f"{PKG}._backend."):
                found.append(f"from {node.module} import ... (line {node.lineno})")
            elif node.module == PKG and any(a.name == "_backend" for a in node.names):
                found.append(f"from {PKG} import _backend (line {node.lineno})")
        elif isinstance(node, ast.Import):
            found += [f"import {a.name} (line {node.lineno})" for a in node.names
                      if a.name == f"{PKG}._backend" or a.name.startswith(f"{PKG}._backend.")]
    return found


def test_no_module_uses_another_modules_underscore_names():
    modules = _module_names()
    offenders = []
    for path in sorted((ROOT / PKG).glob("*.py")):
        offenders += underscore_uses(path.read_text(), path.stem, modules)
    assert not offenders, "\n".join(offenders)


def test_nothing_outside_the_package_imports_the_private_backend():
    offenders = []
    for top in ("kvjax", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            offenders += [f"{path.relative_to(ROOT)}: {o}"
                          for o in private_backend_imports(path.read_text())]
    assert not offenders, "\n".join(offenders)


def test_the_scanners_see_each_spelling():
    """Each form the scanners look for is found (and the allowed ones are not)."""
    modules = {"kv_write", "block_zero", "_xla", "_backend"}
    bad = {
        "from pallas_kernels.kv_write import _check_slot_mapping": 1,
        "from pallas_kernels.kv_write import OP_WRITE, _Segment as S": 1,
        "from .kv_write import _x": 1,
        "from pallas_kernels import kv_write\nkv_write._reference_write(1)": 1,
        "from pallas_kernels import kv_write as kw\nkw._gpu_num_warps": 1,
        "import pallas_kernels.kv_write as kw\nkw._live_ids": 1,
        "import pallas_kernels\npallas_kernels.kv_write._x": 1,
        "from pallas_kernels._backend import _IMPLS": 1,
        # allowed: public names, package-private modules, a module's own names, dunders
        "from pallas_kernels.kv_write import quantize_fp8": 0,
        "from pallas_kernels import _backend\n_backend.register": 0,
        "from pallas_kernels._xla import scatter_set": 0,
        "from pallas_kernels import kv_write\nkv_write.__doc__": 0,
    }
    for src, n in bad.items():
        assert len(underscore_uses(src, "block_zero", modules)) == n, src
    assert len(private_backend_imports("from pallas_kernels import _backend")) == 1
    assert len(private_backend_imports("from pallas_kernels._backend import choose")) == 1
    assert len(private_backend_imports("import pallas_kernels._backend as b")) == 1
    assert len(private_backend_imports("from pallas_kernels import backend as _backend")) == 0
    assert len(private_backend_imports("from pallas_kernels.backend import BACKENDS")) == 0


def test_the_former_backend_name_is_the_public_module():
    # The alias itself is under test here, so it is looked up by name, not imported.
    assert importlib.import_module("pallas_kernels._backend") is backend
    assert set(backend.__all__) <= set(dir(backend))
    assert "kv_write" in backend.ops() and "reference" in backend.flavors("kv_write")


def test_shared_memory_by_compute_capability():
    """CUDA's per-block shared memory by capability, and the tile rules' 85% of it (Hopper's 192
    KiB is the budget the H100 / H200 figures were measured with; no CUDA device: Hopper's)."""
    from pallas_kernels import gpu_tiling

    KiB = 1024
    want = {None: 227, (9, 0): 227, (10, 0): 227, (8, 0): 163, (8, 7): 163, (8, 6): 99, (8, 9): 99,
            (12, 0): 99, (7, 0): 96, (7, 5): 64, (6, 1): 48}
    for cap, kib in want.items():
        assert gpu_tiling.shared_memory_per_block(cap) == kib * KiB, cap
    assert [gpu_tiling.shared_memory_budget(c) // KiB for c in (None, (9, 0), (8, 0), (8, 9))] == [192, 192, 138, 84]
