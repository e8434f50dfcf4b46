"""Every ```python block of README.md runs as written (CPU, small sizes); every one of docs/*.md is Python (a
listing that is not code is tagged ```text)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.MULTILINE | re.DOTALL)
BLOCKS = PYTHON_BLOCK.findall(README.read_text())
DOCS = sorted((README.parent / "docs").glob("*.md"))


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_python_block_runs_as_written(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an example that writes files writes them here
    exec(compile(BLOCKS[index], f"README.md python block {index + 1}", "exec"), {"__name__": "__readme__"})


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_python_block_of_the_docs_compiles(doc):
    # docs/design.md section 6 tagged a signature listing (flexhstu.Kernel.{AUTO, ...}) as python. The docs'
    # examples need a GPU or a C++ compiler (docs/serving.md's compile_scorer), so they are compiled, not run.
    for n, block in enumerate(PYTHON_BLOCK.findall(doc.read_text()), start=1):
        compile(block, f"{doc.name} python block {n}", "exec")
