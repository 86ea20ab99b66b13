"""The package's layers: which modules may import which. Every import counts, at module level or inside a function
(and under ``TYPE_CHECKING``): a lower layer never imports a higher one, and no modules import each other in a
cycle, however long."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "diloco"

# lowest first; a module may import its own layer and those below it
LAYERS: list[tuple[str, ...]] = [
    ("diloco.errors", "diloco.config", "diloco.procs", "diloco.console", "diloco.corpus", "diloco.hub",
     "diloco.distenv"),  # fmt: skip
    ("diloco.galaxy_moment", "diloco.model", "diloco.lora", "diloco.parallel", "diloco.data", "diloco.checkpoint",
     "diloco.schedule", "diloco.shards", "diloco.fresh", "diloco.quantized", "diloco.weight_files",
     "diloco.metrics", "diloco.plot", "diloco.profiling"),  # the inner training's parts  # fmt: skip
    ("diloco.export",),  # final/: the model, gathered a tensor at a time
    ("diloco.swarm",),  # the transport: records, rounds, the peer
    ("diloco.outer",),  # DiLoCo itself
    ("diloco.train", "diloco.preflight", "diloco.launch", "diloco.slurm"),
    ("diloco.bench",),
    ("diloco.cli", "diloco.__main__", "diloco.train.__main__"),  # the command line and the entry points
]


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the package that `name` imports anywhere in its source."""

    def resolve(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            if not base.startswith("diloco"):
                continue
            for alias in node.names:  # `from diloco.swarm import tcp` imports the module diloco.swarm.tcp
                found.add(resolve(f"{base}.{alias.name}") if f"{base}.{alias.name}" in known else resolve(base))
        elif isinstance(node, ast.Import):
            found.update(resolve(alias.name) for alias in node.names if alias.name.startswith("diloco"))
    return {target for target in found if target and target != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layer(name: str) -> int:
    """The layer of the most specific entry of LAYERS that holds `name`."""
    holders = [(len(m), index) for index, members in enumerate(LAYERS) for m in members
               if name == m or name.startswith(m + ".")]  # fmt: skip
    assert holders, f"{name} is in no layer of this test: add it to LAYERS"
    return max(holders)[1]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_module_of_the_package_imports_itself_back_through_others() -> None:
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle_of_three() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_lower_layer_never_imports_a_higher_one() -> None:
    upward = [f"{source} -> {target}" for source, targets in graph().items() for target in targets
              if layer(target) > layer(source)]  # fmt: skip
    assert upward == []


@pytest.mark.parametrize("lower, higher", [("diloco.swarm", "diloco.outer"), ("diloco.swarm.records", "diloco.swarm.rounds"),
                                           ("diloco.swarm.records", "diloco.swarm.peer")])  # fmt: skip
def test_the_transport_never_imports_the_outer_loop_nor_records_the_rounds(lower: str, higher: str) -> None:
    reached = [f"{source} -> {target}" for source, targets in graph().items() if source.startswith(lower)
               for target in targets if target.startswith(higher)]  # fmt: skip
    assert reached == []


def test_the_import_walk_sees_imports_inside_functions() -> None:
    edges = graph()
    assert "diloco.swarm.start" in edges["diloco.outer.build"]  # imported inside `_join` only
    assert "diloco.train.trainer" in edges["diloco.cli.app"]  # imported inside `train` only
