"""Every server callback, sent hostile values through the HTTP endpoint the browser uses.

A request to ``/_dash-update-component`` can be written by hand, so each input of each callback
gets, one at a time, values no control would send (``1e300`` as a step, a 20,000-entry run list,
a 1,000-clause filter, a dict where a list goes, 100,000 characters of text), the other inputs
keeping the layout's own values. Every answer is a page update or "no update" (200, 204), never
a server error: the server runs with ``testing`` on, so an exception inside a callback fails the
test with its traceback instead of being logged as a 500.
"""

from __future__ import annotations

import json

import pytest

from grpolens.serve import inputs

BIG_FILTER = " && ".join(["{rank} > 0"] * 1000)
HOSTILE = [1e300, -1e300, -1, 2**70, 0.5, "abc", "1e300", "", True, None, [], {}, [[1]], {"a": [1]},
           ["alpha"] * 20000, "x" * 100_000, BIG_FILTER,
           [{"column_id": "rank", "direction": "asc"}] * 20000, [1, "a", None]]


def _walk(component):
    stack = [component]
    while stack:
        c = stack.pop()
        if isinstance(c, (list, tuple)):
            stack.extend(c)
            continue
        if c is None or isinstance(c, (str, int, float)):
            continue
        yield c
        stack.append(getattr(c, "children", None))


def initial_values(app) -> dict[tuple[str, str], object]:
    """``(id, property) -> value`` of every component with a string id in the layout."""
    out = {}
    for c in _walk(app.layout):
        cid = getattr(c, "id", None)
        if isinstance(cid, str):
            for prop, value in c.to_plotly_json()["props"].items():
                if prop != "children":
                    out[(cid, prop)] = value
    return out


def _outputs(spec: str) -> list[dict]:
    parts = spec[2:-2].split("...") if spec.startswith("..") else [spec]
    out = []
    for p in parts:
        cid, _, prop = p.rpartition(".")
        out.append({"id": json.loads(cid) if cid.startswith("{") else cid, "property": prop})
    return out


def _page_for(cb) -> str:
    ids = " ".join(str(d["id"]) for d in cb["inputs"] + cb["state"]) + " " + cb["output"]
    for key, path in (("tok-", "/tokens"), ("comp-", "/completions"), ("cmp-", "/compare"), ("runs-table", "/runs"),
                      ("find-", "/findings"),
                      ("mismatch", "/mismatch"), ("policy-graphs", "/policy"), ("rewards-graphs", "/rewards"),
                      ("panel-log", "/policy")):
        if key in ids:
            return path
    return "/"


def server_callbacks(app):
    return [cb for cb in app._callback_list if not cb.get("clientside_function")
            and not any(isinstance(o["id"], dict) for o in _outputs(cb["output"]))]


def post(client, cb, values: dict, changed: list[str]):
    def item(d):
        cid = d["id"]
        if isinstance(cid, dict):  # a pattern-matching (ALL) input: the browser sends a list
            v = values.get((json.dumps(cid, sort_keys=True), d["property"]), [])
            return [{"id": {**cid, "key": f"k{i}"}, "property": d["property"], "value": x}
                    for i, x in enumerate(v if isinstance(v, list) else [v])]
        return {"id": cid, "property": d["property"], "value": values.get((cid, d["property"]))}

    outs = _outputs(cb["output"])
    body = {"output": cb["output"], "outputs": outs if len(outs) > 1 or cb["output"].startswith("..") else outs[0],
            "inputs": [item(d) for d in cb["inputs"]], "state": [item(d) for d in cb["state"]],
            "changedPropIds": changed}
    return client.post("/_dash-update-component", json=body)


@pytest.fixture(scope="module")
def app(runset):
    from grpolens.serve.app import create_app

    a = create_app(runset)
    a.server.testing = True  # an exception in a callback is raised here, not turned into a 500
    return a


def test_every_callback_input_survives_hostile_values(app):
    client = app.server.test_client()
    base = initial_values(app)
    sent = 0
    for cb in server_callbacks(app):
        page = _page_for(cb)
        for d in cb["inputs"] + cb["state"]:
            if d["id"] == "url" and d["property"] == "pathname":
                continue
            key = (json.dumps(d["id"], sort_keys=True) if isinstance(d["id"], dict) else d["id"], d["property"])
            for bad in HOSTILE:
                values = {**base, ("url", "pathname"): page, ("url", "search"): "", key: bad}
                name = f"{key[0]}.{d['property']}"
                r = post(client, cb, values, [name])
                assert r.status_code in (200, 204), (cb["output"], name, repr(bad)[:60], r.status_code)
                sent += 1
    assert sent > 1000  # every callback was reached


def test_hostile_path_and_query_are_the_default_page(app):
    client = app.server.test_client()
    base = initial_values(app)
    for cb in server_callbacks(app):
        for path, search in ((["/"], ""), ({"a": 1}, ""), ("/" + "x" * 100_000, ""), ("/tokens", ["?step=1"]),
                             ("/tokens", "?step=1e300&k=1e300&sample=-1&pos=nan"), ("/", "?" + "runs=alpha&" * 5000)):
            r = post(client, cb, {**base, ("url", "pathname"): path, ("url", "search"): search}, ["url.pathname"])
            assert r.status_code in (200, 204), (cb["output"], repr(path)[:40], repr(search)[:40])


def _response(r) -> str:
    return json.dumps(r.get_json()) if r.status_code == 200 else ""


def _render_tokens(client, app, step, k=10):
    cb = next(c for c in server_callbacks(app) if c["output"].startswith("..tok-summary.children"))
    return post(client, cb, {("url", "pathname"): "/tokens", ("tok-run", "value"): "alpha",
                             ("tok-step", "value"): step, ("tok-by", "value"): "kl", ("tok-k", "value"): k},
                ["tok-step.value"])


@pytest.mark.parametrize("step, ok", [(1e300, False), (-1, False), (0, True), (10**8 - 1, True), (10**8, False),
                                      (3.5, False), ("abc", False), (3.0, True)])
def test_a_bad_step_is_a_message_on_the_tokens_page(app, step, ok):
    """``tok-step=1e300`` (issue #28): not a 500, a message naming the bounds."""
    r = _render_tokens(app.server.test_client(), app, step)
    assert r.status_code == 200
    text = _response(r)
    assert ("step must be a whole number in 0..99,999,999" in text) != ok, text[:300]


def test_a_long_run_list_is_refused_with_a_message(app):
    cb = next(c for c in server_callbacks(app) if c["output"] == "overview-graphs.children")
    client = app.server.test_client()
    base = initial_values(app)
    for n, ok in ((inputs.MAX_RUNS, True), (inputs.MAX_RUNS + 1, False), (20000, False)):
        r = post(client, cb, {**base, ("url", "pathname"): "/", ("runs", "value"): ["alpha"] * n}, ["runs.value"])
        text = _response(r)
        assert r.status_code == 200 and (f"at most {inputs.MAX_RUNS} are accepted" in text) != ok, (n, text[:200])


def test_a_long_filter_is_refused_with_a_message(app):
    cb = next(c for c in server_callbacks(app) if c["output"].startswith("..comp-table.data"))
    client = app.server.test_client()
    base = initial_values(app)
    for n, ok in ((inputs.MAX_CLAUSES, True), (inputs.MAX_CLAUSES + 1, False), (1000, False)):
        fq = " && ".join(["{rank} > 0"] * n)  # 9 clauses fit in the 200 characters: the clause bound refuses them
        values = {**base, ("url", "pathname"): "/completions", ("comp-run", "value"): "alpha",
                  ("comp-step", "value"): 3, ("comp-table", "filter_query"): fq}
        r = post(client, cb, values, ["comp-table.filter_query"])
        text = _response(r)
        refused = f"clauses; at most {inputs.MAX_CLAUSES}" in text if n < 30 else "characters long" in text
        assert r.status_code == 200 and refused != ok, (n, text[:300])
        if ok:
            assert "completion(s) match" in text


def test_filter_clauses_are_bounded_in_the_data_layer_too():
    """The CSV download parses the same filter row from its URL: the same bound applies there."""
    import polars as pl

    from grpolens.serve.data import parse_filter_query

    schema = {"rank": pl.Int64}
    assert parse_filter_query(" && ".join(["{rank} > 0"] * inputs.MAX_CLAUSES), ["rank"], schema) is not None
    with pytest.raises(inputs.BadInput, match=f"at most {inputs.MAX_CLAUSES} are accepted"):
        parse_filter_query(" && ".join(["{rank} > 0"] * (inputs.MAX_CLAUSES + 1)), ["rank"], schema)


def test_text_sort_and_list_bounds_move_by_one(runset):
    assert inputs.text("x" * inputs.MAX_TEXT, "f") == "x" * inputs.MAX_TEXT
    with pytest.raises(inputs.BadInput, match="at most 200"):
        inputs.text("x" * (inputs.MAX_TEXT + 1), "f")
    assert inputs.text(" a\x00b ", "f") == "ab" and inputs.text("  ", "f") is None
    s = {"column_id": "rank", "direction": "asc"}
    assert len(inputs.sort_by([s] * inputs.MAX_SORT)) == inputs.MAX_SORT
    with pytest.raises(inputs.BadInput):
        inputs.sort_by([s] * (inputs.MAX_SORT + 1))
    for bad in ([{"column_id": "a b", "direction": "asc"}], [{"column_id": "rank", "direction": "up"}], ["rank"], "rank"):
        with pytest.raises(inputs.BadInput):
            inputs.sort_by(bad)
    assert inputs.metric_names(["kl/k3"] * inputs.MAX_DELTA, "d") == ["kl/k3"]
    with pytest.raises(inputs.BadInput):
        inputs.metric_names(["kl/k3"] * (inputs.MAX_DELTA + 1), "d")
    assert inputs.run_names(runset, ["alpha", "alpha", "beta"]) == ["alpha", "beta"]
    assert inputs.run_names(runset, "alpha") == ["alpha"] and inputs.run_names(runset, None) == []
    with pytest.raises(inputs.BadInput):
        inputs.run_names(runset, {"alpha": 1})
    assert len(inputs.items([0] * inputs.MAX_ITEMS, "x")) == inputs.MAX_ITEMS
    with pytest.raises(inputs.BadInput):
        inputs.items([0] * (inputs.MAX_ITEMS + 1), "x")
    assert inputs.row_indices([2, 0, 2, "1", 1.0, 5, -1, None, [1]], 3) == [0, 1, 2]
    assert inputs.pathname(["/"]) == "/" and inputs.pathname("/tokens") == "/tokens"
    assert inputs.pathname("/" + "x" * inputs.MAX_SHORT) == "/"


@pytest.mark.parametrize("what", sorted(inputs.BOUNDS))
def test_whole_number_bounds_move_by_one(what):
    lo, hi = inputs.BOUNDS[what]
    assert inputs.whole(lo, what) == lo and inputs.whole(hi, what) == hi
    assert inputs.whole(float(lo), what) == lo and inputs.whole(str(lo), what) == lo
    for bad in (lo - 1, hi + 1, lo + 0.5, 1e300, -1e300, float("nan"), float("inf"), "abc", [lo], True):
        with pytest.raises(inputs.BadInput, match=f"{what} must be a whole number in {lo:,}..{hi:,}"):
            inputs.whole(bad, what)
        assert inputs.whole_or_none(bad, what) is None
    assert inputs.whole(None, what) is None and inputs.whole("", what) is None
    assert inputs.clamped(hi + 1, what, lo) == hi and inputs.clamped(lo - 1, what, hi) == lo
    assert inputs.clamped(1e300, what, lo) == hi and inputs.clamped("abc", what, hi) == hi


def test_smoothing_and_step_range():
    assert inputs.smoothing(None) == 0.0 and inputs.smoothing(0.5) == 0.5
    assert inputs.smoothing(0.995) == 0.99 and inputs.smoothing(-3) == 0.0 and inputs.smoothing(1e300) == 0.99
    for bad in ("abc", [0.5], float("nan")):
        with pytest.raises(inputs.BadInput, match="smoothing"):
            inputs.smoothing(bad)
    assert inputs.step_range([0, 10**8 - 1]) == (0, 10**8 - 1) and inputs.step_range(None) == (None, None)
    for bad in ([0, 10**8], [-1, 3], [1], [1, 2, 3], "1,2", {"a": 1}):
        with pytest.raises(inputs.BadInput):
            inputs.step_range(bad)
