"""A workflow's dependency graph, drawn on the server as inline SVG (no script, no library).

Layers left to right (``graphlayers``: a job's column is the longest path
to it from a job that waits for nothing), one box per job, coloured and
labelled by its state, linking to the job's admin page; an edge per
dependency. Above :data:`DRAW_LIMIT` jobs a drawing helps nobody: the page
shows, per layer, how many jobs are in each state instead, and says so.

Everything a job carries is user data: task paths and ids pass through
``format_html``/``escape`` only. The drawing is pure: ``workflow_admin``
reads the rows (a bounded number of queries) and hands them here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from .graphlayers import columns, depths
from .jobids import short_id

#: Jobs drawn one by one at most; above, counts per layer.
DRAW_LIMIT = 500
#: Jobs whose layers are counted at most; above, counts by state only.
LAYER_LIMIT = 50_000

#: What a box says and its colour, per state as the admin reads it: the
#: states of JobState, plus the two kinds of cancel a workflow makes itself.
STATES: dict[str, tuple[str, str]] = {
    "waiting": ("waiting", "#0e7490"),
    "scheduled": ("scheduled", "#7c3aed"),
    "queued": ("queued", "#2563eb"),
    "running": ("running", "#b45309"),
    "succeeded": ("succeeded", "#15803d"),
    "dead": ("dead", "#b91c1c"),
    "cancelled": ("cancelled", "#4b5563"),
    "upstream_failed": ("cancelled: upstream failed", "#9ca3af"),
    "not_needed": ("not needed", "#9ca3af"),
}
ORDER = list(STATES)
#: States whose colour is light: dark text on them.
LIGHT = ("upstream_failed", "not_needed")
#: What a box says where the whole label does not fit (the legend says it whole).
SHORT = {"upstream_failed": "upstream failed"}

#: Geometry, in pixels.
COLUMN, ROW, BOX_W, BOX_H, PAD = 230, 48, 190, 38, 12

#: One job as the admin reads it: (id, task path, state as in STATES).
Node = tuple[str, str, str]
#: (dependent id, upstream id).
Edge = tuple[str, str]


def label(state: str) -> str:
    return STATES.get(state, (state, ""))[0]


def colour(state: str) -> str:
    return STATES.get(state, ("", "#6b7280"))[1]


def task_name(path: str, limit: int = 28) -> str:
    """The function's name (the last part of its path), cut to fit a box."""
    name = path.rsplit(".", 1)[-1]
    return name if len(name) <= limit else name[:limit - 1] + "\u2026"


def draw(nodes: Sequence[Node], edges: Sequence[Edge], url: Callable[[str], str]) -> SafeString:
    """The SVG of a workflow of at most :data:`DRAW_LIMIT` jobs."""
    tasks = {job: task for job, task, _ in nodes}
    states = {job: state for job, _, state in nodes}
    layers = columns(depths(tasks, edges), edges, key=tasks)
    where: dict[str, tuple[int, int]] = {}
    for x, layer in enumerate(layers):
        for y, job in enumerate(layer):
            where[job] = (PAD + x * COLUMN, PAD + y * ROW)
    width = PAD * 2 + max(len(layers) - 1, 0) * COLUMN + BOX_W
    height = PAD * 2 + max((len(layer) for layer in layers), default=1) * ROW - (ROW - BOX_H)
    lines = format_html_join(
        "", '<path class="rj-edge" d="M{},{} C{},{} {},{} {},{}"/>',
        ((x1, y1, (x1 + x2) // 2, y1, (x1 + x2) // 2, y2, x2, y2)
         for (x1, y1, x2, y2) in (
             (where[up][0] + BOX_W, where[up][1] + BOX_H // 2, where[job][0],
              where[job][1] + BOX_H // 2)
             for job, up in dict.fromkeys(edges) if job in where and up in where)))
    boxes = format_html_join(
        "", '<a href="{}" class="rj-node rj-node-{}"><title>{} {} ({})</title>'
        '<rect x="{}" y="{}" width="{}" height="{}" rx="5" fill="{}"/>'
        '<text x="{}" y="{}" class="rj-node-task">{}</text>'
        '<text x="{}" y="{}" class="rj-node-state">{} \u00b7 {}</text></a>',
        ((url(job), states[job], tasks[job], job, label(states[job]), x, y, BOX_W, BOX_H,
          colour(states[job]), x + 8, y + 15, task_name(tasks[job]), x + 8, y + 31,
          SHORT.get(states[job], label(states[job])), short_id(job))
         for job, (x, y) in where.items()))
    return format_html(
        '<div class="rj-graph"><svg xmlns="http://www.w3.org/2000/svg" role="img" '
        'width="{}" height="{}" viewBox="0 0 {} {}" aria-label="{}">'
        '<defs><marker id="rj-arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="6" '
        'markerHeight="6" orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#9ca3af"/></marker>'
        "</defs>{}{}</svg></div>",
        width, height, width, height, f"{len(nodes)} jobs in {len(layers)} layers", lines,
        boxes)


def layer_table(nodes: Sequence[tuple[str, str]], edges: Sequence[Edge]) -> SafeString:
    """Per layer, how many jobs are in each state: the view of a workflow too big to draw.

    ``nodes`` are (id, state) pairs.
    """
    depth = depths((job for job, _ in nodes), edges)
    counts: Counter[tuple[int, str]] = Counter((depth[job], state) for job, state in nodes)
    shown = [state for state in ORDER if any(s == state for _, s in counts)]
    layers = max(depth.values(), default=-1) + 1
    head = format_html_join("", '<th class="num">{}</th>', ((label(s),) for s in shown))
    body = format_html_join("", "<tr><th>{}</th>{}</tr>", (
        (number, format_html_join("", '<td class="num">{}</td>',
                                  ((counts.get((number, s), 0) or "",) for s in shown)))
        for number in range(layers)))
    return format_html(
        '<p class="rj-muted">{}</p><table class="rj-layers"><thead><tr><th>{}</th>{}</tr>'
        "</thead><tbody>{}</tbody></table>",
        f"{len(nodes)} jobs: above {DRAW_LIMIT} the graph is not drawn; each line counts "
        "the jobs of one layer (layer 0 waits for nothing, layer n for jobs of layer n-1 "
        "at most) by state.", "layer", head, body)


def state_table(counts: dict[str, int], total: int) -> SafeString:
    """How many jobs are in each state: the view of a workflow too big to lay out."""
    rows = format_html_join("", '<tr><th>{}</th><td class="num">{}</td></tr>',
                            ((label(s), counts[s]) for s in ORDER if counts.get(s)))
    return format_html('<p class="rj-muted">{}</p><table class="rj-layers"><tbody>{}</tbody>'
                       "</table>", f"{total} jobs: above {LAYER_LIMIT} neither the graph nor "
                       "its layers are shown; the jobs by state:", rows)


def legend() -> SafeString:
    """The colours, once, above the drawing."""
    return format_html_join(
        mark_safe(" "), '<span class="rj-badge" style="background:{};color:{}">{}</span>',
        ((c, "#111827" if state in LIGHT else "#fff", text)
         for state, (text, c) in STATES.items()))
