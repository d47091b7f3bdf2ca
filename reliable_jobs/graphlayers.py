"""Layers of a dependency graph: each job's column, and an order within each column.

Pure functions, no ORM: the workflow admin draws a workflow with them
(column = longest path from a job that waits for nothing), and
``workflows.cancel_rest`` cancels the deepest jobs first with them, so no
cancel releases a job that the next one would have to catch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence


def depths(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> dict[str, int]:
    """Each node's layer: 0 for a node that waits for none of ``nodes``, else one more
    than its deepest upstream.

    ``edges`` are (dependent, upstream) pairs; an edge naming a node outside
    ``nodes`` (an ``after=`` job of no workflow, a pruned row) is ignored.
    Linear in nodes + edges (Kahn's order). A workflow has no cycle; should
    rows ever form one, its nodes are put one layer past the others rather
    than looping.
    """
    known = list(dict.fromkeys(nodes))
    members = set(known)
    downstream: dict[str, list[str]] = defaultdict(list)
    waits: dict[str, int] = dict.fromkeys(known, 0)
    for dependent, upstream in dict.fromkeys(edges):
        if dependent in members and upstream in members and dependent != upstream:
            downstream[upstream].append(dependent)
            waits[dependent] += 1
    depth = dict.fromkeys(known, 0)
    ready = [node for node in known if waits[node] == 0]
    placed = 0
    while ready:
        node = ready.pop()
        placed += 1
        for dependent in downstream[node]:
            depth[dependent] = max(depth[dependent], depth[node] + 1)
            waits[dependent] -= 1
            if waits[dependent] == 0:
                ready.append(dependent)
    if placed < len(known):
        beyond = max(depth.values(), default=0) + 1
        for node in known:
            if waits[node] > 0:
                depth[node] = beyond
    return depth


def columns(depth: Mapping[str, int], edges: Iterable[tuple[str, str]],
            key: Mapping[str, str] | None = None) -> list[list[str]]:
    """The nodes of each layer, in an order that keeps edges short.

    Layer 0 is sorted by ``key`` (a label, then the id); each later node sits
    near the mean row of its upstreams in the layer before it (one
    barycentre pass: cheap, and enough for chains, groups and chords).
    """
    labels = key or {}
    upstreams: dict[str, list[str]] = defaultdict(list)
    for dependent, upstream in edges:
        if dependent in depth and upstream in depth:
            upstreams[dependent].append(upstream)
    layers: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for node, layer in depth.items():
        layers[layer].append(node)
    row: dict[str, float] = {}

    def place(node: str) -> tuple[float, str, str]:
        above: Sequence[float] = [row[u] for u in upstreams[node] if u in row]
        return (sum(above) / len(above) if above else 0.0, labels.get(node, ""), node)

    for layer_nodes in layers:
        layer_nodes.sort(key=place)  # reads only the rows of the layers before
        for index, node in enumerate(layer_nodes):
            row[node] = float(index)
    return layers
