"""The built-in check rules on a healthy real run, and the ``sustained`` criterion they use.

A first check that is red on a healthy run teaches users to ignore it: the bundled real TRL run must
pass the defaults (the clean synthetic run and every injected pathology are in
``tests/check/test_cli.py``), and the clip rules must still fail on a sustained rise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from grpolens.check import check
from grpolens.check.evaluate import FAIL, PASS, Series, evaluate
from grpolens.check.rules import Sustained, parse_rules
from grpolens.errors import UserError
from tests.sample_runs import copy_sample_run

TRL_TINY = Path(__file__).resolve().parents[2] / "sample_runs" / "trl-tiny"


def test_bundled_trl_run_passes_default_rules(tmp_path):
    run = tmp_path / "trl-tiny"
    copy_sample_run("trl-tiny", run)
    report = check(run)
    assert report.exit_code == 0, [(o.rule.name, o.message) for o in report.outcomes if o.failed]
    by_name = {o.rule.name: o for o in report.outcomes}
    # the clip rules were evaluated on this run (it clips), not skipped
    assert by_name["clip low rising"].status == PASS and by_name["clip high rising"].status == PASS


def _rule(extra: str = ""):
    return parse_rules(f'[[rule]]\nname = "r"\nmetric = "clip/low"\nmax = 0.05\n{extra}\n').rules[0]


def _series(values):
    return {"clip/low": Series(np.arange(len(values), dtype=np.int64), np.asarray(values, np.float64))}


SUSTAINED = "sustained = { count = 2, window = 4 }"


@pytest.mark.parametrize("values, status, first", [
    # one blip (trl-tiny's step 2 pattern): not a trend
    ([0, 0.15, 0, 0.03, 0, 0, 0, 0], PASS, None),
    # a drift that shows only on every other step (TRL, steps_per_generation = 2): 2 of 4
    ([0, 0, 0, 0.1, 0, 0.1, 0, 0.1], FAIL, 3),
    # two blips 3 steps apart fall in one window of 4: counted
    ([0.1, 0, 0, 0.1, 0, 0, 0, 0], FAIL, 0),
    # two blips 4 steps apart never share a window of 4
    ([0.1, 0, 0, 0, 0.1, 0, 0, 0], PASS, None),
    # a persistent rise from step 5
    ([0, 0, 0, 0, 0, 0.2, 0.2, 0.2], FAIL, 5),
    # a NaN counts on its own
    ([0, 0, float("nan"), 0, 0, 0, 0, 0], FAIL, 2),
])
def test_sustained_counts_only_streaks(values, status, first):
    out = evaluate(_rule(SUSTAINED), _series(values), None)
    assert out.status == status, out.message
    if first is not None:
        assert out.step == first
    # without the criterion every one of these fails at its first step outside the bound
    plain = evaluate(_rule(), _series(values), None)
    assert plain.status == FAIL


def test_sustained_hand_worked():
    # outside: steps 1, 2, 6; windows of 3 with >= 2 outside: [0..2], [1..3] -> steps 1 and 2 count, 6 does not
    outside = np.array([0, 1, 1, 0, 0, 0, 1], bool)
    got = Sustained(count=2, window=3).qualifying(outside, np.ones(7, bool))
    assert got.tolist() == [False, True, True, False, False, False, False]
    # a window longer than the run is the whole run
    assert Sustained(count=2, window=10).qualifying(np.array([1, 0, 1], bool), np.ones(3, bool)).tolist() == [True, False, True]


@pytest.mark.parametrize("value, msg", [
    ("{ count = 3, window = 2 }", "count 3 is larger than window 2"),
    ("{ count = 2 }", "give both count and window"),
    ("{ count = 0, window = 2 }", "count must be an integer >= 1"),
    ("{ count = 2, windw = 4 }", "unknown key"),
    ("3", "expected a table"),
])
def test_sustained_parse_errors(value, msg):
    with pytest.raises(UserError, match=msg):
        parse_rules(f'[[rule]]\nname = "r"\nmetric = "clip/low"\nmax = 0.05\nsustained = {value}\n')


def test_sustained_needs_per_step_reduce():
    with pytest.raises(UserError, match="only applies to reduce"):
        parse_rules('[[rule]]\nmetric = "clip/low"\nmax = 0.05\nreduce = "mean"\nsustained = { count = 2, window = 4 }\n')


def test_default_rules_text_is_the_header_each_familys_rules_and_the_general_ones():
    """`check --show-rules` prints this text for people to copy: one blank line between the pieces."""
    from grpolens.check.defaults import DEFAULT_RULES_TOML, GENERAL_RULES, HEADER
    from grpolens.metrics.registry import FAMILIES

    text = DEFAULT_RULES_TOML
    assert text.startswith(HEADER) and text.endswith("\n" + GENERAL_RULES)
    assert "\n\n\n" not in text and not text.endswith("\n\n")
    pieces = [f.rules.rstrip("\n") for f in FAMILIES.values() if f.rules]
    assert len(pieces) >= 3
    for piece in pieces:
        assert f"\n\n{piece}\n\n" in text
