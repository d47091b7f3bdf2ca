"""Layers without circles: the package's imports run one way, read from its source with ``ast``.

Every ``import``/``from`` of ``reliable_jobs.*`` is a graph edge, with its kind: ``module``
(run at import time), ``type`` (under ``if TYPE_CHECKING:``) or ``function`` (deferred inside a
function). A circle among module and type edges means no module of it can be read, tested or moved
alone; an import of a higher layer means the lower one cannot be understood without the higher.
KNOWN holds today's exceptions, each with its reason; an entry that no longer occurs fails the test
too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "reliable_jobs"

#: Module prefix -> layer rank; the longest matching prefix wins. A module may import its own
#: rank or lower, never higher.
LAYERS: dict[str, int] = {
    # 0 core: pure helpers with no Redis client or ORM of their own.
    "reliable_jobs": 0, "reliable_jobs.compat": 0, "reliable_jobs.exceptions": 0,
    "reliable_jobs.keys": 0, "reliable_jobs.jobids": 0, "reliable_jobs.redaction": 0,
    "reliable_jobs.faults": 0, "reliable_jobs.lifetime": 0, "reliable_jobs.signalwatch": 0,
    "reliable_jobs.retry": 0, "reliable_jobs.payload": 0, "reliable_jobs.conf": 0,
    "reliable_jobs.scripts": 0, "reliable_jobs.reachability": 0, "reliable_jobs.cancellation": 0,
    "reliable_jobs.periodic.timetable": 0, "reliable_jobs.periodic.declared": 0,
    "reliable_jobs.periodic": 0, "reliable_jobs.flow": 0, "reliable_jobs.callargs": 0,
    "reliable_jobs.graphlayers": 0,
    # 1 broker: the Redis side, and what only observes it.
    "reliable_jobs.broker": 1, "reliable_jobs.handoff": 1, "reliable_jobs.telemetry": 1,
    "reliable_jobs.tracing": 1, "reliable_jobs.parts": 1,
    # 2 mirror: the PostgreSQL side and the task registry.
    "reliable_jobs.models": 2, "reliable_jobs.mirror": 2, "reliable_jobs.results": 2,
    "reliable_jobs.tasks": 2, "reliable_jobs.unique": 2, "reliable_jobs.taskstats": 2,
    "reliable_jobs.logformat": 2, "reliable_jobs.fairness": 2, "reliable_jobs.canvas": 2,
    "reliable_jobs.debounce": 2,
    # 3 services: what joins broker and mirror (the backend, enqueue, sweeps, schedules).
    "reliable_jobs.backend": 3, "reliable_jobs.newjobs": 3, "reliable_jobs.sweep": 3,
    "reliable_jobs.staff": 3, "reliable_jobs.retention": 3, "reliable_jobs.periodic.scheduler": 3,
    "reliable_jobs.isolation": 3, "reliable_jobs.supervisor": 3, "reliable_jobs.backendchecks": 3,
    "reliable_jobs.workflows": 3, "reliable_jobs.pausing": 3,
    # 4 worker: the running process.
    "reliable_jobs.worker": 4, "reliable_jobs._child_boot": 4,
    # 5 web: admin, dashboard, views, health and metrics endpoints.
    "reliable_jobs.admin": 5, "reliable_jobs.adminparts": 5, "reliable_jobs.changelist": 5,
    "reliable_jobs.dashboard": 5, "reliable_jobs.flowstats": 5,
    "reliable_jobs.taskpage": 5, "reliable_jobs.schedule_admin": 5,
    "reliable_jobs.workflow_admin": 5, "reliable_jobs.workflow_svg": 5,
    "reliable_jobs.health": 5,
    "reliable_jobs.metrics": 5, "reliable_jobs.urls": 5, "reliable_jobs.queuepause": 5,
    # 6 ops: checks, management commands, app config, the verification app.
    "reliable_jobs.checks": 6, "reliable_jobs.management": 6, "reliable_jobs.apps": 6,
    "reliable_jobs.contrib": 6,
}

#: Circles (sorted member tuples) and upward imports (importer, imported) still allowed, each
#: with why (none now). An entry that no longer occurs fails the test, so the list only shrinks.
KNOWN: dict[object, str] = {}

Edge = tuple[str, str, str]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def exists(module: str) -> bool:
    base = PACKAGE.parent / module.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def edges() -> set[Edge]:
    """Every import of the package by the package, with its kind."""
    found: set[Edge] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        importer = module_name(path)
        package = importer.split(".") if path.name == "__init__.py" else importer.split(".")[:-1]

        def walk(node: ast.AST, kind: str, importer: str = importer,
                 package: list[str] = package) -> None:
            for child in ast.iter_child_nodes(node):
                here = kind
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    here = "type"
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    here = "function" if kind == "module" else kind
                if isinstance(child, ast.Import):
                    found.update((importer, alias.name, here) for alias in child.names
                                 if alias.name.split(".")[0] == "reliable_jobs")
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        base = package[:len(package) - (child.level - 1)]
                        target = ".".join(base + ([child.module] if child.module else []))
                    else:
                        target = child.module or ""
                    if target.split(".")[0] == "reliable_jobs":
                        for alias in child.names:
                            sub = f"{target}.{alias.name}"
                            found.add((importer, sub if exists(sub) else target, here))
                walk(child, here)

        walk(ast.parse(path.read_text()), "module")
    return {edge for edge in found if edge[0] != edge[1]}


def circles(graph: set[Edge]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    succ: dict[str, set[str]] = {}
    for importer, imported, kind in graph:
        if kind != "function":
            succ.setdefault(importer, set()).add(imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    result: list[tuple[str, ...]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in succ.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                top = stack.pop()
                members.append(top)
                if top == node:
                    break
            if len(members) > 1:
                result.append(tuple(sorted(members)))

    for node in sorted(succ):
        if node not in index:
            visit(node)
    return sorted(result)


def rank(module: str) -> int:
    best = max((prefix for prefix in LAYERS
                if module == prefix or module.startswith(prefix + ".")), key=len)
    return LAYERS[best]


def upward(graph: set[Edge]) -> set[tuple[str, str]]:
    return {(importer, imported) for importer, imported, _ in graph
            if rank(imported) > rank(importer)}


def test_no_new_circle_and_no_upward_import() -> None:
    # Given the package's import graph
    graph = edges()
    # When its circles and upward imports are found
    found: set[object] = set(circles(graph)) | upward(graph)
    # Then each is a known one, and each known one still occurs
    new = sorted(map(str, found - set(KNOWN)))
    gone = sorted(map(str, set(KNOWN) - found))
    every = "\n".join(map(str, circles(graph)))
    assert not new, (f"new circles or upward imports:\n{chr(10).join(new)}\n"
                     f"the graph's circles:\n{every}")
    assert not gone, "fixed, so remove from KNOWN:\n" + "\n".join(gone)


def test_every_module_has_a_layer() -> None:
    # Given every module of the package, Then each falls under a prefix of LAYERS
    modules = {module_name(path) for path in PACKAGE.rglob("*.py")
               if "migrations" not in path.parts}
    unplaced = sorted(module for module in modules
                      if module != "reliable_jobs" and module not in LAYERS
                      and not any(module.startswith(prefix + ".") for prefix in LAYERS
                                  if prefix != "reliable_jobs"))
    assert not unplaced, f"give these a layer in LAYERS: {unplaced}"


def test_the_graph_sees_every_kind_of_import() -> None:
    # Given the graph, Then it holds a type-only, a deferred and a relative import it must see
    graph = edges()
    assert ("reliable_jobs.health", "reliable_jobs.backend", "type") in graph
    assert ("reliable_jobs.backend", "reliable_jobs.backendchecks", "function") in graph
    assert ("reliable_jobs.worker.leases", "reliable_jobs.logformat", "module") in graph
    # And a loop made of a type-only import is a circle, a deferred one is not
    assert circles({("a", "b", "module"), ("b", "a", "type")}) == [("a", "b")]
    assert circles({("a", "b", "module"), ("b", "a", "function")}) == []


#: The backend validates, enqueues and reads results; what it grows beyond that belongs in a
#: module of its own (``newjobs``, ``parts``, ``backendchecks``), so it stays readable at once.
BACKEND_MAX_LINES = 300


def test_the_backend_stays_short() -> None:
    # Given backend.py, Then it is at most BACKEND_MAX_LINES lines long
    lines = len((PACKAGE / "backend.py").read_text().splitlines())
    assert lines <= BACKEND_MAX_LINES, (
        f"backend.py has {lines} lines (at most {BACKEND_MAX_LINES}): move a helper out of it "
        "(into newjobs.py, parts.py or backendchecks.py) rather than cramming lines")
