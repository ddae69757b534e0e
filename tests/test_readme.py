"""The README's commands and CI stay in sync; its Python snippets and sample output are real."""

import json
import pathlib
import re
import shlex

from kvjax.cli.main import main

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _bash_blocks(text):
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one_verbatim():
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    blocks = _bash_blocks(setup)
    assert len(blocks) == 2, blocks
    demo, tests = blocks
    assert "python -m kvjax demo" in demo
    assert "pytest" in tests
    ci_lines = [l.strip() for l in (ROOT / ".ci/run").read_text().splitlines()]
    assert tests in ci_lines, f"{tests!r} not found verbatim in .ci/run"


def test_ci_installs_the_vllm_oracle_before_running_the_tests():
    """Otherwise every vLLM oracle test skips in CI."""
    readme = (ROOT / "README.md").read_text()
    tests = _bash_blocks(readme.split("## Set-up", 1)[1].split("\n## ", 1)[0])[1]
    ci_lines = [l.strip() for l in (ROOT / ".ci/run").read_text().splitlines()]
    install = "bash scripts/install_vllm_oracle.sh"
    assert install in ci_lines, f"{install!r} not in .ci/run"
    assert ci_lines.index(install) < ci_lines.index(tests)


def _fenced_blocks(text):
    """``(language, body)`` of every fenced block, in order."""
    return re.findall(r"^```([^\n`]*)\n(.*?)^```", text, flags=re.S | re.M)


def test_every_readme_fence_names_its_language():
    """An unlabelled fence would hide a Python snippet from the test below: output is ```text."""
    blocks = _fenced_blocks((ROOT / "README.md").read_text())
    assert blocks
    bad = [body[:60] for lang, body in blocks if lang.strip() not in ("python", "bash", "text", "json")]
    assert not bad, f"label these fences (python, bash, text or json): {bad}"


def test_every_readme_python_snippet_runs_as_written():
    """Each ```python block runs, in a fresh namespace, from the repository root (at the suite's
    fast XLA:CPU settings, tests/conftest.py)."""
    snippets = [body for lang, body in _fenced_blocks((ROOT / "README.md").read_text()) if lang == "python"]
    assert snippets
    for i, code in enumerate(snippets):
        try:
            exec(compile(code, f"README.md python snippet {i}", "exec"), {"__name__": f"readme_{i}"})
        except Exception as e:
            raise AssertionError(f"README python snippet {i} fails:\n{code}") from e


def test_readme_json_snippets_parse_and_its_workload_is_accepted_by_the_demo(tmp_path, monkeypatch):
    """The README has JSON snippets; each parses, and each workload among them (an object
    with "requests") is one ``python -m kvjax demo --workload`` accepts with its defaults:
    validation passes and serving starts with those requests."""
    import kvjax.cli.main as cli

    snippets = [body for lang, body in _fenced_blocks((ROOT / "README.md").read_text()) if lang == "json"]
    assert snippets, "the README has no ```json snippet"
    workloads = []
    for i, body in enumerate(snippets):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as e:
            raise AssertionError(f"README json snippet {i} does not parse: {e}\n{body}") from None
        if isinstance(data, dict) and "requests" in data:
            workloads.append(data)
    assert workloads, "no README json snippet is a workload file"

    class Served(Exception):
        pass

    def fake_serve(config, requests, **kwargs):
        raise Served([r.req_id for r in requests])

    monkeypatch.setattr(cli, "serve", fake_serve)
    for i, data in enumerate(workloads):
        path = tmp_path / f"workload_{i}.json"
        path.write_text(json.dumps(data))
        try:
            code = cli.main(["demo", "--workload", str(path), "--quiet"])
        except Served as e:
            assert e.args[0] == [r["id"] for r in data["requests"]]
        else:
            raise AssertionError(f"the demo refused README workload {i} (exit {code}): {data}")


def _table_shape(text):
    """The sample's rows without the error columns and the summary without its bracket.

    Errors and ulps of the SSU math depend on the JAX version and the CPU (JAX 0.11.2 on
    another host prints other values); which comparisons run, and bitwise / result, must not.
    """
    lines = text.strip().splitlines()
    rows = [re.split(r"\s{2,}", l.strip()) for l in lines[:-2]]
    return [r[:3] + r[5:] if len(r) == 7 else r for r in rows], lines[-1].split("  [", 1)[0]


def test_readme_difftest_sample_is_what_the_command_prints(capsys):
    """The sample table is the command's output (error values aside, see _table_shape)."""
    readme = (ROOT / "README.md").read_text()
    sample = next(body for lang, body in _fenced_blocks(readme)
                  if lang == "text" and body.startswith("$ python -m kvjax difftest"))
    command, printed = sample.split("\n", 1)
    argv = shlex.split(command)[4:]  # after "$ python -m kvjax"
    assert main([*argv, "--quiet"]) == 0
    assert _table_shape(capsys.readouterr().out) == _table_shape(printed)


def test_readme_states_the_jax_floor_that_pyproject_requires():
    pyproject = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'"jax>=([\d.]+)"', pyproject).group(1)
    readme = (ROOT / "README.md").read_text()
    assert f"JAX ≥ {floor}" in readme and f"jax>={floor}" in readme
    assert f'"jaxlib>={floor}"' in pyproject


def test_what_is_here_names_every_kvjax_package_and_top_module():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## What is here", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([\w.]+)`", table, flags=re.M))
    pkg = ROOT / "kvjax"
    parts = {p.name for p in pkg.iterdir() if (p / "__init__.py").exists()}
    parts |= {p.stem for p in pkg.glob("*.py") if not p.stem.startswith("_")}
    missing = [f"kvjax.{m}" for m in sorted(parts)
               if not any(n == f"kvjax.{m}" or n.startswith(f"kvjax.{m}.") for n in named)]
    assert not missing, f"README 'What is here' does not mention {missing}"
