"""The import graph runs one way: kvjax -> pallas_kernels, never the reverse, and no cycles."""

import ast
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


#: Run in one fresh interpreter: import every project module once (so every third-party module
#: any of them needs is loaded), then for each module drop every project module from
#: sys.modules and import that module first. Prints one line per failure.
#:
#: Importing ``a.b.c`` imports ``a`` first, then ``a.b``, and stops as soon as ``a.b.c`` is in
#: sys.modules (importlib checks again after each parent). So when a parent imported alone
#: (earlier: parents sort first) loads the module, importing the module alone runs exactly that
#: parent's import, the same code in the same order: its outcome is the parent's, reported under
#: the module's name as well, and the same import is not run again.
_IMPORT_EACH_ALONE = """
import importlib, sys
names, packages = sys.argv[1:], ("kvjax", "pallas_kernels")
for name in names:
    try:
        importlib.import_module(name)
    except BaseException:
        pass  # reported below, when it is imported alone
loaded, failed = {}, {}  # what importing a module alone loaded; how it failed
for name in names:
    parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
    same = next((p for p in parents if p in loaded and name in loaded[p]), None)
    if same is not None:  # importing it alone is importing ``same`` alone
        if same in failed:
            print(f"{name} (imported by {same} first): {failed[same]}")
        continue
    for mod in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[mod]
    try:
        importlib.import_module(name)
    except BaseException as e:
        failed[name] = f"{type(e).__name__}: {e}"
        print(f"{name}: {failed[name]}")
    loaded[name] = {m for m in sys.modules if m.split(".")[0] in packages}
"""


def test_every_module_imports_alone():
    """A cycle or a missing project import that depends on import order shows only when a
    module is imported first: each module is imported with no project module loaded.

    One interpreter, not one per module (~20 s instead of minutes on 2 cores): between
    imports every ``kvjax`` / ``pallas_kernels`` module leaves ``sys.modules``, so each import
    re-runs the module and its project imports from scratch; third-party modules stay loaded.
    A module its parent package loads is not imported again: importing it alone is importing
    that parent alone (see ``_IMPORT_EACH_ALONE``), about a third of the modules run their own
    import (~18 -> ~10 s).
    """
    names = [n for n, _ in _modules() if not n.endswith("__main__")]
    assert names.index("kvjax") < names.index("kvjax.runner") < names.index("kvjax.runner.mesh")  # parents first
    r = subprocess.run([sys.executable, "-c", _IMPORT_EACH_ALONE, *names], capture_output=True,
                       text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    bad = r.stdout.strip().splitlines()
    assert not bad, bad


@pytest.mark.parametrize("name", ["reshape_and_cache_flash", "concat_and_cache_mla", "zero_blocks",
                                  "selective_state_update", "causal_conv1d_update",
                                  "selective_scan_varlen", "causal_conv1d_varlen",
                                  "combine_sampled_and_draft_tokens"])
def test_public_kernel_names_at_top_level(name):
    import pallas_kernels

    assert name in pallas_kernels.__all__
    assert callable(getattr(pallas_kernels, name))


def test_runner_names_no_model_or_layer_type():
    """kvjax/runner serves any model through kvjax.models.interface: no layer type or model class
    is named in its code (the model's own module owns them)."""
    import re

    terms = ("mamba", "attn", "attention", "moe", "ssm", "hybrid", "latent", "expert", "conv")
    allowed = {"expert_axis"}  # the interface's argument naming the mesh axis MoE experts shard over

    def named(token):  # identifier parts, split at "_" and at camelCase humps
        return any(part.lower().rstrip("s") in terms or part.lower() in terms
                   for part in re.split(r"_|(?<=[a-z0-9])(?=[A-Z])", token))

    bad = [f"{p.name}:{i}: {tok}" for p in sorted((ROOT / "kvjax" / "runner").glob("*.py"))
           for i, line in enumerate(p.read_text().splitlines(), 1)
           for tok in re.findall(r"\w+", line) if tok not in allowed and named(tok)]
    assert not bad, bad


def test_test_modules_have_unique_names():
    """The test directories have no ``__init__.py``: pytest imports each test module by its
    file name alone, and two modules of one name in different directories fail the whole run's
    collection ("import file mismatch") though each directory passes on its own."""
    seen = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name != "conftest.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, clashes
