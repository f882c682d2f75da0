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
    tops: set[str] = set()
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


# storage/'s packages along the data's way, from the bottom: a module imports only from its own package and
# the packages below it. storage/api.py, the public face, sits on top of them all.
STORAGE_FLOORS = ["base", "fs", "codecs", "format", "gpu", "repo", "pipeline", "tiers", "archive", "remote",
                  "maintenance"]
FACE = "storage.api"


def _storage_modules_imported(path: Path) -> set[str]:
    """The dotted storage modules (or packages) PATH imports, lazily or not."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "storage")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "storage":
            out.update([node.module] if node.module != "storage" else [f"storage.{a.name}" for a in node.names])
    return out


def test_storage_is_packages_and_one_face() -> None:
    top = {p.name for p in (REPO / "storage").iterdir() if p.suffix == ".py"}
    assert top == {"__init__.py", "api.py"}, sorted(top)
    packages = {p.name for p in (REPO / "storage").iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(STORAGE_FLOORS) | {"native"}


def test_code_outside_storage_imports_only_its_face() -> None:
    wrong = []
    for pkg in ALLOWED:
        if pkg == "storage":
            continue
        for path in sorted((REPO / pkg).rglob("*.py")):
            for mod in sorted(_storage_modules_imported(path) - {FACE}):
                wrong.append(f"{path.relative_to(REPO)} imports {mod} (only {FACE} is public)")
    assert not wrong, "\n".join(wrong)


def test_storage_packages_point_down_only() -> None:
    wrong = []
    for path in sorted((REPO / "storage").rglob("*.py")):
        rel = path.relative_to(REPO / "storage")
        if len(rel.parts) == 1:
            continue  # __init__ (imports nothing) and api (the face, on top)
        mine = rel.parts[0]
        below = {"native"} | (set(STORAGE_FLOORS[:STORAGE_FLOORS.index(mine)]) if mine in STORAGE_FLOORS else set())
        for mod in sorted(_storage_modules_imported(path)):
            pkg = mod.split(".")[1] if mod.count(".") else ""
            if pkg != mine and pkg not in below:
                wrong.append(f"storage/{rel} ({mine}) imports up or sideways: {mod}")
    assert not wrong, "\n".join(wrong)


# inside sandbox/, floors from the bottom: a module imports only from its own package and the floors
# below it. The top floor is sandbox/'s own modules (doctor.py, recover.py: recover undoes every kind,
# so it sits above every flow that registers one).
SANDBOX_FLOORS = ["host", "ops", "gpu", "criu", "runsc", "containers", "swap", ""]


def _sandbox_imports(path: Path) -> set[str]:
    """The sandbox packages PATH imports (sandbox.X.y -> X; `from sandbox import X` -> X; a module of
    sandbox/ itself -> "")."""
    out: set[str] = set()
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


# files a user copies next to their own program: the standard library (and the named third-party
# packages) only, never a package of the project
STANDALONE = {"criu_hooks/workload_helper.py": {"torch"}}


def test_standalone_files_import_no_project_package() -> None:
    import sys
    wrong = []
    for rel, third_party in STANDALONE.items():
        path = REPO / rel
        for top in sorted(_imports(path)):
            if top not in sys.stdlib_module_names and top not in third_party:
                wrong.append(f"{rel} imports {top}: it must run copied away from gpusnap (stdlib + {third_party})")
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree)):
            wrong.append(f"{rel} has a relative import")
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------------------ tests/
TESTS = REPO / "tests"


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "data" not in p.relative_to(TESTS).parts[:-1])


def test_no_test_file_imports_another() -> None:
    """What test modules share lives in tests/conftest.py or tests/support/: a test module that imports
    another runs (and collects) that module's tests' module-level code and ties the two files' layout."""
    test_modules = {p.stem for p in TESTS.rglob("test_*.py")}
    assert "test_layers" in test_modules, "the test modules were not found"
    bad = []
    for path in _test_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module or ''}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                if test_modules & set(name.split(".")):
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno}: imports {name}")
    assert bad == [], "\n".join(bad)


def test_requirements_and_markers_are_defined_once() -> None:
    """need_root/need_criu/need_runsc are tests/conftest.py's fixtures (tests/support/ holds the functions they
    call); no test module defines its own, and pytest markers are declared only in pyproject.toml."""
    bad = []
    for path in _test_files():
        if path.name == "conftest.py" and path.parent == TESTS:
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") in ("need_root", "need_criu", "need_runsc"):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: defines {node.name}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "addinivalue_line" and node.args
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value == "markers"):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: declares a marker")
    for name in ("pytest.ini", "tox.ini", "setup.cfg", "tests/pytest.ini"):
        if (REPO / name).exists():
            bad.append(f"{name}: pytest configuration outside pyproject.toml")
    assert bad == [], "\n".join(bad)
