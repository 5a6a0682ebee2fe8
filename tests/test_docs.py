"""Every ```python block in docs/*.md runs: a page's blocks in order, in one namespace, so a page
reads as one script. Their asserts are the checks (e.g. functional tokens == LLM.generate's)."""

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(DOCS.glob("*.md"))


def python_blocks(page: pathlib.Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.M | re.S)


def test_the_pages_are_there():
    assert {p.name for p in PAGES} >= {"offline.md", "functional.md", "tpu-pods.md", "exactness.md"}


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"docs.{page.stem}"}
    for i, code in enumerate(python_blocks(page)):
        exec(compile(code, f"{page}:python block {i + 1}", "exec"), namespace)
