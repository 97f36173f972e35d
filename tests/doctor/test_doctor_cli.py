"""``grpolens doctor``: the JSON contract, --fail-on exit codes, bad input as one line with exit 2,
and the rich view with hostile text from the run shown as text."""

import json

import pytest

from grpolens.adapters.synth import synth_run
from grpolens.analysis.doctor import DETECTORS, diagnose, load_detectors


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor")
    return {"clean": synth_run(root / "clean", steps=24, seed=7),
            "spike": synth_run(root / "spike", steps=24, seed=7, inject=["kl-spike@12"]),
            "nan": synth_run(root / "nan", steps=24, seed=7, inject=["nan@5"])}


def test_json_is_the_contract(runs, cli):
    code, out, _ = cli("doctor", runs["spike"], "--json", "--no-explain")
    assert code == 0
    r = json.loads(out)
    assert set(r) == {"run", "findings", "detectors"}
    assert r["run"] == str(runs["spike"])
    f = r["findings"][0]
    assert set(f) == {"id", "severity", "steps", "metric", "summary", "evidence", "suggestion"}
    assert (f["id"], f["severity"], f["steps"], f["metric"]) == ("kl-spike", "critical", [12], "kl/k3")
    assert [d["id"] for d in r["detectors"]] == list(load_detectors())
    assert all(set(d) == {"id", "status", "why"} and d["status"] in ("passed", "skipped", "fired") for d in r["detectors"])
    # the same object as the Python API's
    assert diagnose(runs["spike"], explain=False).to_dict() == r


@pytest.mark.parametrize("run,fail_on,code", [("clean", "warning", 0), ("clean", "critical", 0),
                                               ("spike", "warning", 1), ("spike", "critical", 1),
                                               ("nan", "critical", 1)])
def test_fail_on(runs, cli, run, fail_on, code):
    assert cli("doctor", runs[run], "--fail-on", fail_on, "--no-explain")[0] == code


def test_worst_severity_and_fails():
    from grpolens.analysis.doctor import Finding, Report

    r = Report("x", [Finding("a", "info", [1], "m", "s"), Finding("b", "warning", [2], "m", "s")], [])
    assert r.worst_severity() == "warning"
    assert r.fails("warning") and r.fails("info") and not r.fails("critical")
    assert Report("x", [], []).worst_severity() is None and not Report("x", [], []).fails("info")
    with pytest.raises(ValueError):
        Finding("a", "fatal", [1], "m", "s")


@pytest.mark.parametrize("args,message", [
    (["--fail-on", "error"], "--fail-on: 'error' is not one of info, warning, critical"),
    (["--steps", "500:600"], "--steps: no steps of the run fall in 500:600 (the run has steps 0..23)"),
    (["--steps", "a:b"], "--steps"),
    (["--profile", "nope"], "--profile: unknown profile 'nope'"),
    (["--detector", "nope"], "--detector: unknown detector 'nope'"),
])
def test_bad_input_is_one_line_exit_2(runs, cli, args, message):
    code, out, err = cli("doctor", runs["clean"], *args)
    assert code == 2 and out == ""
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_not_a_run_is_exit_2(tmp_path, cli):
    code, _, err = cli("doctor", tmp_path / "missing")
    assert code == 2 and "Traceback" not in err


def test_steps_restrict_the_diagnosis(runs):
    r = diagnose(runs["spike"], steps="0:10", explain=False)
    assert r.steps == list(range(11)) and not [f for f in r.findings if f.id == "kl-spike"]
    assert [f.steps for f in diagnose(runs["spike"], steps="6:20", explain=False).findings if f.id == "kl-spike"] == [[12]]


def test_profile_names_the_trainers_settings(runs):
    by = {p: diagnose(runs["spike"], profile=p, explain=False).findings[0].suggestion for p in ("trl", "verl", "grpolens")}
    assert "`beta`" in by["trl"] and "`learning_rate`" in by["trl"]
    assert "`actor_rollout_ref.actor.kl_loss_coef`" in by["verl"]
    assert "`beta`" in by["grpolens"] and "learning rate" in by["grpolens"]  # not a run-config key: in words


def test_rich_view_lists_findings_and_every_detector(runs, cli):
    code, out, _ = cli("doctor", runs["nan"], "--no-explain")
    assert code == 0
    assert "CRITICAL" in out and "nonfinite" in out and "health/nonfinite/logp" in out
    for d in DETECTORS:
        assert d in out


def test_fresh_outputs_are_read_not_recomputed(tmp_path, monkeypatch):
    import grpolens.analysis.recompute as rc
    from grpolens.analysis.doctor import load_metrics

    run = synth_run(tmp_path / "run", steps=12, seed=2)
    first = load_metrics(run)  # computes and writes the outputs
    monkeypatch.setattr(rc, "recompute", lambda *a, **k: pytest.fail("doctor recomputed fresh outputs"))
    again = load_metrics(run)
    assert again.equals(first)
    (run / "grpolens" / "metrics.parquet").unlink()  # stale: recomputed again
    monkeypatch.undo()
    assert load_metrics(run).equals(first)


def test_diagnose_takes_the_metrics_its_caller_read(runs):
    """``metrics=``: the frame given is the one diagnosed (the dashboard's, read once), not read
    again from the run; one without a step column is refused in one line."""
    import polars as pl

    from grpolens.analysis.doctor.diagnose import load_metrics
    from grpolens.errors import UserError

    spiked = load_metrics(runs["spike"])
    assert not [f for f in diagnose(runs["clean"], explain=False).findings if f.id == "kl-spike"]
    assert [f.id for f in diagnose(runs["clean"], explain=False, metrics=spiked).findings if f.id == "kl-spike"]
    with pytest.raises(UserError, match="^metrics: the frame has no step column"):
        diagnose(runs["clean"], explain=False, metrics=pl.DataFrame({"kl/k3": [0.1]}))
