"""The metric registry: one entry per metric, the single source for names, docs and reducers.

A :class:`Metric` says *what* is computed (its definition, the partial columns it reduces, the
config keys and token columns it depends on) and *under which name* each trainer profile logs it.
Built-in families register here exactly as a plugin would (``register(Metric(...))``);
``grpolens metrics`` and ``docs/metrics.md`` are generated from this table, and a test fails when a
metric has no doc.

Reduction kinds (how a step value comes out of the per-sequence partial table, see
:mod:`grpolens.metrics.reduce`):

``token_mean``   Σ num / Σ den over the step's sequences (den: a token count)
``seq_mean``     mean over sequences of a per-sequence value ``num`` (sequences with den > 0)
``max``/``min``  extreme of partial column ``num`` over the step
``seq_frac_min``/``seq_frac_max``  extreme over sequences of num/den (TRL's low_min/high_max)
``sum``          Σ num
``custom``       ``fn(ctx) -> float | None`` for anything else (losses, reward quantiles, ...)

Templates: some metrics exist once per *sample column* whose name is only known from the run
(``reward/<name>``, one per reward function). Such a metric is registered once as a template with
``per_column="reward/"`` and :data:`PLACEHOLDER` in its name and profile names
(``rewards/<name>/mean``); the catalogue lists the template, and :meth:`Metric.expand` turns it
into one ordinary custom metric per matching column of the run (``rewards/accuracy/mean``, whose
``fn(sd)`` is the template's ``fn(sd, "reward/accuracy")``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Iterable

from grpolens.metrics.profile import PROFILES, Profile  # noqa: F401  (re-exported: the profile registry)

KINDS = ("token_mean", "seq_mean", "max", "min", "seq_frac_min", "seq_frac_max", "sum", "custom")
#: Stands for the column-derived part of a template metric's names (see the module doc).
PLACEHOLDER = "<name>"


@dataclass(frozen=True)
class Metric:
    name: str
    family: str
    doc: str
    kind: str
    num: str | None = None
    den: str | None = None
    fn: Callable[..., Any] | None = None
    #: token/sample columns the metric needs; absent from the run -> metric is skipped (said once)
    requires: tuple[str, ...] = ()
    #: config keys the value depends on (documentation and cache invalidation)
    config: tuple[str, ...] = ()
    #: profile -> the name that profile logs it under; a profile without an entry does not log it.
    #: Built-in metrics leave it empty: each profile's table (``grpolens/profiles/<trainer>.py``)
    #: fills it when the profile is applied (:func:`apply_profiles`).
    names: dict[str, str] = field(default_factory=dict)
    #: config predicate: the metric exists only when it returns True (e.g. clip metrics not under CISPO)
    when: Callable[[dict], bool] | None = None
    #: where the value comes from: "tokens" (per-token shards) or "samples"
    source: str = "tokens"
    #: the logged value is the running total over steps (TRL's ``num_tokens``)
    cumulative: bool = False
    #: template over sample columns with this prefix (e.g. "reward/"); ``fn(sd, column)``
    per_column: str | None = None
    #: for a metric expanded from a template: the template's name and the column it is over
    template: str | None = None
    column: str | None = None
    #: a tokens metric whose value also reads the step's samples (a recompute restricted to
    #: tokens metrics that do not skips reading the samples)
    reads_samples: bool = False

    def needs_samples(self, prof) -> bool:
        """Whether its value under profile ``prof`` (a Profile) reads the step's samples."""
        return self.source == "samples" or self.reads_samples or (self.template or self.name) in prof.generation_only

    def name_in(self, profile: str) -> str | None:
        """The name profile ``profile`` logs this metric under (None: it does not log it); the one
        answer to that question, templates' expansions included."""
        prof = PROFILES.get(profile)
        if profile == "grpolens" or (prof is not None and prof.canonical):
            return self.name
        return self.names.get(profile)

    def applies(self, cfg: dict) -> bool:
        return self.when is None or bool(self.when(cfg))

    def expand(self, columns: Iterable[str]) -> list[Metric]:
        """The concrete metrics of a run: a template gives one per column ``per_column + key``
        among ``columns`` (sorted by key; none when the run has no such column), with
        :data:`PLACEHOLDER` replaced by ``key`` in its names and ``requires``; any other metric is
        itself."""
        if self.per_column is None:
            return [self]
        keys = sorted({c[len(self.per_column):] for c in columns if c.startswith(self.per_column)} - {""})
        return [
            replace(self, name=self.name.replace(PLACEHOLDER, k), per_column=None,
                    names={p: n.replace(PLACEHOLDER, k) for p, n in self.names.items()},
                    requires=tuple(r.replace(PLACEHOLDER, k) for r in self.requires),
                    fn=partial(self.fn, column=self.per_column + k),
                    template=self.name, column=self.per_column + k)
            for k in keys
        ]


#: The dashboard's curve pages; every family is on one of them.
PAGES = ("policy", "mismatch", "rewards", "health")


@dataclass(frozen=True)
class Family:
    """What the applications need to know about a family, declared next to its formulas."""

    name: str
    #: the dashboard curve page its metrics are drawn on (one of :data:`PAGES`)
    page: str
    #: metrics the ``recompute`` summary shows by default: what says first whether a run is healthy
    key_metrics: tuple[str, ...] = ()
    #: dashboard overview slots it fills: ``(place, label, patterns)``; the first column matching
    #: a pattern (a regular expression, tried in order) in any selected run fills the slot
    overview: tuple[tuple[int, str, tuple[str, ...]], ...] = ()
    #: its built-in ``grpolens check`` rules, as TOML ``[[rule]]`` tables
    rules: str = ""

    def __post_init__(self):
        if self.page not in PAGES:
            raise ValueError(f"family {self.name}: page must be one of {', '.join(PAGES)}, got {self.page!r}")


#: family name -> its metadata, in registration order
FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    if family.name in FAMILIES and FAMILIES[family.name] != family:
        raise ValueError(f"family {family.name} registered twice")
    FAMILIES[family.name] = family
    return family


REGISTRY: dict[str, Metric] = {}
#: name -> the module that registered it; load_families orders the registry by module so that
#: catalogues and output columns do not depend on which module a caller happened to import first
_ORIGIN: dict[str, str] = {}


def register(metric: Metric) -> Metric:
    if metric.kind not in KINDS:
        raise ValueError(f"metric {metric.name}: unknown kind {metric.kind!r}")
    if metric.kind == "custom" and metric.fn is None:
        raise ValueError(f"metric {metric.name}: custom metrics need fn")
    if metric.kind != "custom" and metric.num is None:
        raise ValueError(f"metric {metric.name}: kind {metric.kind} needs num")
    if metric.name in REGISTRY:
        raise ValueError(f"metric {metric.name} registered twice")
    if metric.per_column is not None and (
            metric.kind != "custom" or not all(PLACEHOLDER in n for n in (metric.name, *metric.names.values()))):
        raise ValueError(f"metric {metric.name}: a template must be custom and have {PLACEHOLDER} in every name")
    REGISTRY[metric.name] = metric
    _ORIGIN[metric.name] = sys._getframe(1).f_globals.get("__name__", "")
    return metric


def load_families() -> dict[str, Metric]:
    """Import every built-in family module (each registers its metrics on import).

    Only the metrics layer: profiles, visitors and third-party plugins are loaded by
    :func:`grpolens.plugins.load_plugins`, which calls this first."""
    from grpolens.metrics import FAMILY_MODULES
    import importlib

    for mod in FAMILY_MODULES:
        importlib.import_module(f"grpolens.metrics.{mod}")
    rank = {f"grpolens.metrics.{m}": i for i, m in enumerate(FAMILY_MODULES)}

    def family_rank(origin: str) -> int:  # a family that is a package registers from its modules
        return rank.get(".".join(origin.split(".")[:3]), len(rank))

    items = sorted(enumerate(REGISTRY.items()), key=lambda t: (family_rank(_ORIGIN.get(t[1][0], "")), t[0]))
    REGISTRY.clear()
    REGISTRY.update(kv for _, kv in items)
    return REGISTRY


def apply_profiles() -> None:
    """Give every registered metric its name in each registered profile (``Metric.names``).

    A profile's table may only name registered metrics, and a template's name must keep
    :data:`PLACEHOLDER`; a metric that declares its own name for a profile must agree with it."""
    for prof in PROFILES.values():
        if prof.canonical:
            continue
        unknown = sorted(set(prof.names) - set(REGISTRY))
        if unknown:
            raise ValueError(f"profile {prof.name}: names unknown metrics {unknown[:5]}")
        for key in set(prof.reductions) | set(prof.zero_when_empty) | set(prof.generation_only):
            if key not in prof.names:
                raise ValueError(f"profile {prof.name}: {key} has a rule but no name in the profile")
        for canonical, logged in prof.names.items():
            m = REGISTRY[canonical]
            if m.per_column is not None and PLACEHOLDER not in logged:
                raise ValueError(f"profile {prof.name}: template {canonical} needs {PLACEHOLDER} in {logged!r}")
            if m.names.get(prof.name, logged) != logged:
                raise ValueError(f"profile {prof.name}: {canonical} is named {logged!r} and {m.names[prof.name]!r}")
            if m.names.get(prof.name) != logged:
                REGISTRY[canonical] = replace(m, names={**m.names, prof.name: logged})


def resolve(name: str) -> Metric:
    """Find a metric by canonical name or by any profile's name for it (``kl``, ``train/entropy``...).

    Raises KeyError listing close matches when nothing fits.
    """
    load_families()
    if name in REGISTRY:
        return REGISTRY[name]
    hits = [m for m in REGISTRY.values() if name in m.names.values()]
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        # The same trainer name used by two profiles for different quantities: prefer the first
        # profile in PROFILES order that uses it, which is deterministic and documented.
        for p in PROFILES:
            for m in hits:
                if m.names.get(p) == name:
                    return m
    for m in REGISTRY.values():  # a concrete name of a template: rewards/accuracy/mean
        if m.per_column is None:
            continue
        for pattern in (m.name, *m.names.values()):
            head, _, tail = pattern.partition(PLACEHOLDER)
            if name.startswith(head) and name.endswith(tail) and len(name) > len(head) + len(tail):
                key = name[len(head):len(name) - len(tail)]
                return m.expand([m.per_column + key])[0]
    import difflib

    # each name once: a metric's canonical name is usually a profile's name for it too
    every = list(dict.fromkeys([*REGISTRY, *(n for m in REGISTRY.values() for n in m.names.values())]))
    close = difflib.get_close_matches(name, every, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise KeyError(f"unknown metric {name!r}{hint}")
