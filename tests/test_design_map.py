"""docs/design.md, section 10, maps every file of the package: a file added, moved or removed updates the map."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_file_map_lists_every_file_of_the_package_and_no_other():
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("## 10. Where each part lives", 1)[1].split("\n## ", 1)[0]
    mapped = set(re.findall(r"^\| `(flexhstu/[^`]+\.py)` \|", section, flags=re.MULTILINE))
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "flexhstu").rglob("*.py")}
    assert sorted(files - mapped) == [], "files missing from the map"
    assert sorted(mapped - files) == [], "the map names files that do not exist"
