"""Code in the docs runs: every ```python block of README.md (in order, one namespace)
and every ```python runnable block of docs/*.md."""

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
