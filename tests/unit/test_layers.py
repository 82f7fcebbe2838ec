"""Imports point down the layers only, and no module imports itself back (docs/architecture.md).

    composition root   splitserve/                                      may import anything
    services           scheduler_svc/ outside core/ | worker_svc/link.py, main.py | frontend_svc/
    cores              scheduler_svc/core/          | the rest of worker_svc/
    wire types         common/

A service imports its own core and the wire types, never another service (frontend_svc and
scheduler_svc meet in the composition root, splitserve/embedded.py or over the FrontendLink);
the two cores import the wire types only, never each other. The scheduler service reaches no
client-side library (HTTP framework, tokenizer, templates): everything a client touches is
frontend_svc's. splitserve/loadgen/ (the `splitserve bench serve` client)
is a client of the wire types. Neither core reaches gRPC, and the scheduler core no torch, through
anything it imports. Every import counts, at any depth: module level, inside functions (lazy
imports) and under TYPE_CHECKING (a type named there is still a dependency).

Each file is read with ast, not imported, so the test needs neither torch nor grpc.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the folders the graph covers (frontend_svc/: the scheduler-HA front-end, where it exists)
SOURCES = ("common", "scheduler_svc", "worker_svc", "frontend_svc", "splitserve")

# module prefix -> component; the longest matching prefix decides
COMPONENTS = {
    "common": "wire types",
    "scheduler_svc.core": "scheduler core",
    "worker_svc": "worker model",
    "scheduler_svc": "scheduler service",
    "worker_svc.link": "worker service",
    "worker_svc.main": "worker service",
    "frontend_svc": "front-end service",
    "splitserve.loadgen": "benchmark client",
    "splitserve": "composition root",
}
# what each component may import besides itself
MAY_IMPORT = {
    "wire types": set(),
    "scheduler core": {"wire types"},
    "worker model": {"wire types"},
    "scheduler service": {"wire types", "scheduler core"},
    "worker service": {"wire types", "worker model"},
    "front-end service": {"wire types"},
    "benchmark client": {"wire types"},
    "composition root": set(COMPONENTS.values()),
}
# third-party packages a component must not reach, directly or through what it imports
GRPC = ("grpc", "grpc_health", "grpc_reflection", "grpc_tools")
CLIENT_SIDE = ("fastapi", "starlette", "uvicorn", "tokenizers", "transformers", "jinja2")
NEVER_REACHES = {
    "scheduler core": (*GRPC, "torch", *CLIENT_SIDE),
    "scheduler service": ("torch", *CLIENT_SIDE),
    "worker model": GRPC,
}


@dataclass(slots=True)
class Graph:
    files: dict[str, Path]  # module -> file
    edges: dict[str, list[tuple[str, int]]] = field(default_factory=dict)  # -> (module, line)
    external: dict[str, list[tuple[str, int]]] = field(default_factory=dict)  # -> (top, line)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Dotted names an import statement loads: `from a import b` names a.b (a submodule, or a
    name the caller resolves to a)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: from the importing module's package, level - 1 levels up
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = package[: len(package) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [f"{source}.{alias.name}" for alias in node.names]


def _resolve(name: str, files: dict[str, Path]) -> str | None:
    """The project module a dotted name lives in (its longest importable prefix), or None."""
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def import_graph() -> Graph:
    files = {
        _module_name(path): path
        for source in SOURCES
        if (ROOT / source).is_dir()
        for path in sorted((ROOT / source).rglob("*.py"))
    }
    graph = Graph(files)
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        is_package = path.name == "__init__.py"
        edges: set[tuple[str, int]] = set()
        external: set[tuple[str, int]] = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _imported_names(node, module, is_package):
                target = _resolve(name, files)
                if target is None:
                    external.add((name.split(".")[0], node.lineno))
                elif target != module:
                    edges.add((target, node.lineno))
        graph.edges[module] = sorted(edges, key=lambda e: (e[1], e[0]))
        graph.external[module] = sorted(external, key=lambda e: (e[1], e[0]))
    return graph


def component(module: str) -> str:
    matches = [p for p in COMPONENTS if module == p or module.startswith(p + ".")]
    assert matches, f"{module} is in no layer: add it to COMPONENTS"
    return COMPONENTS[max(matches, key=len)]


def _where(graph: Graph, module: str, line: int) -> str:
    return f"{graph.files[module].relative_to(ROOT)}:{line}"


def test_imports_point_down_the_layers_only():
    graph = import_graph()
    assert {"scheduler_svc.core.scheduler", "worker_svc.model_runner", "splitserve.cli"} <= set(
        graph.files
    ), "the graph misses the project's modules: is ROOT right?"
    offending = []
    for module, edges in graph.edges.items():
        src = component(module)
        for target, line in edges:
            dst = component(target)
            if dst != src and dst not in MAY_IMPORT[src]:
                offending.append(
                    f"{_where(graph, module, line)}: {module} ({src}) imports {target} ({dst})"
                )
    assert not offending, "imports against the layers:\n" + "\n".join(offending)


def _cycles(edges: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(edges[succ])))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        scc.append(member)
                        if member == node:
                            break
                    if len(scc) > 1:
                        found.append(sorted(scc))
    return found


def test_no_module_imports_itself_back_through_others():
    graph = import_graph()
    targets = {m: sorted({t for t, _ in edges}) for m, edges in graph.edges.items()}
    report = []
    for scc in _cycles(targets):
        members = set(scc)
        report.append("cycle: " + ", ".join(scc))
        report += [
            f"  {_where(graph, m, line)}: {m} imports {t}"
            for m in scc
            for t, line in graph.edges[m]
            if t in members
        ]
    assert not report, "\n".join(report)


def test_the_cores_reach_no_grpc_and_the_scheduler_core_no_torch():
    """Through every project module a core module loads (its parent packages' __init__ too),
    no import of a forbidden package. Each such import is reported once, with one path to it."""
    graph = import_graph()
    offending: dict[tuple[str, int, str], str] = {}
    for module in graph.files:
        forbidden = NEVER_REACHES.get(component(module), ())
        if not forbidden:
            continue
        via = {module: module}  # reached module -> the module that imported it
        queue = [module]
        while queue:
            current = queue.pop()
            parents = [current.rsplit(".", i)[0] for i in range(1, current.count(".") + 1)]
            for target in [t for t, _ in graph.edges[current]] + parents:
                if target in graph.files and target not in via:
                    via[target] = current
                    queue.append(target)
            for top, line in graph.external[current]:
                if top in forbidden and (current, line, top) not in offending:
                    chain = [current]
                    while chain[-1] != module:
                        chain.append(via[chain[-1]])
                    offending[current, line, top] = (
                        f"{_where(graph, current, line)}: imports {top}, which "
                        f"{component(module)} must not reach: {' <- '.join(chain)}"
                    )
    assert not offending, "\n".join(offending.values())
