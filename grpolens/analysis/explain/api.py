"""``explain(run, metric, step)``: why a metric moved, as exact contributions of token ids,
completions, prompts, positions, lengths, ranks, micro-batches and outcomes."""

from __future__ import annotations

import difflib
import os
from typing import Any, Iterable

import numpy as np

from grpolens.analysis.explain import decompose, dimensions, reductions
from grpolens.analysis.explain.model import Explanation
from grpolens.analysis.explain.terms import SampleIndex, StepTerms, read_step, sum_merged, token_additive
from grpolens.errors import UserError

Baseline = int | tuple[int, int] | None


def explain(run: os.PathLike | str, metric: str, step: int, *, baseline: Baseline = None,
            by: Iterable[str] | None = None, profile: str = "grpolens", top: int = 10,
            storage_options: dict[str, str] | None = None) -> Explanation:
    """Decompose ``value(step) − baseline`` of ``metric`` (a grpolens name or ``profile``'s name
    for it) exactly along the dimensions ``by`` (all that apply when None; see
    :data:`~grpolens.analysis.explain.dimensions.DIMENSIONS`).

    ``baseline``: None for the previous step, a step, or an inclusive ``(a, b)`` range whose
    mean is the baseline. ``top``: keys listed per dimension before the rest is summed as
    ``"other"``. A metric whose reduction is not decomposable gets an :class:`Explanation` with a
    ``note`` saying what can be said; bad input raises :class:`UserError` naming it.
    """
    from grpolens import plugins
    from grpolens.analysis.recompute import metrics_for
    from grpolens.run import format as fmt
    from grpolens.run.reader import RunReader

    if top < 1:
        raise UserError(f"--top must be >= 1, got {top}")
    dims = _dimensions(by)
    reader = RunReader(run, storage_options)
    reader.check()
    try:
        prof = plugins.get(profile)
    except UserError:
        raise
    cfg = reader.config()
    if prof.log_schedule is not None:  # the trainer's release rules (TRL: defaults by version)
        _, cfg = prof.log_schedule(reader, cfg, None, None)
    m = _metric(metric, metrics_for(prof, cfg, reader.sample_columns()), profile)
    steps = reader.steps(fmt.TOKENS) if m.source == "tokens" else reader.steps(fmt.SAMPLES)
    if m.source == "tokens" and m.requires:
        _check_requires(reader, m, steps)
    _check_step(step, steps, "--step")
    base_steps = _baseline_steps(baseline, step, steps)
    shown = m.name_in(profile) or m.name

    index = SampleIndex(reader)
    fams = frozenset({m.family})
    t_s = read_step(reader, step, cfg, prof, fams, index)
    t_b = [read_step(reader, b, cfg, prof, fams, index) for b in base_steps]
    v_s = reductions.value(m, t_s.sd)
    v_bs = [reductions.value(m, t.sd) for t in t_b]
    if any(v is None for v in v_bs):
        missing = [t.step for t, v in zip(t_b, v_bs) if v is None]
        raise UserError(f"--baseline: {shown} has no value at step {missing[0]}; choose another baseline step")
    v_b = float(np.mean(v_bs)) if v_bs else (0.0 if v_s is not None else None)
    delta = None if v_s is None else v_s - v_b
    e = Explanation(shown, step, v_s, base_steps, v_b if base_steps else None, delta, profile=profile)
    if not base_steps:
        e.notes.append(f"step {step} is the run's first: its value itself is decomposed")
    if v_s is None:
        e.note = f"{shown} has no value at step {step} (nothing to average)"
        return e
    forms = [reductions.linearize(m, t.sd, v) for t, v in zip([t_s, *t_b], [v_s, *v_bs])]
    if forms[0] == "samples":
        forms = [reductions.linearize_samples(m, t.sd, v) for t, v in zip([t_s, *t_b], [v_s, *v_bs])]
        if isinstance(forms[0], str):
            e.note = forms[0].replace(m.name, shown)
            said = reductions.samples_answer(m, t_s.sd.samples, v_s, step, shown) if t_s.sd.samples is not None else None
            if said is not None:
                e.note, unit = said
                if unit is not None:
                    e.extremum = {"step": unit, "baseline": [
                        (reductions.samples_answer(m, t.sd.samples, v, t.step, shown) or (None, None))[1]
                        for t, v in zip(t_b, v_bs) if t.sd.samples is not None]}
            return e
        return _explain_samples(e, [t_s, *t_b], forms, dims, by, top, delta, index)
    if isinstance(forms[0], str):
        e.note = forms[0].replace(m.name, shown)
        return e
    if isinstance(forms[0], reductions.Extremum):
        _explain_extremum(e, m, [t_s, *t_b], forms, reader)
        return e
    if not all(isinstance(f, reductions.Linear) and f.num == forms[0].num for f in forms):
        e.note = f"{shown} is not reduced the same way at step {step} and its baseline: no exact decomposition"
        return e
    units, level = _units([t_s, *t_b], forms)
    e.units = level
    if level == "sequences" and any(d in dimensions.TOKEN_ONLY for d in dims) and by is not None:
        e.notes.append(f"{shown} is not a sum of per-token terms ({forms[0].num} is computed per sequence): "
                       "token_id and position do not apply")
    decode = _decoder(reader) if "token_id" in dims and level == "tokens" else None
    per_seq = [u.per_sequence(t.n_seq) for u, t in zip(units, [t_s, *t_b])]
    for dim in dims:
        # a sequence's property: its tokens summed first (the same sums, far fewer units)
        on_seq = dim not in dimensions.TOKEN_ONLY
        keyed = [(dimensions.seq_keys(t, dim) if on_seq else _keys(t, dim, level)) for t in [t_s, *t_b]]
        if any(k is None for k in keyed):
            if by is not None:
                e.notes.append(_why_not(dim, level))
            continue
        us = per_seq if on_seq else units
        tab = decompose.table((us[0], keyed[0]), list(zip(us[1:], keyed[1:])))
        e.by[dim] = _entries(tab, dim, delta, top, dimensions.labeller(dim, decode), t_s, us[0], keyed[0])
    e.concentration = decompose.concentration(units[0], t_s.n_seq)
    return e


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------

def _dimensions(by: Iterable[str] | None) -> tuple[str, ...]:
    if by is None:
        return dimensions.DIMENSIONS
    items = [d.strip() for spec in ([by] if isinstance(by, str) else by) for d in str(spec).split(",") if d.strip()]
    for d in items:
        if d not in dimensions.DIMENSIONS:
            close = difflib.get_close_matches(d, dimensions.DIMENSIONS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UserError(f"--by: unknown dimension {d!r}{hint}; choose from {', '.join(dimensions.DIMENSIONS)}")
    if not items:
        raise UserError(f"--by: no dimension given; choose from {', '.join(dimensions.DIMENSIONS)}")
    return tuple(dict.fromkeys(items))


def _metric(name: str, metrics: list, profile: str):
    from grpolens.metrics.registry import resolve

    for m in metrics:
        if name in (m.name, m.name_in(profile)):
            return m
    try:
        known = resolve(name)
    except KeyError as err:
        names = list(dict.fromkeys([*(m.name_in(profile) or m.name for m in metrics), *(m.name for m in metrics)]))
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see grpolens metrics"
        raise UserError(f"--metric: unknown metric {name!r}{hint}") from err
    raise UserError(f"--metric: {known.name} does not apply to this run under profile {profile!r} "
                    "(its config turns it off, or the profile does not log it)")


def _check_requires(reader, m, steps: list[int]) -> None:
    from grpolens.run import format as fmt
    import pyarrow.parquet as pq

    shards = reader.shards(fmt.TOKENS, steps[-1:]) if steps else []
    if not shards:
        return
    names = set(pq.read_schema(fmt.parquet_source(shards[0].path)).names)
    missing = [c for c in m.requires if c not in names]
    if missing:
        raise UserError(f"--metric: {m.name} needs the token column {missing[0]}, which the run does not have")


def _check_step(step: int, steps: list[int], option: str) -> None:
    if step in steps:
        return
    if not steps:
        raise UserError(f"{option}: the run has no steps with data for this metric")
    near = sorted(steps, key=lambda s: (abs(s - step), s))[:3]
    raise UserError(f"{option}: the run has no step {step} (it has steps {steps[0]}..{steps[-1]}; "
                    f"nearest: {', '.join(map(str, sorted(near)))})")


def _baseline_steps(baseline: Baseline, step: int, steps: list[int]) -> list[int]:
    if baseline is None:
        earlier = [s for s in steps if s < step]
        return earlier[-1:]
    if isinstance(baseline, tuple):
        a, b = baseline
        if a > b:
            raise UserError(f"--baseline: start {a} is after end {b}")
        sel = [s for s in steps if a <= s <= b]
        if not sel:
            raise UserError(f"--baseline: no step of the run falls in {a}:{b} (it has steps {steps[0]}..{steps[-1]})")
        return sel
    _check_step(int(baseline), steps, "--baseline")
    return [int(baseline)]


def parse_baseline(text: str | None) -> Baseline:
    """``--baseline``: ``S0`` or ``A:B`` (inclusive); None/empty for the previous step."""
    if text is None or not str(text).strip():
        return None
    text = str(text).strip()
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            return int(a), int(b)
        return int(text)
    except ValueError:
        raise UserError(f"--baseline: expected a step S0 or a range A:B of integer steps, got {text!r}") from None


# ---------------------------------------------------------------------------------------------
# Units and keys
# ---------------------------------------------------------------------------------------------

def _units(terms: list[StepTerms], forms: list) -> tuple[list[decompose.Units], str]:
    """Each step's units: tokens when the numerator column is the sum of its tokens' terms at
    every step, else sequences."""
    num = forms[0].num
    by_token = all(t.tokens and num in t.tokens and token_additive(t.sd.seqs[num], t.tokens[num], t.tokens["seq"], t.n_seq)
                   for t in terms)
    out = []
    for t, f in zip(terms, forms):
        weight_col = next((c for c in f.others if sum_merged(c) and (not by_token or (
            c in t.tokens and token_additive(t.sd.seqs[c], t.tokens[c], t.tokens["seq"], t.n_seq)))), None)
        if by_token:
            tok = t.tokens
            a = f.g[tok["seq"]] * tok[num]
            w = tok[weight_col] if weight_col else tok["mask"].astype(np.float64)
            out.append(decompose.Units(np.where(np.isfinite(a), a, 0.0), np.abs(w), tok["seq"]))
        else:
            a = f.g * t.sd.seqs[num]
            w = t.sd.seqs[weight_col] if weight_col else np.ones(t.n_seq)
            out.append(decompose.Units(np.where(np.isfinite(a), a, 0.0), np.abs(w)))
    return out, "tokens" if by_token else "sequences"


def _keys(t: StepTerms, dim: str, level: str) -> np.ndarray | None:
    if level == "tokens":
        return dimensions.token_keys(t, dim)
    if dim in dimensions.TOKEN_ONLY:
        return None
    return dimensions.seq_keys(t, dim)


def _why_not(dim: str, level: str) -> str:
    if dim in dimensions.TOKEN_ONLY and level == "sequences":
        return f"{dim}: the metric's terms are per sequence"
    if dim == "token_id":
        return "token_id: the run stores no token ids"
    if dim == "group":
        return "group: the run's samples do not name the completions' prompt groups"
    if dim == "outcome":
        return "outcome: the run's samples hold no rewards"
    return f"{dim}: not available for this run"


def _entries(tab: decompose.Table, dim: str, delta: float, top: int, label, t: StepTerms,
             u: decompose.Units, keys: np.ndarray) -> list[dict[str, Any]]:
    order = decompose.ranked(tab, delta)
    head, rest = order[:top], order[top:]
    out = []
    for i in head:
        k = int(tab.keys[i])
        entry = _entry(dimensions.json_key(dim, k), label(k), tab, [i], delta)
        _where(entry, t, u, keys == k)
        out.append(entry)
    if len(rest):
        out.append(_entry("other", f"{len(rest)} other key{'s' if len(rest) != 1 else ''}", tab, rest, delta))
    return out


def _entry(key, label: str, tab: decompose.Table, idx, delta: float) -> dict[str, Any]:
    idx = np.asarray(idx)
    c = float(tab.contribution[idx].sum())
    split = not np.isnan(tab.mix[idx]).any()
    return {
        "key": key,
        "label": label,
        "contribution": c,
        "share": c / delta if delta else None,
        "mix": float(tab.mix[idx].sum()) if split else None,
        "rate": float(tab.rate[idx].sum()) if split else None,
        "count": int(tab.count[idx].sum()),
        "present": _present(tab, idx),
    }


def _present(tab: decompose.Table, idx: np.ndarray) -> str:
    """Where the keys are: "both" steps, only the explained "step", only the "baseline"."""
    s, b = tab.in_step[idx].any(), tab.in_base[idx].any()
    return "both" if s and b else "step" if s else "baseline" if b else "neither"


def _where(entry: dict[str, Any], t: StepTerms, u: decompose.Units, sel: np.ndarray) -> None:
    """The completions and prompt groups of step S the key's counted units lie in."""
    sel = sel & u.counted
    seqs = np.unique(u.seq[sel]) if u.seq is not None else np.flatnonzero(sel)
    entry["completions"] = int(len(seqs))
    if t.group is not None and len(seqs):
        g = t.group[seqs]
        entry["groups"] = int(len(np.unique(g[g >= 0])))


def _decoder(reader):
    from grpolens.run.decode import make_decoder

    decode, source = make_decoder(reader.path, reader.manifest.resolved_config())
    return None if source == "ids" else decode


def _explain_samples(e: Explanation, terms: list[StepTerms], forms: list, dims, by, top: int, delta: float,
                     index: SampleIndex) -> Explanation:
    """A metric of the samples table: the units are the completions generated at each step."""
    if not all(isinstance(f, reductions.Linear) and f.num == forms[0].num for f in forms):
        e.note = f"{e.metric} is not reduced the same way at step {e.step} and its baseline: no exact decomposition"
        return e
    e.units = "completions"
    units, keyed_by = [], []
    for t, f in zip(terms, forms):
        x = t.sd.samples[f.num].cast(float).fill_null(float("nan")).to_numpy().astype(np.float64)
        a = np.where(np.isfinite(x), f.g * np.where(np.isfinite(x), x, 0.0), 0.0)
        units.append(decompose.Units(a, np.isfinite(x).astype(np.float64)))
        keyed_by.append(dimensions.sample_keys(t.sd.samples))
    for dim in dims:
        keyed = [k.get(dim) for k in keyed_by]
        if any(k is None for k in keyed):
            if by is not None:
                e.notes.append(f"{dim}: not a property of a completion's row in the samples table")
            continue
        tab = decompose.table((units[0], keyed[0]), list(zip(units[1:], keyed[1:])))
        sub = StepTerms(terms[0].step, terms[0].sd, group=keyed_by[0].get("group"))
        e.by[dim] = _entries(tab, dim, delta, top, dimensions.labeller(dim, None), sub, units[0], keyed[0])
    e.concentration = decompose.concentration(units[0], len(units[0].terms))
    return e


# ---------------------------------------------------------------------------------------------
# Extrema
# ---------------------------------------------------------------------------------------------

def _explain_extremum(e: Explanation, m, terms: list[StepTerms], forms: list, reader) -> None:
    decode = _decoder(reader)
    units = []
    for t, f in zip(terms, forms):
        units.append(_argmax_unit(t, f, decode) if isinstance(f, reductions.Extremum) else None)
    e.extremum = {"step": units[0], "baseline": units[1:]}
    u = units[0]
    where = f"sample {u['sample_id']} (rank {u['rank']}, micro-batch {u['micro_batch']})"
    if u.get("pos") is not None:
        where = f"token `{u['label']}` at position {u['pos']} of {where}"
    e.note = f"{e.metric} is the step's {forms[0].which}imum, attained by {where}"


def _argmax_unit(t: StepTerms, f: reductions.Extremum, decode) -> dict[str, Any]:
    s = t.sd.seqs
    out: dict[str, Any] = {"step": t.step, "rank": int(s["rank"][f.seq]), "micro_batch": int(s["micro_batch"][f.seq]),
                           "sample_id": int(s["sample_id"][f.seq]), "column": f.column,
                           "value": float(s[f.column][f.seq])}
    tok = t.tokens
    if tok and f.column in tok:
        idx = np.flatnonzero(tok["seq"] == f.seq)
        col = tok[f.column][idx]
        if len(idx) and np.isfinite(col).any():
            j = idx[int(np.nanargmax(col) if f.which == "max" else np.nanargmin(col))]
            if tok[f.column][j] == s[f.column][f.seq]:  # the token's own term is the sequence's extreme
                tid = int(tok["token_id"][j])
                out.update(pos=int(tok["pos"][j]), token_id=tid,
                           label=(decode(tid) if decode is not None and tid >= 0 else f"⟨{tid}⟩"))
    return out
