"""The README's commands and CI stay in sync."""

import pathlib
import re

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
