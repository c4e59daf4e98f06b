"""Imports point one way: every import in src/foundry against the layer tables of architecture.md
(the packages, and the subpackages of ``model``); and its package table names every module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "foundry"
DOC = ROOT / "docs" / "architecture.md"

_ROW = re.compile(r"^\|\s*(\d+)\s*\|([^|]*)\|([^|]*)\|\s*$")
_SUB_ROW = re.compile(r"^\|\s*(\d+)\s*\|([^|]*)\|\s*$")


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


def model_layer_table() -> dict[str, int]:
    """From the "Inside model" section: subpackage of ``model`` (``spec``, ``shard``, ...) ->
    layer; ``model`` itself (its ``__init__``) is below them all."""
    text = DOC.read_text()
    section = text[text.index("\n### Inside model\n") :]
    section = section[: section.index("\n## ", 1)]
    layer_of = {"model": -1}
    for line in section.splitlines():
        m = _SUB_ROW.match(line)
        if m is not None:
            for sub in re.findall(r"`model\.(\w+)`", m.group(2)):
                layer_of[sub] = int(m.group(1))
    return layer_of


def subpackage_of(module: str) -> str:
    """``foundry.model.infer.engines`` -> ``infer``; ``foundry.model`` itself -> ``model``."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "model"


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
    return (
        path.with_suffix(".py").exists()
        or path.is_dir()
        or path.with_suffix(".c").exists()
        or any(path.parent.glob(f"{path.name}.*.so"))
    )


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
    inside = model_layer_table()
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
            if dst == src == "model":
                bad += _model_arrow(inside, module, line, target)
                continue
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


def _model_arrow(inside: dict[str, int], module: str, line: int, target: str) -> list[str]:
    """The arrow module -> target inside ``model`` against its subpackage table: down only,
    never sideways (so ``train`` and ``infer`` never import each other)."""
    src, dst = subpackage_of(module), subpackage_of(target)
    if src == dst:
        return []
    for sub in (src, dst):
        if sub not in inside:
            return [f"{module}:{line}: model.{sub} is not in the table of model's subpackages"]
    if inside[dst] < inside[src]:
        return []
    way = "sideways" if inside[dst] == inside[src] else "up"
    return [
        f"{module}:{line}: model.{src} (layer {inside[src]}) imports {target} "
        f"(layer {inside[dst]}): an arrow {way}"
    ]


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
        "from foundry.model.nn import layers\n"  # own package, a lower subpackage: fine
        "def f() -> None:\n"
        "    from foundry.wire import fdtc\n"  # up, even inside a function
        "    from foundry import swarm\n"  # up
    )
    assert [m for _, m in imports_in("foundry.model.infer.probe", probe)] == [
        "foundry.model.nn.layers",
        "foundry.wire.fdtc",
        "foundry.swarm",
    ]
    found = violations({"foundry.model.infer.probe": (probe, False)})
    assert len(found) == 2 and all("an arrow up" in v for v in found)
    sideways = violations({"foundry.tp.probe": ("from foundry.swarm.policy import x\n", False)})
    assert len(sideways) == 1 and "an arrow sideways" in sideways[0]
    limited = violations({"foundry.wire.probe": ("from foundry.model.spec import config\n", False)})
    assert limited == [
        "foundry.wire.probe:1: wire may import only ['model.shard'] of model, "
        "not foundry.model.spec.config"
    ]
    allowed = "from foundry.model.shard.table import Gate\n"
    assert violations({"foundry.wire.probe": (allowed, False)}) == []


def test_model_subpackages_point_down_and_never_sideways() -> None:
    inside = model_layer_table()
    assert set(inside) >= {"spec", "nn", "kernels", "formats", "shard", "text", "train", "infer"}
    assert inside["spec"] < inside["nn"] < inside["kernels"] < inside["formats"] < inside["text"]
    assert inside["train"] == inside["infer"] > inside["text"]
    down = "from foundry.model.nn.layers import rope_forward\n"
    assert violations({"foundry.model.kernels.probe": (down, False)}) == []
    up = "from foundry.model.spec import arch\nfrom foundry.model.infer import engines\n"
    found = violations({"foundry.model.kernels.probe": (up, False)})
    assert len(found) == 1 and "an arrow up" in found[0] and "engines" in found[0]
    across = "def f() -> None:\n    from foundry.model.train import backend\n"
    found = violations({"foundry.model.infer.probe": (across, False)})
    assert len(found) == 1 and "an arrow sideways" in found[0]
    assert violations({"foundry.model.nope.probe": (down, False)}) == [
        "foundry.model.nope.probe:1: model.nope is not in the table of model's subpackages"
    ]
    on_disk = {p.name for p in (SRC / "model").iterdir() if (p / "__init__.py").exists()}
    on_disk |= {p.stem for p in (SRC / "model").glob("*.py") if p.stem != "__init__"}
    assert on_disk <= set(inside), f"not in the table: {sorted(on_disk - set(inside))}"


_NAMES = re.compile(r"`([\w.*]+)`")


def package_rows() -> list[tuple[set[str], set[str]]]:
    """From the "Package layout" table: per row, the modules its first column names
    (``foundry.wire.fdtc_lifecycle``, ``fdtc_connection``: the second in the first's package;
    ``foundry.commands.*``: every module of the package) and every other name the row
    quotes."""
    text = DOC.read_text()
    section = text[text.index("\n## Package layout\n") :]
    section = section[: section.index("\n## ", 1)]
    rows: list[tuple[set[str], set[str]]] = []
    for line in section.splitlines():
        cells = line.split("|")
        if len(cells) < 4 or not cells[1].strip().startswith("`"):
            continue
        named: set[str] = set()
        base = ""
        for name in _NAMES.findall(cells[1]):
            if name.startswith("foundry."):
                base = name.rpartition(".")[0]
                named.add(name)
            elif base:
                named.add(f"{base}.{name}")
        rows.append((named, set(_NAMES.findall("|".join(cells[2:])))))
    return rows


def unnamed_modules(modules: list[str], rows: list[tuple[set[str], set[str]]]) -> list[str]:
    """Modules no row names: in its first column, or there as its package (``P.*``, or ``P``
    with the module's own name quoted in the row)."""

    def named(module: str) -> bool:
        for first, rest in rows:
            if module in first:
                return True
            for name in first:
                if name.endswith(".*") and module.startswith(name[:-1]):
                    return True
                if module.startswith(name + ".") and module.rpartition(".")[2] in rest:
                    return True
        return False

    return [m for m in modules if not named(m)]


def test_the_package_table_names_every_module() -> None:
    modules = sorted(
        module_name(p)
        for p in SRC.rglob("*.py")
        if p.name != "__init__.py" and not module_name(p).startswith("foundry.api.")
    )
    assert len(modules) > 50
    missing = unnamed_modules(modules, package_rows())
    assert missing == [], f"not in the package table of {DOC.name}: {missing}"
    probe = [
        (
            {
                "foundry.wire.fdtc_lifecycle",
                "foundry.wire.fdtc_connection",
                "foundry.commands.*",
                "foundry.compression",
            },
            {"qsgd"},
        )
    ]
    assert unnamed_modules(
        [
            "foundry.wire.fdtc_connection",
            "foundry.commands.up",
            "foundry.compression.qsgd",
            "foundry.compression.topk",
            "foundry.wire.nope",
        ],
        probe,
    ) == ["foundry.compression.topk", "foundry.wire.nope"]


def import_cycles(sources: dict[str, tuple[str, bool]]) -> list[list[str]]:
    """Every circle of imports among ``sources`` (module -> (source text, is a package)), each
    once, from its smallest module name: function-local and TYPE_CHECKING imports count, as a
    circle they close is one a reader has to hold in mind all the same. A package's
    ``__init__`` is not followed into (``from foundry.tp import x`` names the module x)."""
    graph: dict[str, set[str]] = {}
    for module, (text, is_package) in sources.items():
        graph[module] = {
            target
            for _, target in imports_in(module, text, is_package=is_package)
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
        "foundry.tp.b": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from foundry.tp.c import C\n",
            False,
        ),
        "foundry.tp.c": ("def f() -> None:\n    from foundry.tp.a import A\n", False),
        "foundry.tp.d": ("from foundry.tp.a import A\n", False),
    }
    assert import_cycles(probe) == [["foundry.tp.a", "foundry.tp.b", "foundry.tp.c"]]
    probe["foundry.tp.c"] = ("import os\n", False)
    assert import_cycles(probe) == []
