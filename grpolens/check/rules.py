"""Check rules: what one rule says, how a rules file (TOML, or YAML when PyYAML is installed) is read.

A rule is metric × reducer × window × checks. Checks are bounds on the reduced value (or on every
step's value for ``reduce = "all"``):

``min``/``max``        absolute bounds (``entropy`` at least 0.05)
``finite``             the value must be finite
``early``              relative to the run's own first steps: ``median(first 20 %) · factor + abs``
                       (a rise, ``direction = "upper"``) or ``median / factor − abs`` (a fall)
``abs``/``rel``        against the baseline at the same step(s): ``|x − b| ≤ abs + rel·|b|``,
                       one-sided by ``direction``; a rule with no baseline given skips this part

and, for per-step rules, ``sustained = {count = C, window = W}``: a finite value outside its bounds
counts only when at least C of some W consecutive steps around it are outside too (one noisy step
of a small batch is not a trend; a NaN or ±inf always counts).

Every problem in a rules file is a :class:`~grpolens.errors.UserError` (exit 2) naming the file,
the line when it can be found, the rule (index and name) and the key.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from grpolens.errors import UserError

REDUCERS = ("all", "last", "mean", "median", "min", "max")  # and pNN, e.g. p95 or p99.9
DIRECTIONS = ("upper", "lower", "both")
MISSING = ("fail", "skip")
NO_DATA = ("fail", "allow")
RULE_KEYS = ("name", "metric", "reduce", "window", "direction", "abs", "rel", "min", "max", "finite", "early",
             "allow_fail_fraction", "sustained", "missing", "no_data", "why")
WINDOW_KEYS = ("start", "end", "last")
EARLY_KEYS = ("fraction", "steps", "factor", "abs")
SUSTAINED_KEYS = ("count", "window")
FILE_KEYS = ("rule", "baseline", "builtin_rules")
_PCT = re.compile(r"^p([0-9]{1,2}(?:\.[0-9]+)?|100)$")


@dataclass(frozen=True)
class Window:
    """Which steps a rule looks at: ``start``/``end`` (inclusive step numbers; negative counts from
    the end, -1 being the last step) or the ``last`` N steps. Empty: every step."""

    start: int | None = None
    end: int | None = None
    last: int | None = None

    def select(self, steps: Sequence[int]) -> list[int]:
        steps = sorted(steps)
        if not steps:
            return []
        if self.last is not None:
            return steps[-self.last:]
        lo = self._resolve(self.start, steps, steps[0])
        hi = self._resolve(self.end, steps, steps[-1])
        return [s for s in steps if lo <= s <= hi]

    @staticmethod
    def _resolve(bound: int | None, steps: list[int], default: int) -> int:
        if bound is None:
            return default
        if bound >= 0:
            return bound
        # -1 is the last step present, -k the k-th last; before the first step selects from the start
        return steps[len(steps) + bound] if -bound <= len(steps) else steps[0] - 1

    def describe(self) -> str:
        if self.last is not None:
            return f"last {self.last}"
        if self.start is None and self.end is None:
            return "all steps"
        return f"steps {'' if self.start is None else self.start}:{'' if self.end is None else self.end}"


@dataclass(frozen=True)
class Early:
    """Bound relative to the median of the run's own first steps (``fraction`` of them, or ``steps``)."""

    factor: float
    fraction: float = 0.2
    steps: int | None = None
    abs: float = 0.0

    def reference_steps(self, steps: Sequence[int]) -> list[int]:
        steps = sorted(steps)
        n = self.steps if self.steps is not None else max(1, math.ceil(self.fraction * len(steps)))
        return steps[:n]

    def bounds(self, m: float) -> tuple[float, float]:
        """(lower, upper) around the early median ``m``; sign-safe: for m ≥ 0 these are
        ``m / factor − abs`` and ``m · factor + abs``."""
        return m - (1 - 1 / self.factor) * abs(m) - self.abs, m + (self.factor - 1) * abs(m) + self.abs

    def reference_label(self) -> str:
        return f"first {self.steps} steps" if self.steps is not None else f"first {self.fraction:.0%}"


@dataclass(frozen=True)
class Sustained:
    """A per-step violation counts only inside a streak: ``count`` of some ``window`` consecutive steps."""

    count: int
    window: int

    def qualifying(self, outside: np.ndarray, finite: np.ndarray) -> np.ndarray:
        """Which of the steps ``outside`` their bounds count: those in a window of ``window``
        consecutive steps holding at least ``count`` outside steps, and every non-finite one."""
        n = outside.size
        w = min(self.window, n)
        hits = np.convolve(outside.astype(np.int64), np.ones(w, np.int64), mode="valid")  # per window start
        covered = np.zeros(n, bool)
        for start in np.flatnonzero(hits >= self.count):
            covered[start:start + w] = True
        return outside & (covered | ~finite)

    def describe(self) -> str:
        return f"sustained: {self.count} of {self.window} consecutive steps"


@dataclass(frozen=True)
class Rule:
    name: str
    metric: str
    reduce: str = "all"
    window: Window = field(default_factory=Window)
    direction: str = "both"
    abs: float | None = None
    rel: float | None = None
    min: float | None = None
    max: float | None = None
    finite: bool = False
    early: Early | None = None
    allow_fail_fraction: float = 0.0
    sustained: Sustained | None = None
    missing: str = "fail"
    no_data: str = "fail"  # a step without a token in the loss: "fail" (NO DATA) or "allow" (left out)
    why: str = ""

    @property
    def compares(self) -> bool:
        """Whether the rule compares against a baseline."""
        return self.abs is not None or self.rel is not None

    @property
    def absolute(self) -> bool:
        """Whether the rule has checks that need no baseline."""
        return self.min is not None or self.max is not None or self.finite or self.early is not None

    @property
    def is_glob(self) -> bool:
        return any(c in self.metric for c in "*?[")

    def describe_checks(self) -> str:
        """The checks in words, e.g. ``≤ 10× median(first 20%) + 0.05; ≤ b + (0.005 + 1·|b|)``."""
        parts = []
        if self.min is not None:
            parts.append(f"≥ {self.min:g}")
        if self.max is not None:
            parts.append(f"≤ {self.max:g}")
        if self.finite:
            parts.append("finite")
        up, low = self.direction in ("upper", "both"), self.direction in ("lower", "both")
        if self.early is not None:
            e, med = self.early, f"median({self.early.reference_label()})"
            if up:
                parts.append(f"≤ {e.factor:g}× {med} + {e.abs:g}")
            if low:
                parts.append(f"≥ {med} / {e.factor:g} − {e.abs:g}")
        if self.compares:
            tol = f"{self.abs or 0:g} + {self.rel or 0:g}·|b|"
            parts.append(f"|x − b| ≤ {tol}" if up and low else (f"≤ b + {tol}" if up else f"≥ b − ({tol})"))
        if self.sustained is not None:
            parts.append(self.sustained.describe())
        return "; ".join(parts)


@dataclass(frozen=True)
class RuleSet:
    rules: tuple[Rule, ...]
    source: str  # file path, or "built-in defaults"
    baseline: Path | None = None  # a baseline named in the rules file (relative to the file)


def reduce_values(reducer: str, values: np.ndarray) -> float:
    """One number from a window's values. NaN propagates (a NaN in the window fails the rule)."""
    if values.size == 0:
        return float("nan")
    if reducer == "last":
        return float(values[-1])
    if reducer == "mean":
        return float(np.mean(values))
    if reducer == "median":
        return float(np.median(values))
    if reducer == "min":
        return float(np.min(values))
    if reducer == "max":
        return float(np.max(values))
    m = _PCT.match(reducer)
    if m:  # np.percentile propagates NaN like the reducers above
        return float(np.percentile(values, float(m.group(1))))
    raise ValueError(f"unknown reducer {reducer!r}")


# ---------------------------------------------------------------------------------------------
# Reading rules files
# ---------------------------------------------------------------------------------------------

class _Lines:
    """Find the line of a rule (and of a key in it) in the source text, for error messages."""

    def __init__(self, text: str, kind: str):
        self.kind = kind
        self.text = text
        self.lines = text.splitlines()
        if kind == "toml":
            self.headers = [i for i, ln in enumerate(self.lines) if re.match(r"^\s*\[\[\s*rule\s*\]\]", ln)]

    def find(self, index: int | None, key: str | None = None) -> int | None:
        """1-based line of rule ``index`` (its ``key`` when given), or None when unknown."""
        if index is None:
            return self._top_key(key)
        if self.kind == "toml":
            if index >= len(self.headers):
                return None
            first = self.headers[index]
            stop = next((i for i in range(first + 1, len(self.lines)) if re.match(r"^\s*\[", self.lines[i])),
                        len(self.lines))
            if key is not None:
                pat = re.compile(rf"^\s*(?:{re.escape(key)}|\"{re.escape(key)}\")\s*=")
                for i in range(first + 1, stop):
                    if pat.match(self.lines[i]):
                        return i + 1
            return first + 1
        return self._yaml_line(index, key)

    def _top_key(self, key: str | None) -> int | None:
        if key is None:
            return None
        k = rf"(?:{re.escape(key)}|\"{re.escape(key)}\")"
        # ``key = ...`` (TOML), ``key: ...`` (YAML), or in TOML a table of that name: ``[key]``, ``[[key]]``, ``[key.sub]``
        table = rf"|^\s*\[\[?\s*{k}\s*[\].]" if self.kind == "toml" else ""
        pat = re.compile(rf"^{k}\s*[=:]{table}")
        return next((i + 1 for i, ln in enumerate(self.lines) if pat.match(ln)), None)

    def _yaml_line(self, index: int, key: str | None) -> int | None:
        try:
            import yaml

            root = yaml.compose(self.text, Loader=yaml.SafeLoader)
            seq = next(v for k, v in root.value if k.value == "rule")
            item = seq.value[index]
            if key is not None:
                for k, v in item.value:
                    if k.value == key:
                        return k.start_mark.line + 1
            return item.start_mark.line + 1
        except Exception:  # noqa: BLE001 - a line number is a courtesy
            return None


def load_rules(path: Path | str) -> RuleSet:
    """Read a rules file (``.toml``, or ``.yaml``/``.yml`` when PyYAML is installed)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--rules: no such file {path}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--rules: cannot read {path}: {e}") from None
    kind = "yaml" if path.suffix.lower() in (".yaml", ".yml") else "toml"
    return parse_rules(text, source=str(path), kind=kind, base_dir=path.parent)


def parse_rules(text: str, *, source: str = "<rules>", kind: str = "toml", base_dir: Path | None = None) -> RuleSet:
    data = _parse_text(text, source, kind)
    lines = _Lines(text, kind)

    def fail(msg: str, index: int | None = None, key: str | None = None, name: str | None = None,
             at: str | None = None) -> UserError:
        line = lines.find(index, at or key)
        where = f"{source}:{line}" if line else source
        who = "" if index is None else f"rule {index + 1}{f' ({name!r})' if name else ''}: "
        return UserError(f"{where}: {who}{f'{key}: ' if key else ''}{msg}")

    if not isinstance(data, dict):
        raise fail("expected a table with [[rule]] entries")
    for k in data:
        if k not in FILE_KEYS:
            raise fail(f"unknown top-level key{_suggest(k, FILE_KEYS)}; expected [[rule]] tables, "
                       f"'baseline' or 'builtin_rules'", key=k)
    raw_rules = data.get("rule", [])
    if not isinstance(raw_rules, list) or not all(isinstance(r, dict) for r in raw_rules):
        raise fail("'rule' must be an array of tables ([[rule]] in TOML, a list of mappings in YAML)", key="rule")
    builtin = data.get("builtin_rules", False)
    if not isinstance(builtin, bool):
        raise fail("must be true or false", key="builtin_rules")
    baseline = data.get("baseline")
    if baseline is not None and not isinstance(baseline, str):
        raise fail("must be a path (string)", key="baseline")
    if not raw_rules and not builtin:
        raise fail("no rules: add [[rule]] tables (or builtin_rules = true)")

    rules = [_parse_rule(r, i, fail) for i, r in enumerate(raw_rules)]
    builtins = list(default_rules().rules) if builtin else []
    seen = {r.name for r in builtins}  # unique among themselves: the defaults went through this loop
    for i, r in enumerate(rules):
        if r.name in seen:
            if "name" not in raw_rules[i]:  # a generated name: make it unique
                rules[i] = r = replace(r, name=f"{r.name} #{i + 1}")
            else:
                raise fail(f"duplicate rule name {r.name!r} (names must be unique: they are the test case names)",
                           index=i, key="name", name=r.name)
        seen.add(r.name)
    base = None if baseline is None else (base_dir or Path(".")) / baseline
    return RuleSet(tuple(builtins + rules), source, base)


def _parse_text(text: str, source: str, kind: str) -> Any:
    if kind == "yaml":
        try:
            import yaml
        except ImportError:
            raise UserError(f"{source}: YAML rules need PyYAML (pip install pyyaml), or write the rules in TOML") from None
        try:
            return yaml.load(text, Loader=_unique_keys_loader(yaml))  # noqa: S506 - a SafeLoader subclass
        except RecursionError:
            raise UserError(f"{source}: nested too deeply to read") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            position = getattr(e, "position", None)  # a character YAML refuses (ReaderError) has no mark
            if mark is not None:
                line = f":{mark.line + 1}"
            elif isinstance(position, int):
                line = f":{text.count(chr(10), 0, position) + 1}"
            else:
                line = ""
            msg = getattr(e, "problem", None) or str(e).splitlines()[0]  # one line: the rest names "<unicode string>"
            raise UserError(f"{source}{line}: invalid YAML: {msg}") from None
    import tomllib

    try:
        return tomllib.loads(text)
    except RecursionError:
        raise UserError(f"{source}: nested too deeply to read") from None
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"\(at line ([0-9]+), column ([0-9]+)\)", str(e))
        where = f"{source}:{m.group(1)}" if m else source
        raise UserError(f"{where}: invalid TOML: {e}") from None


def _unique_keys_loader(yaml):
    """PyYAML's SafeLoader refusing a key given twice in one mapping, as TOML does (PyYAML keeps
    the last value silently: a rule's second ``max`` would replace its first unseen)."""
    from yaml.constructor import ConstructorError

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *base' may override: YAML's own rule
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
                if first is not key_node:
                    raise ConstructorError(problem=f"duplicate key {key!r} (first at line {first.start_mark.line + 1})",
                                           problem_mark=key_node.start_mark)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeys


def _suggest(word: str, choices: Sequence[str]) -> str:
    import difflib

    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f" {word!r} (did you mean {close[0]!r}?)" if close else f" {word!r}"


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _parse_rule(raw: dict, index: int, fail) -> Rule:
    name = raw.get("name")

    def err(key: str | None, msg: str, at: str | None = None) -> UserError:
        return fail(msg, index=index, key=key, name=name if isinstance(name, str) else None, at=at)

    for k in raw:
        if k not in RULE_KEYS:
            raise err(None, f"unknown key{_suggest(k, RULE_KEYS)}; rule keys are {', '.join(RULE_KEYS)}", at=k)
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise err("name", "must be a non-empty string")
    metric = raw.get("metric")
    if not isinstance(metric, str) or not metric.strip():
        raise err("metric", "required: a metric name (canonical or any profile's alias) or a glob like 'health/nonfinite/*'")
    metric = _check_metric(metric.strip(), lambda m: err("metric", m))

    reducer = raw.get("reduce", "all")
    if not isinstance(reducer, str) or not (reducer in REDUCERS or _PCT.match(reducer)):
        raise err("reduce", f"unknown reducer {reducer!r}; use {', '.join(REDUCERS)} or pNN (p50, p95, p99.9)")
    direction = raw.get("direction", "both")
    if direction not in DIRECTIONS:
        raise err("direction", f"must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    missing = raw.get("missing", "fail")
    if missing not in MISSING:
        raise err("missing", f"must be 'fail' or 'skip', got {missing!r}")
    no_data = raw.get("no_data", "fail")
    if no_data not in NO_DATA:
        raise err("no_data", f"must be 'fail' or 'allow', got {no_data!r}")

    vals: dict[str, Any] = {}
    for k in ("abs", "rel"):
        if k in raw:
            if not _number(raw[k]) or not raw[k] >= 0 or math.isinf(raw[k]):
                raise err(k, f"must be a finite number >= 0, got {raw[k]!r}")
            vals[k] = float(raw[k])
    for k in ("min", "max"):
        if k in raw:
            if not _number(raw[k]) or math.isnan(raw[k]):
                raise err(k, f"must be a number, got {raw[k]!r}")
            vals[k] = float(raw[k])
    if "min" in vals and "max" in vals and vals["min"] > vals["max"]:
        raise err("min", f"min {vals['min']:g} is above max {vals['max']:g}")
    finite = raw.get("finite", False)
    if not isinstance(finite, bool):
        raise err("finite", f"must be true or false, got {finite!r}")
    why = raw.get("why", "")
    if not isinstance(why, str):
        raise err("why", "must be a string")

    allow = raw.get("allow_fail_fraction", 0.0)
    if not _number(allow) or not 0 <= allow < 1:
        raise err("allow_fail_fraction", f"must be a number in [0, 1), got {allow!r}")
    if allow and reducer != "all":
        raise err("allow_fail_fraction", f"only applies to reduce = \"all\" (per-step checks), not {reducer!r}")

    sustained = _parse_sustained(raw.get("sustained"), lambda m: err("sustained", m))
    if sustained is not None and reducer != "all":
        raise err("sustained", f"only applies to reduce = \"all\" (per-step checks), not {reducer!r}")

    window = _parse_window(raw.get("window"), lambda m: err("window", m))
    early = _parse_early(raw.get("early"), lambda m: err("early", m))
    if early is not None and direction == "both" and "direction" not in raw:
        raise err("direction", "an 'early' bound needs a direction: 'upper' (catch a rise) or 'lower' (catch a fall)")

    rule = Rule(
        name=name.strip() if isinstance(name, str) else f"{metric} {reducer}",
        metric=metric, reduce=reducer, window=window, direction=direction, early=early,
        finite=finite, allow_fail_fraction=float(allow), sustained=sustained, missing=missing, no_data=no_data,
        why=why.strip(), **vals,
    )
    if not (rule.compares or rule.absolute):
        raise err(None, "no check: give min, max, finite, early, or abs/rel (against the baseline)")
    return rule


def _check_metric(metric: str, err) -> str:
    """Aliases become canonical names; globs must match at least one registered metric."""
    from grpolens.metrics.registry import REGISTRY, resolve
    from grpolens.plugins import load_plugins

    load_plugins()  # profile aliases resolve too
    if any(c in metric for c in "*?["):
        if not fnmatch.filter(REGISTRY, metric):
            raise err(f"the pattern {metric!r} matches no registered metric (patterns match canonical names; "
                      f"see `grpolens metrics`)")
        return metric
    try:
        return resolve(metric).name
    except KeyError as e:
        raise err(str(e.args[0]) + " (see `grpolens metrics`)") from None


def _parse_window(raw: Any, err) -> Window:
    if raw is None:
        return Window()
    if _number(raw) and float(raw).is_integer() and raw > 0:
        return Window(last=int(raw))  # window = 20 means the last 20 steps
    if not isinstance(raw, dict):
        raise err("expected {start = A, end = B} or {last = N} (or a number N for the last N steps)")
    for k, v in raw.items():
        if k not in WINDOW_KEYS:
            raise err(f"unknown key{_suggest(k, WINDOW_KEYS)}; use start/end or last")
        if not isinstance(v, int) or isinstance(v, bool):
            raise err(f"{k} must be an integer step, got {v!r}")
    if "last" in raw:
        if len(raw) > 1:
            raise err("'last' cannot be combined with start/end")
        if raw["last"] < 1:
            raise err(f"last must be >= 1, got {raw['last']}")
        return Window(last=raw["last"])
    start, end = raw.get("start"), raw.get("end")
    if start is not None and end is not None and (start >= 0) == (end >= 0) and start > end:
        raise err(f"start {start} is after end {end}")
    return Window(start=start, end=end)


def _parse_early(raw: Any, err) -> Early | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise err("expected a table like {factor = 10, fraction = 0.2, abs = 0.001}")
    for k, v in raw.items():
        if k not in EARLY_KEYS:
            raise err(f"unknown key{_suggest(k, EARLY_KEYS)}; use factor, fraction or steps, abs")
    if "factor" not in raw:
        raise err("factor is required (e.g. factor = 10: ten times the early median)")
    factor, frac, abs_ = raw["factor"], raw.get("fraction", 0.2), raw.get("abs", 0.0)
    if not _number(factor) or not 1 <= factor < math.inf:
        raise err(f"factor must be a number >= 1, got {factor!r}")
    if "fraction" in raw and "steps" in raw:
        raise err("give fraction or steps, not both")
    if not _number(frac) or not 0 < frac <= 1:
        raise err(f"fraction must be in (0, 1], got {frac!r}")
    steps = raw.get("steps")
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise err(f"steps must be an integer >= 1, got {steps!r}")
    if not _number(abs_) or not 0 <= abs_ < math.inf:
        raise err(f"abs must be a finite number >= 0, got {abs_!r}")
    return Early(factor=float(factor), fraction=float(frac), steps=steps, abs=float(abs_))


def _parse_sustained(raw: Any, err) -> Sustained | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise err("expected a table like {count = 2, window = 4}")
    for k, v in raw.items():
        if k not in SUSTAINED_KEYS:
            raise err(f"unknown key{_suggest(k, SUSTAINED_KEYS)}; use count and window")
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise err(f"{k} must be an integer >= 1, got {v!r}")
    if set(raw) != set(SUSTAINED_KEYS):
        raise err("give both count and window (e.g. {count = 2, window = 4}: 2 of any 4 consecutive steps)")
    if raw["count"] > raw["window"]:
        raise err(f"count {raw['count']} is larger than window {raw['window']}")
    return Sustained(count=raw["count"], window=raw["window"])


@lru_cache(maxsize=1)
def default_rules() -> RuleSet:
    """The built-in rules (:mod:`grpolens.check.defaults`), parsed once."""
    from grpolens.check.defaults import DEFAULT_RULES_TOML, DEFAULTS_SOURCE

    return parse_rules(DEFAULT_RULES_TOML, source=DEFAULTS_SOURCE)
