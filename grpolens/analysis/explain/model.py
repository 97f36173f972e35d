"""The answer: :class:`Explanation`, its ``--json`` object and its one-line headline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpolens.text import printable

#: Dimension whose top keys the headline names, in order of preference.
HEADLINE_DIMS = ("token_id", "group", "completion")
#: below this share for the top key of every headline dimension, a change is called spread
SPREAD = 0.1


@dataclass
class Explanation:
    metric: str
    step: int
    value: float | None
    baseline_steps: list[int]
    baseline_value: float | None
    delta: float | None
    #: dimension -> entries (top keys, then "other"), each {"key", "label", "contribution",
    #: "share", "mix", "rate", "count", ...}
    by: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    concentration: dict[str, float | None] = field(default_factory=dict)
    #: why the value is not (fully) decomposed, in one line; None when it is
    note: str | None = None
    #: notes that do not stop the decomposition (a dimension the run cannot say, ...)
    notes: list[str] = field(default_factory=list)
    #: "tokens" or "sequences": what the terms are; None without a decomposition
    units: str | None = None
    #: an extremum's arg-max unit at the step and at each baseline step
    extremum: dict[str, Any] | None = None
    profile: str = "grpolens"

    def to_dict(self) -> dict[str, Any]:
        """The ``grpolens explain --json`` object (keys in docs/explain.md)."""
        out: dict[str, Any] = {
            "metric": self.metric,
            "step": self.step,
            "value": self.value,
            "baseline": {"steps": list(self.baseline_steps), "value": self.baseline_value},
            "delta": self.delta,
            "by": self.by,
            "concentration": self.concentration,
            "profile": self.profile,
            "units": self.units,
        }
        if self.note is not None:
            out["note"] = self.note
        if self.notes:
            out["notes"] = list(self.notes)
        if self.extremum is not None:
            out["extremum"] = self.extremum
        return out

    # -- one line ---------------------------------------------------------------------------
    def baseline_text(self) -> str:
        b = self.baseline_steps
        if not b:
            return "no earlier step"
        if len(b) == 1:
            return f"vs step {b[0]}"
        return f"vs mean of steps {b[0]}–{b[-1]}"

    def headline(self, k: int = 3) -> str:
        """One line: the value, its move, and the ``k`` largest contributors, e.g.
        ``kl/k3 0.021 at step 300 (+0.018 vs step 299): 71 % from token `<|im_end|>` in 12
        completions of 3 prompts; ...``."""
        head = f"{self.metric} {_num(self.value)} at step {self.step}"
        if self.delta is not None and self.baseline_steps:
            head += f" ({_signed(self.delta)} {self.baseline_text()})"
        if self.note is not None:
            return f"{head}: {self.note}"
        parts = []
        for dim in HEADLINE_DIMS:
            entries = [e for e in self.by.get(dim, []) if e["key"] != "other"]
            if entries:
                parts = [_phrase(dim, e, self.step) for e in entries[:k]]
                break
        if not parts:
            return head
        tops = [abs(e["share"]) for d in HEADLINE_DIMS for e in self.by.get(d, [])[:1]
                if e["key"] != "other" and e.get("share") is not None]
        if tops and max(tops) < SPREAD:
            # no token id, prompt or completion stands out: say so before the largest ones
            return f"{head}: spread, no token id, prompt or completion above {SPREAD:.0%}; largest: {'; '.join(parts)}"
        return f"{head}: {'; '.join(parts)}"


def _phrase(dim: str, e: dict[str, Any], step: int) -> str:
    share = e.get("share")
    pct = f"{abs(100 * share) if abs(share) < 0.005 else 100 * share:.0f} %" if share is not None else _signed(e["contribution"])
    label = printable(str(e["label"]), keep_newlines=False)
    if dim == "token_id":
        where = ""
        if e.get("completions") == 0:
            where = f" (absent at step {step})"
        elif e.get("completions") is not None:
            where = f" in {e['completions']} completion{'s' if e['completions'] != 1 else ''}"
            if e.get("groups"):
                where += f" of {e['groups']} prompt{'s' if e['groups'] != 1 else ''}"
        return f"{pct} from token `{label}`{where}"
    if dim == "group":
        n = e.get("completions")
        if n == 0:
            return f"{pct} from prompt {label} (absent at step {step})"
        return f"{pct} from prompt {label}" + (f" ({n} completion{'s' if n != 1 else ''})" if n is not None else "")
    return f"{pct} from {label}"


def _num(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.4g}"


def _signed(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:+.3g}"
