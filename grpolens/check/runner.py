"""``grpolens.check.check(run, ...)``: rules × current metrics (× baseline) -> a :class:`CheckReport`."""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from grpolens.run import format as fmt
from grpolens.check.baseline import (Baseline, golden_json, load_baseline, metrics_of, no_data_steps, run_series,
                                     write_golden)
from grpolens.check.evaluate import ERROR, FAIL, NO_DATA, PASS, STATUSES, Outcome, evaluate, matched_metrics
from grpolens.check.defaults import DEFAULTS_SOURCE
from grpolens.check.rules import Rule, RuleSet, load_rules

COVERAGE_RULE = Rule(
    name="baseline coverage", metric="step", finite=True,
    why="A run that stops early (crash, timeout) must not pass by having fewer steps to compare.",
)


@dataclass
class CheckReport:
    run: Path
    outcomes: list[Outcome]
    rules_source: str
    baseline: str | None
    seconds: float = 0.0
    golden_written: Path | None = None
    notes: list[str] = field(default_factory=list)
    no_data_steps: list[int] = field(default_factory=list)  # steps without a token in the loss
    #: index in ``outcomes`` -> the failing step's explanation headline (``grpolens explain``)
    explanations: dict[int, str] = field(default_factory=dict)

    def why(self, o: Outcome) -> str | None:
        """The one-line explanation of a failure at its first failing step (None: not explained)."""
        for i, x in enumerate(self.outcomes):
            if x is o:
                return self.explanations.get(i)
        return None

    @property
    def exit_code(self) -> int:
        """0 all pass (skips allowed), 1 a regression or a rule without data, 2 an error (bad baseline)."""
        if any(o.status == ERROR for o in self.outcomes):
            return 2
        return 1 if any(o.status in (FAIL, NO_DATA) for o in self.outcomes) else 0

    def counts(self) -> dict[str, int]:
        return {s: sum(o.status == s for o in self.outcomes) for s in STATUSES}

    def drilldown(self, o: Outcome) -> str | None:
        """The command that shows the tokens behind a failure at its first failing step."""
        if o.status != FAIL or o.step is None or o.metric == "step":
            return None
        return f"grpolens tokens {shlex.quote(str(self.run))} --step {o.step} --by {drilldown_score(o.metric)}"


def drilldown_score(metric: str) -> str:
    """The ``grpolens tokens --by`` score that best explains a metric."""
    if metric.startswith(("mismatch/", "rollout_is/")):
        return "mismatch"
    if metric.startswith(("clip/", "policy/ratio")):
        return "ratio"
    if metric.startswith("entropy"):
        return "entropy"
    return "kl"


def resolve_rules(rules: RuleSet | Path | str | None) -> RuleSet:
    if rules is None:
        from grpolens.check.rules import default_rules

        return default_rules()
    if isinstance(rules, RuleSet):
        return rules
    return load_rules(rules)


def check(
    run: Path | str,
    *,
    baseline: Path | str | None = None,
    rules: RuleSet | Path | str | None = None,
    overrides: dict | None = None,
    write_golden_to: Path | str | None = None,
    engine=None,
    explain: bool = True,
) -> CheckReport:
    """Check ``run`` against ``rules`` (built-in defaults when None), optionally against a baseline
    run or golden file; with ``write_golden_to``, also write this run's values as a golden file.
    ``explain``: each failing rule's first failing step is explained (its top three contributors,
    :func:`grpolens.analysis.explain.explain`)."""
    t0 = time.perf_counter()
    run = fmt.as_run(run)  # a local Path, or an s3:// run
    ruleset = resolve_rules(rules)
    df = metrics_of(run, overrides, engine)
    candidate = run_series(df)
    empty = no_data_steps(df)
    steps = sorted(int(s) for s in df["step"].to_list())
    base_path = baseline if baseline is not None else ruleset.baseline
    base: Baseline | None = load_baseline(base_path, overrides, engine) if base_path is not None else None

    outcomes = []
    if base is not None:
        outcomes.append(_coverage(df["step"].to_list(), base))
    for rule in ruleset.rules:
        outcomes.append(evaluate(rule, candidate, base.series if base is not None else None, empty, steps))

    report = CheckReport(run, outcomes, ruleset.source, base.label if base is not None else None,
                         no_data_steps=empty)
    if base is None and ruleset.source != DEFAULTS_SOURCE and any(r.compares for r in ruleset.rules):
        report.notes.append("no baseline given: the rules' baseline comparisons (abs/rel) were skipped")
    if base is not None and base.overrides is not None and base.overrides != (overrides or {}):
        report.notes.append(f"the golden file was written with --set {base.overrides}, this check uses "
                            f"{overrides or 'none'}: values may differ for that reason alone")
    if write_golden_to is not None:
        names = sorted({m for r in ruleset.rules for m in matched_metrics(r, candidate, None) if m in candidate})
        write_golden(Path(write_golden_to), golden_json(df, names, run=run, overrides=overrides,
                                                        rules_source=ruleset.source))
        report.golden_written = Path(write_golden_to)
    if explain:
        explain_failures(report, overrides)
    report.seconds = time.perf_counter() - t0
    return report


def explain_failures(report: CheckReport, overrides: dict | None) -> None:
    """Each failed rule's headline at its first failing step, against the step before it. A
    failure that cannot be explained (a metric of the samples, a what-if --set the explanation
    does not apply) says why in its place; nothing here changes the verdict."""
    from grpolens.analysis.explain import explain
    from grpolens.errors import RunFormatError, UserError

    for i, o in enumerate(report.outcomes):
        if o.status != FAIL or o.step is None or o.metric == "step":
            continue
        if overrides:
            report.explanations[i] = "not explained: the check recomputed the run with --set, explain reads it as recorded"
            continue
        try:
            report.explanations[i] = explain(report.run, o.metric, int(o.step), by=EXPLAIN_DIMS).headline(k=3)
        except (UserError, RunFormatError) as e:
            report.explanations[i] = f"not explained: {getattr(e, 'message', str(e))}"


#: The dimensions a check failure is explained along (the headline names the first that applies).
EXPLAIN_DIMS = ("token_id", "group", "completion")


def _coverage(cand_steps: list[int], base: Baseline) -> Outcome:
    have = set(int(s) for s in cand_steps)
    missing = [s for s in base.steps if s not in have]
    o = Outcome(COVERAGE_RULE, PASS, "step", checked=len(base.steps))
    last = max(have)  # never empty: reading a run without a step shard is refused before
    if missing:
        o.status, o.step, o.failing = FAIL, missing[0], len(missing)
        o.message = (f"this run lacks {len(missing)} of the baseline's {len(base.steps)} step(s) (first missing: "
                     f"step {missing[0]}; this run's last step: {last}, the baseline's: {base.steps[-1]})")
    else:
        o.message = f"every one of the baseline's {len(base.steps)} step(s) is present"
    return o
