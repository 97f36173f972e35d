"""``grpolens check RUN``: fail CI when KL, clip fractions, entropy or train–inference mismatch regress."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from grpolens.commands.storage_option import STORAGE_OPTION, refuse_unless_remote

from grpolens.commands.records import CSV_OPTION, JSON_OPTION
from grpolens.commands.variant_option import VARIANT_OPTION


def check_cmd(
    run: str = typer.Argument(..., help="Run directory to check (contains grpolens.json), or s3://bucket/prefix."),
    baseline: Optional[str] = typer.Option(None, "--baseline", "-b", help="Baseline: a run directory or s3:// run (recomputed "
                                            "with the same --set) or a golden JSON from --write-golden."),
    rules: Optional[Path] = typer.Option(None, "--rules", "-r", help="Rules file (TOML; YAML with PyYAML). "
                                         "Default: the built-in rules (see --show-rules)."),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Write JUnit XML: one test case per rule."),
    github: bool = typer.Option(False, "--github", help="Print GitHub Actions ::error annotations for failures."),
    summary_md: Optional[Path] = typer.Option(None, "--summary-md", help="Append a Markdown table to this file "
                                              "(e.g. $GITHUB_STEP_SUMMARY)."),
    write_golden: Optional[Path] = typer.Option(None, "--write-golden", help="Also write this run's per-step "
                                                "values of the rules' metrics as a golden JSON baseline."),
    set_: List[str] = typer.Option([], "--set", help="Override a config key for the recompute of the run "
                                   "and of a baseline run: key=value. Repeatable."),
    variant: Optional[str] = VARIANT_OPTION,
    show_rules: bool = typer.Option(False, "--show-rules", help="Print the built-in rules as TOML (a starting point "
                                    "for your own), or with --rules check that file and list its rules; then exit."),
    engine: str = typer.Option("default", "--engine", help="default: threads in this process; ray: Ray tasks, one per group of shards (pip install 'grpolens[ray]'; docs/distributed.md)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="With --engine ray: 'auto' or ray://HOST:PORT joins an existing cluster [default: a local Ray instance]."),
    storage_option: List[str] = STORAGE_OPTION,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No table; the verdict line only."),
    explain: bool = typer.Option(True, "--explain/--no-explain", help="Explain each failing rule at its first failing step: its top three contributors (token ids, prompts or completions; grpolens explain), in every report."),
    as_json: bool = JSON_OPTION,
    as_csv: bool = CSV_OPTION,
) -> None:
    """Check a run against rules (and a baseline): exit 0 all pass, 1 a regression or a rule without data, 2 bad input or rules.

    A failure names its first failing step and the `grpolens tokens` command to drill into it.
    --json/--csv print one row per rule instead of the table (status, value, bounds, first
    failing step, drill-down command); the exit code is the same.
    """
    refuse_unless_remote(storage_option, {"RUN": run, "--baseline": baseline})
    from grpolens.check.runner import check, resolve_rules
    from grpolens.run.reader import parse_overrides

    if show_rules:
        from grpolens.check.defaults import DEFAULT_RULES_TOML

        if rules is None:
            typer.echo(DEFAULT_RULES_TOML, nl=False)
        else:
            _print_rules(resolve_rules(rules))  # validated: a bad file exits 2 with the line at fault
        return
    from grpolens.commands.records import output_format, write_records
    from grpolens.errors import UserError

    out_fmt = output_format(as_json, as_csv)
    if out_fmt and github:
        raise UserError(f"--github and --{out_fmt} both write to stdout: choose one")
    if summary_md is not None and summary_md.is_dir():
        # typically `--summary-md "$GITHUB_STEP_SUMMARY"` outside GitHub Actions (an empty path is ".");
        # said before the check runs, so no report is half-written
        raise UserError(f"--summary-md: {summary_md} is a directory; give a file to append to")
    overrides = parse_overrides(set_)
    if variant is not None:
        from grpolens.commands.variant_option import variant_overrides

        overrides, _ = variant_overrides(run, variant, set_)
    from grpolens.metrics.engine import make_engine

    report = check(run, baseline=baseline, rules=rules, overrides=overrides, write_golden_to=write_golden,
                   engine=make_engine(engine, ray_address), explain=explain)

    from grpolens.check import report as rep
    from grpolens.run.format import atomic_write_bytes

    if junit is not None:
        junit.parent.mkdir(parents=True, exist_ok=True)  # like pytest --junitxml: CI report dirs are fresh
        atomic_write_bytes(junit, rep.junit_xml(report))
    if summary_md is not None:
        rep.append_markdown(summary_md, rep.markdown_summary(report))
    if github:
        for line in rep.github_lines(report):
            typer.echo(line)
    if out_fmt:
        write_records(({"rule": o.rule.name, "metric": o.metric, "status": o.status, "value": o.value,
                        "baseline": o.baseline, "lower": o.lower, "upper": o.upper, "step": o.step,
                        "failing_steps": o.failing, "checked_steps": o.checked, "message": o.message,
                        "drilldown": report.drilldown(o) if o.failed else None, "why": report.why(o)}
                       for o in report.outcomes), out_fmt,
                      columns=["rule", "metric", "status", "value", "baseline", "lower", "upper", "step",
                               "failing_steps", "checked_steps", "message", "drilldown", "why"])
    elif quiet:
        from rich.text import Text

        _console().print(Text(rep.summary_line(report)))
    else:
        rep.print_report(report, _console())
    if report.exit_code:
        # SystemExit, not typer.Exit: click returns typer.Exit's code in non-standalone mode
        raise SystemExit(report.exit_code)


def _print_rules(ruleset) -> None:
    from rich.table import Table
    from rich.text import Text

    t = Table(title=Text(f"{len(ruleset.rules)} rule(s) from {ruleset.source}"), title_justify="left")
    for col in ("rule", "metric", "steps", "checks", "missing", "no data"):
        t.add_column(col)
    for r in ruleset.rules:
        steps = r.window.describe() if r.reduce == "all" else f"{r.reduce}, {r.window.describe()}"
        t.add_row(Text(r.name), Text(r.metric), Text(steps), Text(r.describe_checks()), r.missing, r.no_data)
    _console().print(t)


def _console():
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # CI logs: rich would assume 80 columns and squeeze the tables
        console = Console(width=max(console.width, 160))
    return console


def register(app: typer.Typer) -> None:
    app.command("check")(check_cmd)
