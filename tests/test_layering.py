"""The import graph runs one way: kvjax -> pallas_kernels, never the reverse, and no cycles."""

import ast
import concurrent.futures
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kvjax", "pallas_kernels")


def _modules():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            yield ".".join(parts), path


def _imported_names(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield from (f"{node.module}.{a.name}" for a in node.names)


def _imports_between(importer: str, imported: str) -> list[str]:
    """Every import of ``imported`` (a package or module) by a module of ``importer``."""
    return [f"{name} imports {mod}" for name, path in _modules()
            if name == importer or name.startswith(importer + ".")
            for mod in _imported_names(ast.parse(path.read_text()))
            if mod == imported or mod.startswith(imported + ".")]


def test_pallas_kernels_imports_nothing_from_kvjax():
    offenders = _imports_between("pallas_kernels", "kvjax")
    assert not offenders, offenders


def test_testing_imports_nothing_from_cli():
    """The CLI sits on top of kvjax.testing (difftest), never below it."""
    offenders = _imports_between("kvjax.testing", "kvjax.cli")
    assert not offenders, offenders


#: Modules that need an optional dependency at import time (torch); importing them lazily keeps
#: kvjax usable without it. Anything else imported inside a function would be hiding a cycle.
OPTIONAL = {"kvjax.testing.torch_ref", "kvjax.testing.transformers_check"}


def test_no_function_level_imports_of_project_modules():
    """Project imports sit at module top level (no hidden cycles); optional deps may be lazy."""
    offenders = []
    for name, path in _modules():
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for mod in _imported_names(fn):
                if mod.split(".")[0] in PACKAGES and not any(
                        mod == o or mod.startswith(o + ".") for o in OPTIONAL):
                    offenders.append(f"{name}.{fn.name} imports {mod}")
    assert not offenders, offenders


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """A cycle that depends on import order shows only when a module is imported first."""
    names = [n for n, _ in _modules() if not n.endswith("__main__")]

    def try_import(name):
        r = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True,
                           text=True, cwd=ROOT, timeout=300)
        return None if r.returncode == 0 else f"{name}: {r.stderr.strip().splitlines()[-1]}"

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        bad = [b for b in pool.map(try_import, names) if b]
    assert not bad, bad


@pytest.mark.parametrize("name", ["reshape_and_cache_flash", "concat_and_cache_mla", "zero_blocks",
                                  "selective_state_update", "causal_conv1d_update",
                                  "selective_scan_varlen", "causal_conv1d_varlen",
                                  "combine_sampled_and_draft_tokens"])
def test_public_kernel_names_at_top_level(name):
    import pallas_kernels

    assert name in pallas_kernels.__all__
    assert callable(getattr(pallas_kernels, name))
