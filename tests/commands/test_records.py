"""--json / --csv of tokens, completions, check and parity (parsed back and compared with the values
the commands compute), --version, -h, and help that names meanings rather than types."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import polars as pl
import pytest

from grpolens.cli import main
from tests.sample_runs import copy_sample_run

TRL_TINY = Path(__file__).resolve().parents[2] / "sample_runs" / "trl-tiny"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("records") / "trl-tiny"
    copy_sample_run("trl-tiny", run)
    main(["recompute", str(run), "-q"])
    return run


def both(cli, *args) -> list[dict]:
    """The command's --json rows, after checking that --csv has the same rows and columns."""
    code, out, err = cli(*args, "--json")
    assert code in (0, 1), err
    rows = json.loads(out)
    code2, out2, _ = cli(*args, "--csv")
    assert code2 == code
    table = list(csv.DictReader(io.StringIO(out2)))
    assert len(table) == len(rows)
    for r, c in zip(rows, table):
        assert list(c) == list(r)
        for k, v in r.items():
            if v is None:
                assert c[k] == ""
            elif isinstance(v, bool):
                assert c[k] == str(v)
            elif isinstance(v, (int, float)):
                assert float(c[k]) == v
            else:
                assert c[k] == v
    return rows


def test_tokens(run, cli):
    from grpolens.analysis import drilldown

    rows = both(cli, "tokens", run, "--step", 2, "--by", "kl", "-k", 5)
    b = drilldown.load_step(run, 2)
    want = drilldown.top_k(b, "kl", 5).sort("score", descending=True)
    assert [r["score"] for r in rows] == want["score"].to_list()
    assert [(r["sample_id"], r["pos"], r["token_id"]) for r in rows] == \
        list(zip(want["sample_id"].to_list(), want["pos"].to_list(), want["token_id"].to_list()))
    assert all(r["by"] == "kl" and r["step"] == 2 for r in rows)
    one = both(cli, "tokens", run, "--step", 2, "--sample", rows[0]["sample_id"])
    cols = drilldown.completion_tokens(b, rows[0]["sample_id"], "kl")
    assert [r["token_id"] for r in one] == [int(t) for t in cols["token_id"]]
    assert [r["mask"] for r in one] == [bool(m) for m in cols["mask"]]


def test_completions(run, cli):
    rows = both(cli, "completions", run, "--step", 3, "--limit", 0)
    want = pl.read_parquet(run / "grpolens" / "completions.parquet").filter(pl.col("step") == 3)
    assert len(rows) == want.height
    assert [r["sample_id"] for r in rows] == want["sample_id"].to_list()
    assert [r["completion"] for r in rows] == want["completion"].to_list()  # whole text, not cut to --chars
    assert [r["reward_total"] for r in rows] == want["reward_total"].to_list()


def test_check(cli, run):
    from grpolens.check import check

    rows = both(cli, "check", run)
    report = check(run)
    assert [(r["rule"], r["status"], r["step"]) for r in rows] == \
        [(o.rule.name, o.status, o.step) for o in report.outcomes]
    code, _, err = cli("check", run, "--json", "--github")
    assert code == 2 and "--github and --json both write to stdout" in err


def test_check_failure_keeps_exit_code(tmp_path, cli):
    from grpolens.adapters.synth import synth_run

    bad = synth_run(tmp_path / "bad", steps=8, seed=3, inject=["kl-spike@5"])
    code, out, _ = cli("check", bad, "--json")
    assert code == 1
    fail = [r for r in json.loads(out) if r["status"] == "FAIL"]
    assert fail and fail[0]["step"] == 5 and fail[0]["drilldown"].startswith("grpolens tokens")


def test_parity(run, cli):
    from grpolens.analysis.parity import compare

    rows = both(cli, "parity", run)
    want = compare(run, None, profile="trl")
    assert [(r["step"], r["key"], r["logged"], r["grpolens"], r["status"]) for r in rows] == \
        [(w.step, w.key, w.logged, w.ours, w.status) for w in want]


def test_json_and_csv_together_is_a_usage_error(run, cli):
    code, out, err = cli("tokens", run, "--step", 2, "--json", "--csv")
    assert code == 2 and "--json and --csv: choose one" in err and out == ""


def test_tokens_by_ratio_has_one_ratio_column(run, cli):
    code, out, _ = cli("tokens", run, "--step", 2, "--by", "ratio", "-k", 3)
    header = next(line for line in out.splitlines() if "rank/mb" in line).split()
    assert header.count("ratio") == 1 and "|log" in header


def test_version_and_short_help(cli):
    from grpolens import __version__

    code, out, _ = cli("--version")
    assert code == 0 and out.strip() == f"grpolens {__version__}"
    code, out, _ = cli("-h")
    assert code == 0 and "Usage: grpolens [OPTIONS] COMMAND" in out and "--version" in out
    code, out, _ = cli("tokens", "-h")
    assert code == 0 and "Usage: grpolens tokens [OPTIONS] RUN" in out


def test_help_names_meanings_not_types(cli):
    from grpolens.cli import COMMAND_MODULES

    for name in COMMAND_MODULES:
        code, out, _ = cli(name.rstrip("_"), "--help")
        assert code == 0
        for typed in ("{", "<int>", "<str>", "<path>", "<float>", "<list", "<text>", " TEXT", " INTEGER"):
            assert typed not in out, (name, typed)
