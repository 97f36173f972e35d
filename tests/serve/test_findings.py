"""The Findings page (issue #31): doctor's findings per run, linked to their curves and the Why
panel, listed first when a run has a warning or critical finding, and never a recompute."""

from __future__ import annotations

import shutil
from urllib.parse import parse_qs, urlparse

import pytest
from dash import dcc, html

from grpolens.analysis.doctor import diagnose
from grpolens.serve import pages
from grpolens.serve.pages import findings
from tests.serve.test_callbacks import walk


def _cards(out):
    return [c for c in walk(out) if isinstance(c, html.Div) and "finding " in (getattr(c, "className", None) or "")]


@pytest.mark.parametrize("run, fid, page, severity", [("alpha", "kl-spike", "/policy", "critical"),
                                                      ("beta", "rollout-drift", "/mismatch", "warning")])
def test_each_planted_pathology_is_a_card_with_its_links(runset, run, fid, page, severity):
    ref = diagnose(runset.path(run)).to_dict()
    summary, cards, rows, cols = findings.findings_view(runset, run)
    assert len(_cards(cards)) == len(ref["findings"])
    assert [r["detector"] for r in rows] == [d["id"] for d in ref["detectors"]]
    assert [c["id"] for c in cols] == ["detector", "status", "why"]
    f = next(x for x in ref["findings"] if x["id"] == fid)
    assert f["severity"] == severity
    card = next(c for c in _cards(cards) if fid in str(c.children[0]))
    assert f["summary"] in [getattr(c, "children", None) for c in walk(card)]
    links = {c.href for c in walk(card) if isinstance(c, dcc.Link)}
    curve = next(h for h in links if not h.startswith("/tokens"))
    assert urlparse(curve).path == page
    assert parse_qs(urlparse(curve).query) == {"runs": [run], "filter": [f["metric"]]}
    why = next(h for h in links if h.startswith("/tokens"))
    q = parse_qs(urlparse(why).query)
    assert q["run"] == [run] and q["why"] == [f["metric"]] and int(q["step"][0]) == f["evidence"]["explain"]["step"]
    assert int(q["step"][0]) in f["steps"]


def test_findings_lead_the_navigation_when_warned(runset):
    assert findings.worst(runset) == {"alpha": "critical", "beta": "warning"}
    assert findings.leads(runset) and findings.default_run(runset) == "alpha"
    assert pages.nav_order(runset)[0].path == "/findings"


def test_a_healthy_run_keeps_the_page_last(tmp_path):
    import grpolens
    from grpolens.adapters.synth import synth_run
    from grpolens.serve.runs import resolve_runs

    run = synth_run(tmp_path / "clean", seed=3, steps=10, ranks=1, micro_batches=1, groups=4, generations=4,
                    max_len=32)
    grpolens.recompute(run, write=True)
    rs = resolve_runs([run])
    assert findings.worst(rs)["clean"] not in findings.LEADING
    order = [p.path for p in pages.nav_order(rs)]
    assert order == [p.path for p in pages.all_pages()] and order[-1] == "/findings"


def test_stale_metrics_are_said_not_recomputed(serve_runs, tmp_path):
    """A run served with --no-recompute and no metrics: one line, and nothing written."""
    from grpolens.run import format as fmt
    from grpolens.serve.runs import resolve_runs

    run = tmp_path / "alpha"
    shutil.copytree(serve_runs[1], run)
    shutil.rmtree(fmt.derived_dir(run))
    rs = resolve_runs([run])
    summary, cards, rows, cols = findings.findings_view(rs, "alpha")
    assert "no diagnosis" in str(summary) and "--no-recompute" in str(summary) and rows == []
    assert not fmt.derived_dir(run).exists()
    assert findings.worst(rs) == {"alpha": None} and not findings.leads(rs)


def test_csv_of_the_findings(runset):
    from grpolens.serve.app import create_app

    client = create_app(runset).server.test_client()
    r = client.get("/csv/findings?run=alpha")
    lines = r.data.decode().splitlines()
    assert r.status_code == 200 and lines[0].startswith("id,severity,first_step,last_step,metric")
    assert any(line.startswith("kl-spike,critical,9,9,kl/k3") for line in lines[1:])
    assert client.get("/csv/findings?run=../alpha").status_code == 400


def test_the_page_diagnoses_the_metrics_it_found_fresh_never_recomputing(serve_runs, tmp_path, monkeypatch):
    """One freshness check, one read: doctor gets the metrics file the page found up to date, so a
    step landing under --watch between two checks cannot make the page recompute (doctor's own
    check and read, load_metrics, is not called)."""
    import importlib

    import polars as pl

    diagnose_module = importlib.import_module("grpolens.analysis.doctor.diagnose")  # the module, not the function

    import grpolens

    run = tmp_path / "alpha"
    shutil.copytree(serve_runs[1], run)
    grpolens.recompute(run)  # its outputs, up to date where the copy lies

    def no_second_read(*a, **k):
        raise AssertionError("the Findings page read the metrics twice")

    monkeypatch.setattr(diagnose_module, "load_metrics", no_second_read)
    got = findings.report(run, explain=False)
    assert got is not None and got["worst"] == "critical"
    metrics = pl.read_parquet(run / "grpolens" / "metrics.parquet")
    assert got["findings"] == diagnose(run, explain=False, metrics=metrics).to_dict()["findings"]
