"""No circular dependency between the dashboard's callbacks.

dash-renderer orders callbacks by a graph from each input property to each output property (see
:func:`callback_graph`). A cycle across callbacks (the URL sets a control in one callback, the
control writes the URL or another synced control in another) makes it report "Circular
Dependencies" in debug mode and break the chain at run time, so a view can be half-restored. This
test builds the same graph from the app's callbacks."""

from __future__ import annotations

import json

import pytest


def _name(cid, prop: str) -> str:
    if isinstance(cid, dict):  # a pattern-matching id, as dash writes it
        cid = json.dumps(cid, sort_keys=True, separators=(",", ":"), default=lambda w: w.to_json())
    return f"{cid}.{prop}"


def _outputs(spec: str) -> list[str]:
    """A callback's outputs as dash sends them to the browser: ``..a.b...c.d@hash..`` or ``a.b``."""
    return [p for p in spec[2:-2].split("...")] if spec.startswith("..") else [spec]


def callback_graph(app) -> dict[str, set[str]]:
    """dash-renderer's dependency graph (``computeGraphs`` in dash_renderer.js, whose
    ``overallOrder`` reports "Circular Dependencies"): an edge from each input to each output of a
    callback; an output that is also an input of the same callback is a node of its own
    (``X__output``), with edges to the outputs of every *other* callback that listens to ``X``. An
    ``allow_duplicate`` output is its own node (``X@hash``), which no callback listens to."""
    graph: dict[str, set[str]] = {}
    ins: list[list[str]] = []
    outs: list[list[str]] = []
    dupes: list[str] = []
    for cb in app._callback_list:
        inputs = [_name(d["id"], d["property"]) for d in cb["inputs"]]
        names = []
        for name in _outputs(cb["output"]):
            if name in inputs:
                dupes.append(name)
                name += "__output"
            names.append(name)
            for i in inputs:
                graph.setdefault(i, set()).add(name)
        ins.append(inputs)
        outs.append(names)
    for orig in dupes:
        for cb_in, cb_out in zip(ins, outs):
            if orig in cb_in and orig + "__output" not in cb_out:
                for out in cb_out:
                    graph.setdefault(orig + "__output", set()).add(out)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_checker_finds_a_cycle_across_callbacks():
    from dash import Dash, Input, Output, dcc, html

    app = Dash(__name__)
    app.layout = html.Div([dcc.Location(id="url"), dcc.Input(id="x"), dcc.Input(id="y")])
    app.callback(Output("x", "value"), Input("url", "search"))(lambda s: s)
    app.callback(Output("url", "search"), Output("y", "value"), Input("x", "value"), Input("y", "value"))(
        lambda v, w: (v, w))
    assert find_cycle(callback_graph(app)) is not None
    # one callback reading and writing the same properties is none
    app2 = Dash(__name__)
    app2.layout = app.layout
    app2.callback(Output("x", "value"), Output("url", "search"), Input("url", "search"), Input("x", "value"))(
        lambda s, v: (s, v))
    assert find_cycle(callback_graph(app2)) is None


@pytest.mark.parametrize("with_baseline", [False, True])
def test_dashboard_callbacks_have_no_cycle(serve_runs, with_baseline):
    from grpolens.serve.app import create_app
    from grpolens.serve.runs import resolve_runs

    root, alpha, _ = serve_runs
    app = create_app(resolve_runs([root], baseline=alpha if with_baseline else None))
    cycle = find_cycle(callback_graph(app))
    assert cycle is None, " -> ".join(cycle)
