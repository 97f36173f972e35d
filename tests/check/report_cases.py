"""Check reports built by hand for the reporters' tests: one of a few rules over three steps
(``make_report``), one of every status with numbers worked by hand (``every_status_report``) and
the texts its outcomes must read as; text no report may break on (``HOSTILE``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from grpolens.check.evaluate import Series, evaluate
from grpolens.check.rules import Rule
from grpolens.check.runner import CheckReport


HOSTILE = "kl <b>&amp; ]]> | `x` *y*\n::error::\x07 100%, a:b"


def s(vals):
    return Series(np.arange(len(vals), dtype=np.int64), np.array(vals, np.float64))


def make_report(run="runs/cand") -> CheckReport:
    cand = {"a": s([0.1, 0.2, 0.9]), "b": s([1.0, 1.0, 1.0])}
    base = {"a": s([0.1, 0.2, 0.2]), "b": s([1.0, 1.0, 1.0])}
    rules = [
        Rule("a rises", "a", direction="upper", abs=0.05, rel=0.1, why="KL must not rise"),
        Rule("b steady", "b", abs=0.01),
        Rule(HOSTILE, "b", reduce="mean", max=0.5),
        Rule("only baseline", "c", abs=0.1, missing="skip"),
        Rule("bad baseline", "b2", abs=0.1),
    ]
    cand["b2"] = s([1.0])
    outcomes = [evaluate(r, cand, base) for r in rules]
    outcomes[3] = evaluate(rules[3], cand, None)  # SKIP: no baseline for it
    return CheckReport(Path(run), outcomes, "rules.toml", "golden.json", seconds=0.25, notes=["a note, with: colon"])


def outcome(status, **kw):
    from grpolens.check.evaluate import Outcome

    return Outcome(Rule(kw.pop("name", "r"), "m", max=1.0), status, kw.pop("metric", "m"), **kw)


KL_DETAIL = ("1/4 step(s) outside the limit; first at step 3; "
             "value 0.75 at step 3, baseline 0.25, limit ≤ 0.5, above by 0.25 (50%)")  # 0.25 past 0.5 is 50 %


ENTROPY_DETAIL = "mean over all steps (4 step(s)); value 2, limit ≥ 1, headroom 1 (100%)"  # a reduced rule: no step


NO_DATA_MSG = "no data at step 2 (1 of 4 in all steps): no token counts in the loss, so clip/high has no value"


ERROR_MSG = "the baseline has no values for mismatch/kl_k3 (write the golden with these rules, or drop the rule)"


SKIP_MSG = "compares with a baseline; none given"


def every_status_report(run="runs/cand", baseline="golden.json", notes=()) -> CheckReport:
    """FAIL, PASS, NO DATA, ERROR, SKIP: one outcome each, their numbers chosen to be worked by hand."""
    from grpolens.check.evaluate import Outcome

    outcomes = [
        Outcome(Rule("kl rises", "kl/k3", direction="upper", abs=0.25, why="KL must stay low"), "FAIL", "kl/k3",
                value=0.75, baseline=0.25, upper=0.5, step=3, failing=1, checked=4,
                message="1/4 step(s) outside the limit; first at step 3"),
        Outcome(Rule("entropy floor", "entropy", reduce="mean", min=1.0), "PASS", "entropy", value=2.0, lower=1.0,
                step=2, checked=4, message="mean over all steps (4 step(s))"),
        Outcome(Rule("clip high", "clip/high", max=0.1), "NO DATA", "clip/high", step=2, failing=1, checked=4,
                message=NO_DATA_MSG),
        Outcome(Rule("mismatch vs golden", "mismatch/kl_k3", abs=0.1), "ERROR", "mismatch/kl_k3", message=ERROR_MSG),
        Outcome(Rule("veto", "rollout_is/veto/seq_fraction", abs=0.1), "SKIP", "rollout_is/veto/seq_fraction",
                message=SKIP_MSG),
    ]
    return CheckReport(Path(run), outcomes, "rules.toml", baseline, seconds=1.5, notes=list(notes))
