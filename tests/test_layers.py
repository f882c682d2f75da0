"""The layers of the code point down only: cli -> (agents, criu_hooks) -> sandbox -> storage. Read from
the code's own imports (ast), so a new upward import fails here, not in review."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import CODE_PACKAGES, REPO

# what each package may import from the project, besides itself
ALLOWED = {
    "storage": set(),
    "sandbox": {"storage"},
    "criu_hooks": {"sandbox", "storage"},
    "agents": {"sandbox", "storage"},
    "cli": {"agents", "criu_hooks", "sandbox", "storage"},
}


def _imports(path: Path) -> set[str]:
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            tops.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def test_every_code_package_has_a_layer() -> None:
    assert set(CODE_PACKAGES) == set(ALLOWED)
    for pkg in CODE_PACKAGES:
        assert (REPO / pkg / "__init__.py").is_file(), pkg


def test_imports_point_down_only() -> None:
    wrong = []
    for pkg, allowed in ALLOWED.items():
        for path in sorted((REPO / pkg).rglob("*.py")):
            for top in _imports(path) & (set(ALLOWED) | {"tests", "scripts", "support", "conftest"}):
                if top != pkg and top not in allowed:
                    wrong.append(f"{path.relative_to(REPO)} imports {top}")
    assert not wrong, "\n".join(wrong)
