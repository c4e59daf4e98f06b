"""Imports point one way: every import in src/foundry against the layer table of architecture.md."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "foundry"
DOC = ROOT / "docs" / "architecture.md"

_ROW = re.compile(r"^\|\s*(\d+)\s*\|([^|]*)\|([^|]*)\|\s*$")


def layer_table() -> tuple[dict[str, int], dict[str, dict[str, set[str]]]]:
    """From the "Layers" section: package -> layer, and package -> {lower package: the only
    modules of it the package may import}."""
    text = DOC.read_text()
    section = text[text.index("\n## Layers\n") :]
    section = section[: section.index("\n## ", 1)]
    layer_of: dict[str, int] = {}
    only: dict[str, dict[str, set[str]]] = {}
    for line in section.splitlines():
        m = _ROW.match(line)
        if m is None:
            continue
        packages = re.findall(r"`([\w.]+)`", m.group(2))
        limits: dict[str, set[str]] = {}
        for module in re.findall(r"`([\w.]+)`", m.group(3)):
            pkg, _, _ = module.partition(".")
            limits.setdefault(pkg, set()).add(module)
        for pkg in packages:
            layer_of[pkg] = int(m.group(1))
            only[pkg] = limits
    return layer_of, only


def package_of(module: str) -> str:
    """``foundry.wire.fdtc`` -> ``wire``; the top-level package itself -> ``foundry``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "foundry"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    """A Python module, a package, or a C extension (built in place, or its source)."""
    path = SRC.parent / dotted.replace(".", "/")
    return (path.with_suffix(".py").exists() or path.is_dir() or path.with_suffix(".c").exists()
            or any(path.parent.glob(f"{path.name}.*.so")))


def imports_in(module: str, text: str, *, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every foundry module that ``module``'s source imports, wherever the
    import sits (function-local and TYPE_CHECKING imports count too)."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # ``from foundry import cli`` imports foundry.cli
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if _is_module(sub) else base))
    return [(line, mod) for line, mod in found if mod == "foundry" or mod.startswith("foundry.")]


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Arrows against the table in ``sources`` (module -> (source text, is a package))."""
    layer_of, only = layer_table()
    bad: list[str] = []
    for module, (text, is_package) in sorted(sources.items()):
        src = package_of(module)
        if src == "api":  # generated from proto/; imports only grpc and protobuf
            continue
        if src not in layer_of:
            bad.append(f"{module}: package {src!r} is not in the layer table of {DOC.name}")
            continue
        for line, target in imports_in(module, text, is_package=is_package):
            dst = package_of(target)
            if dst == src:
                continue
            if dst not in layer_of:
                bad.append(f"{module}:{line}: {target} is in no layer")
            elif layer_of[dst] >= layer_of[src]:
                way = "sideways" if layer_of[dst] == layer_of[src] else "up"
                bad.append(
                    f"{module}:{line}: {src} (layer {layer_of[src]}) imports {target} "
                    f"(layer {layer_of[dst]}): an arrow {way}"
                )
            elif dst in only[src] and not any(
                target == m or target.startswith(m + ".")
                for m in (f"foundry.{m}" for m in only[src][dst])
            ):
                bad.append(
                    f"{module}:{line}: {src} may import only {sorted(only[src][dst])} of "
                    f"{dst}, not {target}"
                )
    return bad


def tree_sources() -> dict[str, tuple[str, bool]]:
    return {
        module_name(path): (path.read_text(), path.name == "__init__.py")
        for path in SRC.rglob("*.py")
    }


def test_the_layer_table_names_every_package() -> None:
    layer_of, _ = layer_table()
    on_disk = {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"}
    on_disk |= {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert on_disk <= set(layer_of), f"not in the layer table: {sorted(on_disk - set(layer_of))}"
    assert layer_of["model"] < layer_of["wire"] < layer_of["transport"] < layer_of["swarm"]


def test_imports_point_down_the_layers() -> None:
    sources = tree_sources()
    assert len(sources) > 50
    assert violations(sources) == []


def test_the_walk_catches_arrows_against_the_table() -> None:
    probe = (
        "from foundry.model import layers\n"  # own package: fine
        "def f() -> None:\n"
        "    from foundry.wire import fdtc\n"  # up, even inside a function
        "    from foundry import swarm\n"  # up
    )
    assert [m for _, m in imports_in("foundry.model.probe", probe)] == [
        "foundry.model.layers", "foundry.wire.fdtc", "foundry.swarm",
    ]
    found = violations({"foundry.model.probe": (probe, False)})
    assert len(found) == 2 and all("an arrow up" in v for v in found)
    sideways = violations({"foundry.tp.probe": ("from foundry.swarm.policy import x\n", False)})
    assert len(sideways) == 1 and "an arrow sideways" in sideways[0]
    limited = violations({"foundry.wire.probe": ("from foundry.model.config import C\n", False)})
    assert limited == [
        "foundry.wire.probe:1: wire may import only ['model.tp_split'] of model, "
        "not foundry.model.config"
    ]
    allowed = "from foundry.model.tp_split import Gate\n"
    assert violations({"foundry.wire.probe": (allowed, False)}) == []


def import_cycles(sources: dict[str, tuple[str, bool]]) -> list[list[str]]:
    """Every circle of imports among ``sources`` (module -> (source text, is a package)), each
    once, from its smallest module name: function-local and TYPE_CHECKING imports count, as a
    circle they close is one a reader has to hold in mind all the same. A package's
    ``__init__`` is not followed into (``from foundry.tp import x`` names the module x)."""
    graph: dict[str, set[str]] = {}
    for module, (text, is_package) in sources.items():
        graph[module] = {
            target for _, target in imports_in(module, text, is_package=is_package)
            if target in sources and target != module
        }
    cycles: set[tuple[str, ...]] = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt == start:
                cycles.add(tuple(path))
            elif nxt > start and nxt not in path:  # each circle from its smallest member only
                walk(start, nxt, [*path, nxt])

    for module in sorted(graph):
        walk(module, module, [module])
    return [list(c) for c in sorted(cycles)]


def test_no_import_circles() -> None:
    sources = tree_sources()
    found = import_cycles(sources)
    assert found == [], "import circles: " + "; ".join(" -> ".join([*c, c[0]]) for c in found)


def test_the_circle_search_finds_a_circle_through_type_checking() -> None:
    probe = {
        "foundry.tp.a": ("from foundry.tp.b import B\n", False),
        "foundry.tp.b": ("from typing import TYPE_CHECKING\n"
                         "if TYPE_CHECKING:\n    from foundry.tp.c import C\n", False),
        "foundry.tp.c": ("def f() -> None:\n    from foundry.tp.a import A\n", False),
        "foundry.tp.d": ("from foundry.tp.a import A\n", False),
    }
    assert import_cycles(probe) == [["foundry.tp.a", "foundry.tp.b", "foundry.tp.c"]]
    probe["foundry.tp.c"] = ("import os\n", False)
    assert import_cycles(probe) == []
