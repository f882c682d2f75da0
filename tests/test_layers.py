"""The layers of the code point down only: cli -> (agents, criu_hooks) -> sandbox -> storage; inside
sandbox/ each floor imports only the floors below it (from the bottom: host, ops, gpu, criu, runsc,
containers, swap, then sandbox/'s own modules). Read from the code's own imports (ast), so a new upward import fails here, not in review."""
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


# inside sandbox/, floors from the bottom: a module imports only from its own package and the floors
# below it. The top floor is sandbox/'s own modules (doctor.py, recover.py: recover undoes every kind,
# so it sits above every flow that registers one).
SANDBOX_FLOORS = ["host", "ops", "gpu", "criu", "runsc", "containers", "swap", ""]


def _sandbox_imports(path: Path) -> set[str]:
    """The sandbox packages PATH imports (sandbox.X.y -> X; `from sandbox import X` -> X; a module of
    sandbox/ itself -> "")."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "sandbox" else [f"sandbox.{a.name}" for a in node.names]
        for n in names:
            parts = n.split(".")
            if parts[0] == "sandbox" and len(parts) > 1:
                out.add(parts[1] if (REPO / "sandbox" / parts[1]).is_dir() else "")
    return out


def test_every_sandbox_package_has_a_floor() -> None:
    packages = {p.name for p in (REPO / "sandbox").iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(SANDBOX_FLOORS) - {""}


def test_sandbox_floors_point_down_only() -> None:
    wrong = []
    for path in sorted((REPO / "sandbox").rglob("*.py")):
        rel = path.relative_to(REPO / "sandbox")
        mine = rel.parts[0] if len(rel.parts) > 1 else ""
        below = set(SANDBOX_FLOORS[:SANDBOX_FLOORS.index(mine)])
        for pkg in sorted(_sandbox_imports(path) - {mine} - below):
            wrong.append(f"sandbox/{rel} ({mine or 'top'}) imports up: sandbox.{pkg or '<top module>'}")
    assert not wrong, "\n".join(wrong)


# mutual imports not yet cut (each names the other; lazily or for types); none may be added
KNOWN_MUTUAL: set[tuple[str, str]] = set()


def _module_imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The project modules NAME (at PATH) imports anywhere in it (lazy and TYPE_CHECKING imports too)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return (out & modules) - {name}


def test_no_two_modules_import_each_other() -> None:
    paths = {}
    for pkg in CODE_PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            paths[name] = path
    graph = {m: _module_imports(m, p, set(paths)) for m, p in paths.items()}
    mutual = {(a, b) for a in graph for b in graph[a] if a < b and a in graph[b]}
    assert mutual <= KNOWN_MUTUAL, sorted(mutual - KNOWN_MUTUAL)
