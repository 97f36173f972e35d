"""``grpolens check`` end to end on synthetic runs: clean runs pass the built-in rules, injected
pathologies fail them at the injected step (alone and against a baseline run or golden file), and
the command's inputs and outputs (exit codes, --junit, --github, --summary-md, --write-golden,
--show-rules, bad input) behave."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from grpolens.adapters.synth import synth_run
from grpolens.check import check
from grpolens.check.baseline import read_golden
from grpolens.check.defaults import DEFAULT_RULES_TOML
from grpolens.check.rules import Rule, parse_rules

from tests.check.golden_files import GOLDEN, golden_file


STEPS = 16


EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


#: injection -> the built-in rules it must trip (the pathology's own signature)
INJECTED = {
    "kl-spike@12": {"KL to reference"},
    "rollout-drift@10": {"mismatch KL"},
    "entropy-collapse@15": {"entropy collapse"},
    "nan@8": {"non-finite tokens"},
    "clip-drift@10": {"clip low rising", "clip high rising"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("check-runs")
    out = {"clean": synth_run(root / "clean", steps=STEPS, seed=3),
           "clean-other-seed": synth_run(root / "clean4", steps=STEPS, seed=4)}
    for spec in INJECTED:
        out[spec] = synth_run(root / spec.replace("@", "-"), steps=STEPS, seed=3, inject=[spec])
    short = root / "short"
    shutil.copytree(out["clean-other-seed"], short)
    for d in (short / "tokens").iterdir():
        if int(d.name.split("=")[1]) >= 12:
            shutil.rmtree(d)
            shutil.rmtree(short / "samples" / d.name, ignore_errors=True)
            for marker in (short / "complete").glob(f"{d.name}.rank=*.json"):  # the step is gone whole
                marker.unlink()
    out["short"] = short
    return out


def failures(report):
    return {o.rule.name: o for o in report.outcomes if o.status == "FAIL"}


def test_clean_run_passes_default_rules(runs):
    report = check(runs["clean"])
    assert report.exit_code == 0, [(o.rule.name, o.message) for o in report.outcomes if o.failed]
    # the rules that have data in a synthetic run were really evaluated, not skipped
    names = {o.rule.name for o in report.outcomes if o.status == "PASS"}
    assert {n for rules in INJECTED.values() for n in rules} <= names


@pytest.mark.parametrize("spec", list(INJECTED))
def test_injected_pathology_fails_at_injected_step(runs, spec):
    step = int(spec.split("@")[1])
    report = check(runs[spec])
    fails = failures(report)
    assert report.exit_code == 1
    assert INJECTED[spec] <= set(fails), sorted(fails)
    for name in INJECTED[spec]:
        assert fails[name].step == step, (name, fails[name].message)
    # nothing fails before the pathology: the rules point at the right step
    assert min(o.step for o in fails.values()) == step


@pytest.mark.parametrize("spec", ["kl-spike@12", "rollout-drift@10"])
def test_against_baseline_run(runs, spec):
    assert check(runs["clean-other-seed"], baseline=runs["clean"]).exit_code == 0
    report = check(runs[spec], baseline=runs["clean"])
    fails = failures(report)
    assert report.exit_code == 1 and min(o.step for o in fails.values()) == int(spec.split("@")[1])
    assert any(o.baseline is not None for o in fails.values())


def test_golden_round_trip(runs, tmp_path):
    golden = tmp_path / "golden.json"
    report = check(runs["clean"], write_golden_to=golden)
    assert report.exit_code == 0 and report.golden_written == golden
    data = json.loads(golden.read_text())
    assert data["format"] == "grpolens-golden" and data["steps"] == list(range(STEPS))
    assert "entropy" in data["metrics"] and data["rules"] == "built-in defaults"
    # values are the recomputed metrics, exactly
    import polars as pl

    df = pl.read_parquet(runs["clean"] / "grpolens" / "metrics.parquet")
    base = read_golden(golden)
    assert base.series["entropy"].values.tolist() == df["entropy"].to_list()
    assert check(runs["clean-other-seed"], baseline=golden).exit_code == 0
    bad = check(runs["entropy-collapse@15"], baseline=golden)
    assert bad.exit_code == 1 and failures(bad)["entropy collapse"].step == 15


def test_short_candidate_is_a_clear_failure(runs, cli):
    code, out, _ = cli("check", runs["short"], "--baseline", runs["clean"])
    assert code == 1
    assert "baseline coverage" in out and "this run lacks 4 of the baseline's 16 step(s) (first missing: step 12" in out


def test_cli_outputs(runs, tmp_path, cli):
    junit, summary = tmp_path / "junit.xml", tmp_path / "summary.md"
    summary.write_text("previous\n")
    code, out, _ = cli("check", runs["nan@8"], "--junit", junit, "--github", "--summary-md", summary)
    assert code == 1
    gh = [ln for ln in out.splitlines() if ln.startswith("::error ")]
    assert gh and "non-finite tokens" in gh[0] and f"grpolens tokens {runs['nan@8']} --step 8" in gh[0]
    root = ET.parse(junit).getroot()
    assert root.tag == "testsuites" and int(root.get("failures")) >= 1
    assert len(root.find("testsuite").findall("testcase")) == len(parse_rules(DEFAULT_RULES_TOML).rules)
    text = summary.read_text()
    assert text.startswith("previous\n") and "❌ regression" in text
    code, out, _ = cli("check", runs["clean"], "--summary-md", summary, "-q")
    assert code == 0 and "passed" in out and summary.read_text().count("### grpolens check") == 2


def test_cli_bad_input_exits_2(runs, tmp_path, cli):
    rules = tmp_path / "bad.toml"
    rules.write_text("[[rule]]\nmetric = 'entropy'\nreduce = 'average'\nmin = 0\n")
    code, _, err = cli("check", runs["clean"], "--rules", rules)
    assert code == 2 and f"{rules}:3: rule 1: reduce: unknown reducer 'average'" in err
    code, _, err = cli("check", runs["clean"], "--baseline", tmp_path / "nowhere")
    assert code == 2 and "no such run directory or golden file" in err
    (tmp_path / "g.json").write_text('{"format": "something else"}')
    code, _, err = cli("check", runs["clean"], "--baseline", tmp_path / "g.json")
    assert code == 2 and "not a grpolens golden file" in err
    code, _, err = cli("check", tmp_path / "no-run")
    assert code == 2 and "does not exist" in err
    # `--summary-md "$GITHUB_STEP_SUMMARY"` outside GitHub Actions: an empty path is the current directory
    junit = tmp_path / "fresh" / "check.xml"
    code, _, err = cli("check", runs["clean"], "--summary-md", "", "--junit", junit)
    assert code == 2 and "--summary-md: . is a directory" in err and not junit.exists()


def test_rule_missing_from_golden_is_an_error(runs, tmp_path, cli):
    golden = tmp_path / "g.json"
    rules = tmp_path / "r.toml"
    rules.write_text("[[rule]]\nmetric = 'entropy'\nrel = 0.1\n")
    check(runs["clean"], rules=rules, write_golden_to=golden)
    assert set(json.loads(golden.read_text())["metrics"]) == {"entropy"}
    rules.write_text("[[rule]]\nmetric = 'entropy'\nrel = 0.5\n[[rule]]\nmetric = 'health/tokens'\nrel = 0.5\n")
    code, out, _ = cli("check", runs["clean"], "--rules", rules, "--baseline", golden)
    assert code == 2 and "ERROR" in out and "the baseline has no values for health/tokens" in out


def test_set_overrides_reach_golden_and_leave_the_cache_alone(runs, tmp_path):
    cache = runs["clean"] / "grpolens" / "metrics.parquet"
    check(runs["clean"])
    before = cache.stat().st_mtime_ns
    golden = tmp_path / "g.json"
    check(runs["clean"], overrides={"epsilon": 0.1}, write_golden_to=golden)
    assert json.loads(golden.read_text())["overrides"] == {"epsilon": 0.1}
    assert cache.stat().st_mtime_ns == before
    # the override changes the clip metrics, so the golden differs from the run's own values
    clip = read_golden(golden).series["clip/low"].values
    assert (clip != read_golden_of(runs["clean"], tmp_path).series["clip/low"].values).any()
    # checking without the same --set says so
    report = check(runs["clean"], baseline=golden)
    assert any("--set {'epsilon': 0.1}" in n for n in report.notes)


def read_golden_of(run, tmp_path):
    path = tmp_path / "plain.json"
    check(run, write_golden_to=path)
    return read_golden(path)


def test_rules_file_names_its_baseline(runs, tmp_path):
    (tmp_path / "cfg").mkdir()
    check(runs["clean"], write_golden_to=tmp_path / "cfg" / "golden.json")
    rules = tmp_path / "cfg" / "rules.toml"
    rules.write_text('baseline = "golden.json"\n[[rule]]\nmetric = "kl/k3"\nreduce = "max"\nrel = 0.5\n')
    report = check(runs["kl-spike@12"], rules=rules)  # relative to the rules file, not the cwd
    assert report.baseline.startswith(str(tmp_path / "cfg" / "golden.json"))
    assert report.exit_code == 1 and failures(report)["kl/k3 max"].step == 12


def test_show_rules_prints_parseable_defaults(cli):
    code, out, _ = cli("check", "unused", "--show-rules")
    assert code == 0 and out == DEFAULT_RULES_TOML
    assert parse_rules(out).rules


def test_example_rules_against_example_baseline(runs, tmp_path, cli):
    """docs/examples/ci-rules.toml: the documented CI rules, run as the docs show them."""
    golden = tmp_path / "golden.json"
    code, _, _ = cli("check", runs["clean"], "--rules", EXAMPLES / "ci-rules.toml", "--write-golden", golden)
    assert code == 0
    code, out, _ = cli("check", runs["clean-other-seed"], "--rules", EXAMPLES / "ci-rules.toml",
                       "--baseline", golden)
    assert code == 0, out
    code, out, _ = cli("check", runs["kl-spike@12"], "--rules", EXAMPLES / "ci-rules.toml", "--baseline", golden)
    assert code == 1 and "--step 12" in out


def test_sample_github_workflow_runs(runs, tmp_path, monkeypatch, cli):
    """docs/examples/github-workflow.yml: its grpolens steps run as written, in a checkout laid out as
    its header says, and the check passes, writes the JUnit report and appends the job summary."""
    yaml = pytest.importorskip("yaml")
    wf = yaml.safe_load((EXAMPLES / "github-workflow.yml").read_text())
    steps = [s["run"] for s in wf["jobs"]["grpo-check"]["steps"] if str(s.get("run", "")).startswith("grpolens ")]
    assert len(steps) == 2 and steps[1].startswith("grpolens check runs/ci")
    (tmp_path / "ci").mkdir()
    shutil.copy(EXAMPLES / "ci-rules.toml", tmp_path / "ci" / "grpolens-rules.toml")
    check(runs["clean"], rules=tmp_path / "ci" / "grpolens-rules.toml", write_golden_to=tmp_path / "ci" / "golden.json")
    summary = tmp_path / "summary.md"
    summary.touch()
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    monkeypatch.chdir(tmp_path)
    for cmd in steps:  # as the runner's shell would split them
        argv = [os.path.expandvars(a) for a in shlex.split(cmd)]
        code, out, err = cli(*argv[1:])
        assert code == 0, out + err
    assert ET.parse(tmp_path / "reports" / "grpolens-check.xml").getroot().get("failures") == "0"
    assert "### grpolens check: ✅ passed" in summary.read_text()


@pytest.mark.slow  # a dozen commands end to end
def test_run_without_optional_columns_skips_what_it_cannot_have(tmp_path):
    """A run with no ref_logp, rollout_logp or entropy (written by the tests' own plain writer):
    the built-in rules that need them skip, the others still judge; non-finite log-probs fail."""
    import numpy as np

    from tests.refdata import random_calls, write_run

    rng = np.random.default_rng(11)
    run = write_run(tmp_path / "bare", random_calls(rng, steps=range(6), ref=False, rollout=False, entropy=False))
    report = check(run)
    status = {o.rule.name: o.status for o in report.outcomes}
    assert report.exit_code == 0, status
    for name in ("KL to reference", "entropy collapse", "mismatch KL", "veto fraction"):
        assert status[name] == "SKIP"
    assert status["non-finite tokens"] == status["clip low rising"] == "PASS"
    bad = write_run(tmp_path / "nonfinite", random_calls(rng, steps=range(6), ref=False, rollout=False,
                                                         entropy=False, nonfinite=0.05))
    fails = failures(check(bad))
    assert "non-finite tokens" in fails


def masked_copy(src: Path, dst: Path, step: int) -> Path:
    """A copy of a run whose ``step`` has every token masked (mask = false): no token counts in the loss."""
    import polars as pl

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("grpolens"))
    for f in sorted((dst / "tokens" / f"step={step:08d}").glob("*.parquet")):
        pl.read_parquet(f).with_columns(pl.lit(False).alias("mask")).write_parquet(f)
    return dst


def test_a_step_without_data_fails_every_report(runs, tmp_path, cli):
    """All tokens of step 3 masked: kl/k3 and entropy are null there. The built-in rules used to
    report '9 passed'; now each rule whose metric is null there is NO DATA (exit 1) in every report."""
    run = masked_copy(runs["clean"], tmp_path / "masked", 3)
    junit, summary = tmp_path / "junit.xml", tmp_path / "summary.md"
    code, out, _ = cli("check", run, "--junit", junit, "--github", "--summary-md", summary)
    assert code == 1
    flat = " ".join(out.split())
    assert "9 passed" not in flat and "NO DATA: " in flat
    assert "1 step (3) had no data" in flat
    for name, metric in (("KL to reference", "kl/k3"), ("entropy collapse", "entropy"), ("finite metrics", None)):
        assert f"NO DATA {name}: no data at step 3 (1 of {STEPS} in all steps): no token counts in the loss" in flat, name
        if metric:
            assert f"so {metric} has no value" in flat
    report = check(run)
    status = {o.rule.name: o.status for o in report.outcomes}
    assert status["KL to reference"] == status["entropy collapse"] == status["finite metrics"] == "NO DATA"
    assert status["non-finite tokens"] == "PASS"  # counts, not token means: they have a value (0)
    assert report.no_data_steps == [3]
    gh = [ln for ln in out.splitlines() if ln.startswith("::error ")]
    assert any("NO DATA%3A KL to reference" in ln and "no data at step 3" in ln for ln in gh), gh
    suite = ET.parse(junit).getroot().find("testsuite")
    kinds = {c.get("name"): c.find("failure").get("type") for c in suite.findall("testcase") if c.find("failure") is not None}
    assert kinds["KL to reference"] == kinds["entropy collapse"] == "no-data"
    assert int(suite.get("failures")) == sum(s == "NO DATA" for s in status.values())
    md = summary.read_text()
    assert "🚫 no data" in md and "1 step (3) had no data" in md and "🚫 NO DATA | KL to reference" in md


def test_a_step_whose_shards_hold_no_token_has_no_data(runs, tmp_path):
    """Step 3's tokens shards written with no row: no token counts in the loss there either. Its
    health/masked_tokens is null (a sum over no sequence), not 0, and the step is still a step without data."""
    import polars as pl

    run = tmp_path / "empty"
    shutil.copytree(runs["clean"], run, ignore=shutil.ignore_patterns("grpolens"))
    for f in sorted((run / "tokens" / "step=00000003").glob("*.parquet")):
        pl.read_parquet(f).head(0).write_parquet(f)
    report = check(run)
    assert report.no_data_steps == [3] and report.exit_code == 1
    status = {o.rule.name: (o.status, o.step) for o in report.outcomes}
    assert status["KL to reference"] == status["entropy collapse"] == ("NO DATA", 3)


def test_no_data_steps_reads_a_null_or_zero_loss_token_count():
    import polars as pl

    from grpolens.check.baseline import no_data_steps

    df = pl.DataFrame({"step": [0, 1, 2, 3], "health/masked_tokens": [5.0, None, 0.0, 1.0]})
    assert no_data_steps(df) == [1, 2]
    assert no_data_steps(df.drop("health/masked_tokens")) == []  # a frame without the count: nothing to say


def test_one_step_without_data_leaves_a_metric_the_run_cannot_have_to_its_missing_policy(tmp_path):
    """A metric with no value at all is NO DATA only when no step of the run has data (it may be one the run
    would have had). A run without ref_logp has no kl/k3 at any step: one masked step must not turn its rules
    into NO DATA; the metrics the run has are NO DATA at that step."""
    import numpy as np

    from tests.refdata import random_calls, write_run

    calls = random_calls(np.random.default_rng(5), steps=range(4), ref=False)
    run = masked_copy(write_run(tmp_path / "bare", calls), tmp_path / "masked", 2)
    rules = tmp_path / "r.toml"
    rules.write_text("[[rule]]\nname = 'kl'\nmetric = 'kl/k3'\nmax = 1\nmissing = 'skip'\n"
                     "[[rule]]\nname = 'kl strict'\nmetric = 'kl/k3'\nmax = 1\n"
                     "[[rule]]\nname = 'entropy'\nmetric = 'entropy'\nmin = 0\n")
    report = check(run, rules=rules)
    assert report.no_data_steps == [2]
    got = {o.rule.name: (o.status, o.step, o.message) for o in report.outcomes}
    assert got["kl"] == ("SKIP", None, "kl/k3 has no values in this run")
    assert got["kl strict"] == ("FAIL", None, "kl/k3 has no values in this run")
    assert got["entropy"][:2] == ("NO DATA", 2)


@pytest.mark.parametrize("reduce", ["all", "max", "mean"])
def test_rules_may_allow_steps_without_data(runs, tmp_path, reduce):
    run = masked_copy(runs["clean"], tmp_path / "masked", 3)
    body = f"[[rule]]\nname = 'kl'\nmetric = 'kl/k3'\nreduce = '{reduce}'\nmax = 1.0\n"
    strict, lenient = tmp_path / "strict.toml", tmp_path / "lenient.toml"
    strict.write_text(body)
    lenient.write_text(body + "no_data = 'allow'\n")
    bad = check(run, rules=strict)
    assert bad.exit_code == 1 and bad.outcomes[0].status == "NO DATA" and bad.outcomes[0].step == 3
    ok = check(run, rules=lenient)
    assert ok.exit_code == 0 and ok.outcomes[0].status == "PASS" and ok.outcomes[0].checked == STEPS - 1
    assert "left out (first: step 3)" in ok.outcomes[0].message and ok.no_data_steps == [3]


# -- the check itself: coverage of the baseline's steps, notes, drill-down --------------------------------

def test_baseline_coverage_outcome():
    from grpolens.check.baseline import Baseline
    from grpolens.check.runner import _coverage

    o = _coverage([0, 2, 3, 9], Baseline("b", {}, [0, 1, 2, 3, 4, 5]))
    assert (o.status, o.metric, o.step, o.failing, o.checked) == ("FAIL", "step", 1, 3, 6)
    assert o.message == ("this run lacks 3 of the baseline's 6 step(s) (first missing: step 1; this run's last "
                         "step: 9, the baseline's: 5)")
    o = _coverage([3, 2, 1, 0, 4], Baseline("b", {}, [0, 1, 2, 3]))
    assert (o.status, o.metric, o.step, o.failing, o.checked) == ("PASS", "step", None, 0, 4)
    assert o.message == "every one of the baseline's 4 step(s) is present"
    assert o.rule.name == "baseline coverage"


def test_drilldown_only_for_a_failure_at_a_step_of_a_metric():
    from grpolens.check.evaluate import Outcome
    from grpolens.check.runner import COVERAGE_RULE, CheckReport

    r = Rule(name="r", metric="kl/k3", max=1.0)
    report = CheckReport(Path("runs/my run"), [], "rules.toml", None)
    assert report.drilldown(Outcome(r, "FAIL", "clip/low", step=7)) == "grpolens tokens 'runs/my run' --step 7 --by ratio"
    assert report.drilldown(Outcome(r, "PASS", "clip/low", step=7)) is None
    assert report.drilldown(Outcome(r, "FAIL", "clip/low", step=None)) is None
    assert report.drilldown(Outcome(COVERAGE_RULE, "FAIL", "step", step=7)) is None


def test_check_notes_and_timing(runs, tmp_path):
    import time

    rules = tmp_path / "r.toml"
    rules.write_text("[[rule]]\nmetric = 'entropy'\nrel = 0.1\nmax = 100\n")
    t0 = time.perf_counter()
    report = check(runs["clean"], rules=rules)
    assert 0 < report.seconds <= time.perf_counter() - t0
    assert report.notes == ["no baseline given: the rules' baseline comparisons (abs/rel) were skipped"]
    assert report.rules_source == str(rules) and report.baseline is None and report.no_data_steps == []
    assert check(runs["clean"]).notes == []  # the built-in rules compare only when a baseline is given
    rules.write_text("[[rule]]\nmetric = 'entropy'\nmax = 100\n")
    assert check(runs["clean"], rules=rules).notes == []  # nothing to compare
    # a golden written with other --set values than this check's
    golden = golden_file(tmp_path, {**GOLDEN, "steps": list(range(STEPS)), "metrics": {}})
    report = check(runs["clean"], rules=rules, baseline=golden)
    assert report.notes == ["the golden file was written with --set {'epsilon': 0.1}, this check uses none: values "
                            "may differ for that reason alone"]
    assert report.baseline == f"{golden} (golden of exp-1)" and report.exit_code == 0
    report = check(runs["clean"], rules=rules, baseline=golden, overrides={"epsilon": 0.1})
    assert report.notes == []
    report = check(runs["clean"], rules=rules, baseline=golden, overrides={"epsilon": 0.3})
    assert report.notes == ["the golden file was written with --set {'epsilon': 0.1}, this check uses "
                            "{'epsilon': 0.3}: values may differ for that reason alone"]
    golden = golden_file(tmp_path, {**GOLDEN, "steps": list(range(STEPS)), "metrics": {}, "overrides": {}})
    assert check(runs["clean"], rules=rules, baseline=golden).notes == []
    # a baseline run is recomputed with this check's --set: nothing to say
    assert check(runs["clean"], rules=rules, baseline=runs["clean-other-seed"]).notes == []


def test_the_checks_engine_recomputes_the_run_and_the_baseline_run(runs, tmp_path):
    """--engine reaches both recomputes, with and without --set: an in-process engine that counts the
    steps it is given (runs copied without their cache, so every step is recomputed)."""
    from grpolens.metrics.engine import InlineEngine

    class CountingEngine(InlineEngine):
        def __init__(self):
            self.steps = []

        def map_steps(self, by_step, work):
            self.steps += sorted(by_step)
            yield from super().map_steps(by_step, work)

    for overrides in (None, {"epsilon": 0.1}):
        cand, base = (tmp_path / f"{name}-{bool(overrides)}" for name in ("cand", "base"))
        for src, dst in ((runs["clean"], cand), (runs["clean-other-seed"], base)):
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("grpolens"))
        engine = CountingEngine()
        report = check(cand, baseline=base, overrides=overrides, engine=engine)
        assert report.exit_code == 0 and report.baseline == str(base)
        assert sorted(engine.steps) == sorted(list(range(STEPS)) * 2), overrides


def test_a_check_with_set_writes_nothing_into_the_runs(runs, tmp_path):
    """--set values are a what-if: neither the run nor the baseline run gets a variant written into it
    (``recompute --set`` would write one under grpolens/variants/), and their step caches stay as they were."""
    cand, base = tmp_path / "cand", tmp_path / "base"
    shutil.copytree(runs["clean"], cand, ignore=shutil.ignore_patterns("grpolens"))
    shutil.copytree(runs["clean-other-seed"], base, ignore=shutil.ignore_patterns("grpolens"))
    check(cand, baseline=base, overrides={"epsilon": 0.1})
    assert not (cand / "grpolens").exists() and not (base / "grpolens").exists()
    check(cand, baseline=base)  # without --set: each run's own metrics are cached in place
    assert (cand / "grpolens" / "metrics.parquet").is_file() and (base / "grpolens" / "metrics.parquet").is_file()


def test_baseline_run_is_recomputed_with_the_checks_overrides(runs, tmp_path):
    """--set applies to the baseline run too: the run against itself under --set epsilon=0.1 agrees exactly
    (clip/low changes with epsilon: test_set_overrides_reach_golden_and_leave_the_cache_alone)."""
    rules = tmp_path / "r.toml"
    rules.write_text("[[rule]]\nmetric = 'clip/low'\nabs = 0\n")
    report = check(runs["clean"], rules=rules, baseline=runs["clean"], overrides={"epsilon": 0.1})
    assert [o.status for o in report.outcomes] == ["PASS", "PASS"] and report.outcomes[1].checked == STEPS


def _read_only_mount_works(path: Path) -> bool:
    """Whether this machine lets an unprivileged user namespace bind-mount a directory read-only."""
    if not shutil.which("unshare"):
        return False
    probe = (f"mount --bind {shlex.quote(str(path))} {shlex.quote(str(path))} && "
             f"mount -o remount,ro,bind {shlex.quote(str(path))} && ! touch {shlex.quote(str(path / 'probe'))} 2>/dev/null")
    import subprocess

    r = subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True, timeout=60)
    return r.returncode == 0


@pytest.mark.parametrize("mode", ["read-only mount", "no write permission"])
def test_a_run_that_cannot_be_written_is_checked_without_a_cache(runs, tmp_path, mode):
    """``check`` refreshes the run's cache where it may; a run on a read-only mount (EROFS: a
    dataset mounted read-only in CI) or in a directory the user cannot write (EACCES) is checked
    all the same, from a recompute that writes nothing, with the same outcomes. A real read-only
    bind mount in a user and mount namespace; a directory without write permission (as root, whose
    CAP_DAC_OVERRIDE would ignore it, with that capability dropped)."""
    import subprocess
    import sys
    import tempfile

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    base = Path(tempfile.mkdtemp(prefix="grpolens-ro-"))
    try:
        run = base / "run"
        # the data only: earlier tests' checks of runs["clean"] left its grpolens/ outputs there
        shutil.copytree(runs["clean"], run, ignore=shutil.ignore_patterns("grpolens"))
        assert not (run / "grpolens").exists() and (run / "grpolens.json").exists()
        command = [sys.executable, "-m", "grpolens.cli", "check", str(run), "--json"]
        if mode == "read-only mount":
            if not _read_only_mount_works(base):
                pytest.skip("no unprivileged user and mount namespaces here (unshare -rm)")
            q = shlex.quote(str(run))
            script = f"mount --bind {q} {q} && mount -o remount,ro,bind {q} && exec {shlex.join(command)}"
            r = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env, capture_output=True, text=True,
                               timeout=600)
        else:
            run.chmod(0o555)
            as_user = []
            if os.geteuid() == 0:  # root writes anywhere: without the capability to override permissions
                if not shutil.which("setpriv"):
                    pytest.skip("running as root without setpriv to drop CAP_DAC_OVERRIDE")
                as_user = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
            r = subprocess.run([*as_user, *command], env=env, capture_output=True, text=True, timeout=600)
            run.chmod(0o755)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "Traceback" not in r.stderr
        assert not (run / "grpolens").exists()  # nothing written, not even the lock
        writable = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert writable.returncode == 0 and (run / "grpolens" / "metrics.parquet").exists()
        assert json.loads(r.stdout) == json.loads(writable.stdout)
    finally:
        shutil.rmtree(base, ignore_errors=True)
