"""Dashboard response times on a synthetic run: the first Overview response and a Tokens page.

    python benchmarks/bench_serve.py --steps 2000 --tokens 20e6          # builds the run in a temp dir
    python benchmarks/bench_serve.py --run /path/to/run                  # an existing run
    python benchmarks/bench_serve.py --steps 20 --tokens 1e6 --write-doc # its row of docs/serve.md's table

Each response is a real HTTP request to the Dash callback endpoint of a server running in this
process (what the browser sends), timed from request to the last byte of the JSON answer.
"Cold" clears the dashboard's caches first (metrics.parquet and the step's shards are read
again); "warm" repeats the request. Browser-side drawing is not included.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import shutil
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by the tests
from doc_block import measured_cell, shown_command, upsert_row  # noqa: E402

SCRIPT = "benchmarks/bench_serve.py"
DOC_COLUMNS = ["command", "run", "Overview, first response", "Tokens page, one step", "Completions page", "measured"]
DOC_INTRO = ("Written by `python benchmarks/bench_serve.py ... --write-doc` (one row per command; "
             "first response after start, and its size):")


Request = tuple[list[tuple[str, str]], list[tuple[str, str, object]], list[tuple[str, str, object]]]


def callback_body(outputs, inputs, state=()) -> dict:
    """The JSON a browser POSTs to Dash's callback endpoint for these outputs, inputs and states."""
    outs = [{"id": i, "property": p} for i, p in outputs]
    return {
        "output": outs[0]["id"] + "." + outs[0]["property"] if len(outs) == 1
        else ".." + "...".join(f"{i}.{p}" for i, p in outputs) + "..",
        "outputs": outs[0] if len(outs) == 1 else outs,
        "inputs": [{"id": i, "property": p, "value": v} for i, p, v in inputs],
        "changedPropIds": [], "state": [{"id": i, "property": p, "value": v} for i, p, v in state],
    }


def page_requests(name: str, step: int) -> dict[str, list[Request]]:
    """The callbacks each timed page fires (tests/test_bench_scripts.py sends them to the app, so a
    changed callback signature fails there rather than as an HTTP 500 in a long benchmark)."""
    return {
        "Overview (first response after start)": [(
            [("overview-graphs", "children")],
            [("url", "pathname", "/"), ("runs", "value", [name]), ("smoothing", "value", 0.6),
             ("range", "value", None), ("show-baseline", "value", []),
             ("metric-filter", "value", None), ("y-scale", "value", []), ("version", "data", None)],
            [("url", "search", "")])],
        "Tokens page, one step": [
            ([("tok-summary", "children"), ("tok-table", "data"), ("tok-table", "columns")],
             [("url", "pathname", "/tokens"), ("tok-run", "value", name), ("tok-step", "value", step),
              ("tok-by", "value", "kl"), ("tok-k", "value", 50)], []),
            ([("tok-completion", "children")],
             [("url", "pathname", "/tokens"), ("tok-run", "value", name), ("tok-step", "value", step),
              ("tok-sample", "value", None), ("tok-color", "value", "kl"), ("tok-focus", "data", None)],
             [("tok-by", "value", "kl")])],
        "Completions table page": [(
            [("comp-table", "data"), ("comp-table", "columns"), ("comp-table", "page_count"),
             ("comp-summary", "children")],
            [("url", "pathname", "/completions"), ("comp-run", "value", name), ("comp-step", "value", step),
             ("comp-table", "page_current", 1), ("comp-table", "page_size", 20),
             ("comp-table", "sort_by", [{"column_id": "kl_max", "direction": "desc"}]),
             ("comp-table", "filter_query", ""), ("comp-group", "value", None), ("comp-rank", "value", None),
             ("comp-trunc", "value", "any"), ("comp-veto", "value", "any")], [])],
    }


def post(base: str, outputs, inputs, state=()) -> tuple[float, int, dict]:
    req = urllib.request.Request(base + "/_dash-update-component",
                                 data=json.dumps(callback_body(outputs, inputs, state)).encode(),
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req) as r:
        raw = r.read()
    return time.perf_counter() - t, len(raw), json.loads(raw)


def build(run: Path, steps: int, tokens: float) -> None:
    from grpolens.adapters.synth import synth_run

    ranks, generations, max_len = 2, 8, 512
    per_completion = 0.45 * max_len * 1.13  # mean of the synthetic log-normal lengths
    groups = max(1, round(tokens / steps / per_completion / (ranks * generations)))
    t = time.perf_counter()
    synth_run(run, steps=steps, ranks=ranks, micro_batches=2, groups=groups, generations=generations,
              max_len=max_len, texts=True, inject=[f"kl-spike@{steps // 2}"])
    print(f"synth: {time.perf_counter() - t:.1f} s ({steps} steps, {ranks} ranks x {groups} groups x {generations})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--tokens", type=float, default=20e6, help="approximate token rows of the built run")
    ap.add_argument("--run", type=Path, default=None, help="use this run instead of building one")
    ap.add_argument("--keep", action="store_true", help="keep the built run")
    ap.add_argument("--write-doc", action="store_true", help="write this command's row of docs/serve.md's table")
    args = ap.parse_args()

    import grpolens
    from grpolens.run import format as fmt

    started = dt.datetime.now(dt.timezone.utc)
    firsts: dict[str, str] = {}
    tmp = None
    run = args.run
    if run is None:
        tmp = Path(tempfile.mkdtemp(prefix="grpolens-bench-serve-"))
        run = tmp / "run"
        build(run, args.steps, args.tokens)
    try:
        t = time.perf_counter()
        grpolens.recompute(run, write=True)
        print(f"recompute (metrics, sidecars): {time.perf_counter() - t:.1f} s")
        n_tokens = sum(__import__("pyarrow.parquet").parquet.ParquetFile(sh.path).metadata.num_rows
                       for sh in fmt.list_shards(run, fmt.TOKENS))
        steps = fmt.list_steps(run, fmt.TOKENS)
        print(f"run: {len(steps)} steps, {n_tokens / 1e6:.1f} M tokens, "
              f"{len(fmt.list_shards(run, fmt.TOKENS))} token shards")

        from werkzeug.serving import make_server

        from grpolens.serve import data
        from grpolens.serve.app import create_app

        t = time.perf_counter()
        app = create_app([run])
        print(f"create_app (reads metrics, catalogue): {time.perf_counter() - t:.2f} s")
        name = app.grpolens_runs.names[0]
        srv = make_server("127.0.0.1", 0, app.server, threaded=True)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{srv.port}"

        step = steps[len(steps) // 2]

        def page(label):
            def fire():
                answers = [post(base, *r) for r in page_requests(name, step)[label]]
                return sum(a[0] for a in answers), sum(a[1] for a in answers), [a[2] for a in answers]
            return fire

        for label, fn in ((label, page(label)) for label in page_requests(name, step)):
            first = fn()
            again = fn()
            data.clear_caches()
            cold = fn()
            print(f"{label}: first {first[0] * 1e3:.0f} ms, warm {again[0] * 1e3:.0f} ms, "
                  f"cold caches {cold[0] * 1e3:.0f} ms; {first[1] / 1e3:.0f} kB")
            firsts[label] = f"{first[0] * 1e3:.0f} ms ({first[1] / 1e3:.0f} kB)"
        srv.shutdown()
        if args.write_doc:
            upsert_row("docs/serve.md", "bench_serve", SCRIPT, DOC_INTRO, DOC_COLUMNS,
                       shown_command(SCRIPT, sys.argv[1:]),
                       [f"{len(steps):,} steps, {n_tokens / 1e6:.1f} M tokens", *firsts.values(), measured_cell(started)])
            print("docs/serve.md updated")
    finally:
        if tmp is not None and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp is not None:
            print(f"kept {run}")


if __name__ == "__main__":
    main()
