"""The dependency direction holds: bridge → channels → core. Core imports neither channels nor bridge, and
nothing under channels imports bridge (not even for type checking)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(("package", "forbidden"), [("core", {"channels", "bridge"}), ("channels", {"bridge"})])
def test_no_import_against_the_dependency_direction(package: str, forbidden: set[str]) -> None:
    offenders = {str(path.relative_to(ROOT)): sorted(imported_packages(path) & forbidden)
                 for path in sorted((ROOT / package).rglob("*.py"))}
    assert {path: names for path, names in offenders.items() if names} == {}
