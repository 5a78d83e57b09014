"""The house rules a reader relies on (docs/structure.md), read off the source: services/ holds packages only,
every package has its line in docs/structure.md, no module imports one that imports it back (at any depth, lazy
and type-only imports included), and the coordinator and render import no torch at module level."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("services", "coordinator")


def _modules() -> dict[str, Path]:
    found = {}
    for top in SOURCES:
        for path in (ROOT / top).rglob("*.py"):
            if "/rpc/v1/" in path.as_posix():
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _targets(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every project module `name` imports, anywhere in the file (functions and TYPE_CHECKING blocks too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            # `from pkg import sub` imports the submodule; `from pkg import name` imports the package
            candidates = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in modules:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                out.add(candidate)
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    modules = _modules()
    graph = {name: _targets(name, path, modules) for name, path in modules.items()}
    assert _circles(graph) == []


def test_services_holds_packages_only_and_each_has_its_line_in_structure_md():
    loose = sorted(p.name for p in (ROOT / "services").glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"modules loose in services/: {loose}: give each a package"
    documented = (ROOT / "docs" / "structure.md").read_text(encoding="utf-8")
    packages = sorted(p.relative_to(ROOT).as_posix() for top in SOURCES for p in (ROOT / top).rglob("__init__.py")
                      if "/rpc/v1" not in p.as_posix())
    folders = [p.removesuffix("__init__.py") for p in packages]
    missing = [folder for folder in folders if f"`{folder}`" not in documented]
    assert missing == [], f"packages without a line in docs/structure.md: {missing}"


def test_the_coordinator_and_render_import_no_torch_at_module_level():
    offenders = []
    for top in ("coordinator", "services/render"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:   # module level only
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in ("torch",
                                                                                                     "transformers")]
    assert offenders == []


def test_no_module_reaches_400_lines():
    """STYLE.md: one concept per module, split before 400 lines (generated stubs aside)."""
    long = {name: n for name, path in _modules().items()
            if (n := path.read_text(encoding="utf-8").count("\n")) >= 400}
    assert long == {}
