"""Code in the docs runs: every ```python block of README.md (in order, one namespace)
and every ```python runnable block of docs/*.md; every other ```python block of docs/*.md
is valid Python (those that need a trainer or several processes run in the tests named
beside them)."""

import pathlib
import re
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _blocks(path, tag):
    return re.findall(rf"```{tag}\n(.*?)```", path.read_text(), re.S)


def test_readme_examples_run():
    code = "\n".join(_blocks(ROOT / "README.md", "python"))
    assert code
    exec(compile(code, "README.md", "exec"), {})


@pytest.mark.parametrize("path", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_docs_runnable_blocks_run(path):
    # as written, and without warnings of torch_fce's own (a lowering example that fuses
    # nothing warns)
    for code in _blocks(path, "python runnable"):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", module="torch_fce")
            warnings.filterwarnings("error", message="torch_fce")
            exec(compile(code, str(path), "exec"), {})


@pytest.mark.parametrize("path", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_docs_python_blocks_are_valid_python(path):
    for code in _blocks(path, "python"):
        compile(code, str(path), "exec")


def test_api_commands_list_every_bench_subcommand():
    from torch_fce.bench.__main__ import SUBCOMMANDS

    block = (ROOT / "docs" / "api.md").read_text().split("## Commands", 1)[1]
    listed = re.findall(r"python -m torch_fce\.bench (\w+)", block.split("```")[1])
    assert listed == list(SUBCOMMANDS)
