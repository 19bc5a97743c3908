"""The import graph of planner/ and workers/: no circles, and each layer imports only the layers
below it, except the arrows listed in ``UPWARD`` (the README's "Architecture" section names the
layers and says why each exception stands).

Every import counts wherever it stands (a lazy import inside a function is still a dependency),
read from the source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Lowest first. A module belongs to the first layer with a prefix that matches it (a prefix is a
#: module or a package: "planner.memory" matches planner.memory and planner.memory.step).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("planner.errors", "planner.registry", "planner.units", "planner.text", "planner.files", "planner.lazy", "planner.memo", "planner.modelspec",
                    "planner.config", "planner.limits", "planner.results", "planner.tradeoffs",
                    "planner.calibration.values", "planner.calibration.fit", "planner.uncertainty", "planner.optim",
                    "planner.sharding", "planner.request")),
    ("facts", ("planner.catalog", "planner.gpus", "planner.host", "planner.detect", "planner.pricing",
               "planner.transformers_versions")),
    ("core", ("planner.memory", "planner.kernels", "planner.moe_loop", "planner.throughput")),
    ("search", ("planner.search", "planner.ranking", "planner.defaults", "planner.advice")),
    ("store", ("planner.store", "planner.calibration")),
    ("use cases", ("planner.planning", "planner.estimation", "planner.answers", "planner.usecases", "planner.dataset", "planner.solve", "planner.rent", "planner.emit", "planner.plot",
                   "planner.verify", "planner.check", "workers")),
    ("surfaces", ("planner.cli", "planner.service", "planner.__main__", "oom_planner")),
)

#: The arrows that run from a lower layer up to a higher one, each with its reason.
UPWARD = {
    # TrainConfig validates its PYTORCH_CUDA_ALLOC_CONF string where it is made (keyword-only
    # configs validated where they are made); the parser belongs to the allocator model it feeds.
    ("planner.config", "planner.memory.allocator"),
}


def _modules() -> dict[str, Path]:
    mods = {}
    for top in ("planner", "workers", "oom_planner"):
        for f in (ROOT / top).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


def _graph() -> dict[str, set[str]]:
    mods = _modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import mod` depends on pkg.mod alone; `from pkg import name` on pkg
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for name in names:
                target = owner(name)
                if target and target != m:
                    graph[m].add(target)
    return graph


def layer_of(module: str) -> int | None:
    """The index in ``LAYERS`` of ``module``'s layer; None for the package root ``planner``
    (its __init__ holds the version only and imports nothing of the project)."""
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in _graph() if m != "planner" and layer_of(m) is None)
    assert not unplaced, f"put these modules in a layer of LAYERS (and the README's Architecture section): {unplaced}"


def test_the_package_root_imports_nothing_of_the_project():
    assert _graph()["planner"] == set()


def test_no_import_circles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
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
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_layers_import_only_downward_except_the_listed_arrows():
    graph = _graph()
    upward = {(m, t) for m, targets in graph.items() for t in targets
              if layer_of(m) is not None and layer_of(t) is not None and layer_of(t) > layer_of(m)}
    assert upward <= UPWARD, f"arrows from a lower layer up to a higher one: {sorted(upward - UPWARD)}"
    assert len(UPWARD) <= 2
    # every listed exception still exists (a stale entry would hide a new one)
    assert UPWARD <= upward, f"no longer needed, remove from UPWARD: {sorted(UPWARD - upward)}"


def test_planning_layers_do_not_import_the_surfaces():
    """The library below the CLI and the service never imports them (the service imports nothing
    from the CLI either: a thin CLI and a thin service over one library)."""
    graph = _graph()
    surfaces = len(LAYERS) - 1
    below = [(m, t) for m, targets in graph.items() for t in targets
             if layer_of(m) is not None and layer_of(m) < surfaces and layer_of(t) == surfaces]
    assert not below, below
    service_to_cli = [(m, t) for m, targets in graph.items() for t in targets
                      if m.startswith("planner.service") and t.startswith("planner.cli")]
    assert not service_to_cli, service_to_cli
