"""``grpolens explain``: the --json object of the contract, the tables, and bad input as one line
with exit code 2 naming the option and the close matches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpolens.cli import main
from tests.sample_runs import copy_sample_run

ROOT = Path(__file__).resolve().parents[2]


def _run(capsys, *args):
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_object_of_a_real_trl_step(capsys):
    code, out, _ = _run(capsys, "explain", ROOT / "sample_runs/trl-tiny", "--metric", "kl", "--step", "5",
                        "--profile", "trl", "--top", "3", "--json")
    assert code == 0
    d = json.loads(out)
    assert {"metric", "step", "value", "baseline", "delta", "by", "concentration"} <= set(d)
    assert d["metric"] == "kl" and d["baseline"]["steps"] == [4]
    assert set(d["by"]) >= {"token_id", "completion", "group", "position", "length", "rank", "micro_batch", "outcome"}
    for entries in d["by"].values():
        assert sum(e["contribution"] for e in entries) == pytest.approx(d["delta"], rel=1e-9, abs=1e-15)
        assert {"key", "label", "contribution", "share", "mix", "rate", "count"} <= set(entries[0])
    assert set(d["concentration"]) == {"top_0.1%_tokens", "top_1%_tokens", "top_10%_tokens",
                                       "top_1_completions", "top_10_completions"}
    # decoded with the run's tokenizer.json
    assert any(not e["label"].startswith("⟨") for e in d["by"]["token_id"] if e["key"] != "other")


def test_tables(capsys):
    code, out, _ = _run(capsys, "explain", ROOT / "sample_runs/tiny", "--metric", "kl/k3", "--step", "3",
                        "--baseline", "0:2", "--by", "token_id,group")
    assert code == 0
    assert "vs mean of steps 0–2" in out and "by token_id" in out and "by group" in out and "by completion" not in out
    assert "concentration at step 3" in out


@pytest.mark.parametrize("args, says", [
    (["--metric", "kl/k33", "--step", "3"], "--metric: unknown metric 'kl/k33'; did you mean kl/k3"),
    (["--metric", "kl/k3", "--step", "30"], "--step: the run has no step 30"),
    (["--metric", "kl/k3", "--step", "3", "--baseline", "x"], "--baseline: expected a step S0 or a range A:B"),
    (["--metric", "kl/k3", "--step", "3", "--baseline", "70:90"], "--baseline: no step of the run falls in 70:90"),
    (["--metric", "kl/k3", "--step", "3", "--by", "tokens"], "--by: unknown dimension 'tokens'"),
    (["--metric", "kl/k3", "--step", "3", "--top", "0"], "--top must be >= 1"),
    (["--metric", "kl", "--step", "3", "--profile", "nope"], "--profile"),
])
def test_bad_input_is_one_line(capsys, args, says):
    code, out, err = _run(capsys, "explain", ROOT / "sample_runs/tiny", *args)
    assert code == 2 and out == ""
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_a_missing_run(capsys, tmp_path):
    code, _, err = _run(capsys, "explain", tmp_path / "nope", "--metric", "kl/k3", "--step", "1")
    assert code == 2 and "nope" in err and "Traceback" not in err


def test_first_step_decomposes_its_value(capsys, tmp_path):
    run = tmp_path / "tiny"
    copy_sample_run("tiny", run)
    code, out, _ = _run(capsys, "explain", run, "--metric", "entropy", "--step", "0", "--json")
    d = json.loads(out)
    assert code == 0 and d["baseline"] == {"steps": [], "value": None} and d["delta"] == pytest.approx(d["value"])
    assert "first" in " ".join(d["notes"])
