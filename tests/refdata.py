"""Random padded loss calls, a plain writer for them, and reference reductions.

Metric tests build data as *padded* arrays (B, T) per loss call -- the shape trainers hold --
compute the published formula on those arrays with numpy, and compare with what grpolens
recomputes from a run written to disk. The run is written here directly with pyarrow (not with
grpolens' writer), so the writer and the engine are tested independently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq

from grpolens.run import format as fmt


@dataclass
class LossCall:
    step: int
    rank: int
    micro_batch: int
    sample_ids: np.ndarray          # (B,)
    lengths: np.ndarray             # (B,) stored tokens per row; positions >= length are padding
    logp: np.ndarray                # (B, T) float32 values held in float64
    mask: np.ndarray                # (B, T) bool, False beyond length
    advantages: np.ndarray          # (B,)
    old: np.ndarray | None = None
    ref: np.ndarray | None = None
    rollout: np.ndarray | None = None
    entropy: np.ndarray | None = None
    token_ids: np.ndarray | None = None

    @property
    def valid(self) -> np.ndarray:
        """Stored (non-padding) positions."""
        T = self.logp.shape[1]
        return np.arange(T)[None, :] < self.lengths[:, None]

    @property
    def adv_tok(self) -> np.ndarray:
        return np.broadcast_to(self.advantages[:, None], self.logp.shape)


def f32(x):
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def random_calls(
    rng: np.random.Generator,
    steps=(0, 1),
    ranks=2,
    micro_batches=2,
    batch=4,
    max_len=9,
    old=True,
    ref=True,
    rollout=True,
    entropy=True,
    spread=0.3,
    nonfinite=0.0,
    all_masked_row=True,
    zero_adv=True,
    single_token=True,
) -> list[LossCall]:
    """Ragged random loss calls with the edge cases metric tests need."""
    calls = []
    sid = 0
    for step in steps:
        for rank in range(ranks):
            for mb in range(micro_batches):
                B, T = batch, max_len
                lengths = rng.integers(1, T + 1, size=B)
                if single_token:
                    lengths[0] = 1
                logp = f32(-rng.exponential(1.0, size=(B, T)))
                valid = np.arange(T)[None, :] < lengths[:, None]
                mask = valid & (rng.random((B, T)) > 0.15)
                if all_masked_row and B > 1:
                    mask[1] = False
                adv = f32(rng.normal(size=B))
                if zero_adv and B > 2:
                    adv[2] = 0.0
                c = LossCall(step, rank, mb, np.arange(sid, sid + B), lengths, logp, mask, adv)
                sid += B
                # log-probabilities are <= 0 (the run format refuses positive ones): near logp, folded
                if old:
                    c.old = f32(-np.abs(logp + rng.normal(scale=spread, size=(B, T))))
                if ref:
                    c.ref = f32(-np.abs(logp + rng.normal(scale=spread, size=(B, T))))
                if rollout:
                    c.rollout = f32(-np.abs((c.old if old else logp) + rng.normal(scale=spread / 3, size=(B, T))))
                if entropy:
                    c.entropy = f32(rng.uniform(0.0, 3.0, size=(B, T)))
                c.token_ids = rng.integers(0, 50, size=(B, T))
                if nonfinite > 0:
                    for arr in (c.logp, c.old, c.ref, c.rollout, c.entropy):
                        if arr is not None:
                            bad = rng.random((B, T)) < nonfinite
                            arr[bad] = rng.choice([np.nan, np.inf, -np.inf], size=bad.sum())
                calls.append(c)
    return calls


def shift_logprobs(c: LossCall, by: float) -> LossCall:
    """Every log-prob of the call (logp, old, ref, rollout) lowered by ``by``: ratios, KL and IS
    weights see differences only, so a fixture can make room below 0 (a run never holds a positive
    log-prob) for values it then sets relative to the others."""
    for name in ("logp", "old", "ref", "rollout"):
        arr = getattr(c, name)
        if arr is not None:
            setattr(c, name, f32(arr - by))
    return c


def call_table(c: LossCall) -> pa.Table:
    v = c.valid
    B, T = c.logp.shape
    rows = np.nonzero(v)
    n = len(rows[0])
    cols = {
        "step": pa.array(np.full(n, c.step), pa.int64()),
        "rank": pa.array(np.full(n, c.rank), pa.int32()),
        "micro_batch": pa.array(np.full(n, c.micro_batch), pa.int32()),
        "sample_id": pa.array(c.sample_ids[rows[0]], pa.int64()),
        "pos": pa.array(rows[1], pa.int32()),
        "logp": pa.array(c.logp[rows], pa.float32()),
    }
    if c.token_ids is not None:
        cols["token_id"] = pa.array(c.token_ids[rows], pa.int32())
    for name, arr in (("old_logp", c.old), ("ref_logp", c.ref), ("rollout_logp", c.rollout)):
        if arr is not None:
            cols[name] = pa.array(arr[rows], pa.float32())
    cols["advantage"] = pa.array(c.adv_tok[rows], pa.float32())
    cols["mask"] = pa.array(c.mask[rows], pa.bool_())
    if c.entropy is not None:
        cols["entropy"] = pa.array(c.entropy[rows], pa.float32())
    return pa.table(cols)


def write_run(path: Path, calls: list[LossCall], config: dict | None = None, samples: dict[int, pa.Table] | None = None,
              parts: int = 1, rng: np.random.Generator | None = None) -> Path:
    """Write calls as a run. ``parts > 1`` splits each (step, rank) into that many part files at
    loss-call boundaries (random when ``rng`` is given)."""
    path.mkdir(parents=True, exist_ok=True)
    manifest = {"format": "grpolens-run", "version": 1, "run_name": path.name, "created": "2026-01-01T00:00:00+00:00",
                "world_size": max(c.rank for c in calls) + 1 if calls else 1,
                "trainer": {"name": "tests", "version": "0"}, "config": config or {}}
    (path / fmt.MANIFEST_NAME).write_text(json.dumps(manifest))
    by_key: dict[tuple[int, int], list[LossCall]] = {}
    for c in calls:
        by_key.setdefault((c.step, c.rank), []).append(c)
    for (step, rank), cs in by_key.items():
        tables = [call_table(c) for c in sorted(cs, key=lambda c: c.micro_batch)]
        if parts <= 1:
            groups = [tables]
        else:
            cuts = sorted(set((rng.integers(1, len(tables), size=parts - 1) if rng is not None else
                               np.linspace(0, len(tables), parts + 1)[1:-1].astype(int)).tolist()))
            bounds = [0, *cuts, len(tables)]
            groups = [tables[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
        for i, g in enumerate(groups):
            t = pa.concat_tables(g, promote_options="default")
            t = t.sort_by([("micro_batch", "ascending"), ("sample_id", "ascending"), ("pos", "ascending")])
            rel = fmt.shard_relpath(fmt.TOKENS, step, rank, None if len(groups) == 1 else i)
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(t, path / rel)
    for step, t in (samples or {}).items():
        # one shard per rank, as the writer does (a rank's rows in another rank's file are invalid)
        ranks = sorted(set(t.column("rank").to_pylist())) or [0]
        for rank in ranks:
            rows = t.filter(pa.compute.equal(t.column("rank"), rank)) if t.num_rows else t
            rel = fmt.shard_relpath(fmt.SAMPLES, step, rank)
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(rows, path / rel)
            widen_world(path, rank)
    return path


# -- reference reductions on padded arrays -----------------------------------------------------

def pooled(calls: list[LossCall], step: int, x_fn, valid_fn) -> float | None:
    """Σ x over valid tokens / Σ valid over all of a step's calls (None when nothing is valid)."""
    num = den = 0.0
    for c in calls:
        if c.step != step:
            continue
        v = valid_fn(c)
        with np.errstate(all="ignore"):
            x = x_fn(c)
        num += np.where(v, x, 0.0).sum()
        den += v.sum()
    return num / den if den > 0 else None


def trl_slot_mean(calls: list[LossCall], step: int, x_fn, valid_fn) -> float | None:
    """TRL >= 1.9: per micro-batch slot Σ over ranks / max(count, 1), then mean over slots."""
    slots = sorted({c.micro_batch for c in calls if c.step == step})
    vals = []
    for mb in slots:
        num = den = 0.0
        for c in calls:
            if c.step == step and c.micro_batch == mb:
                v = valid_fn(c)
                with np.errstate(all="ignore"):
                    x = x_fn(c)
                num += np.where(v, x, 0.0).sum()
                den += v.sum()
        vals.append(num / max(den, 1.0))
    return float(np.mean(vals)) if vals else None


def approx(a, b, rel=1e-9, abs_=1e-12) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= abs_ + rel * abs(b)


# -- samples tables (one row per generated completion) ------------------------------------------

@dataclass
class Samples:
    """One step's completions as plain numpy columns (NaN marks a null float).

    ``rewards[name]`` are the raw per-function values; ``reward`` the total; ``reward_null`` /
    ``fn_null[name]`` mark rows written as Parquet *null* (the others may hold NaN or ±inf)."""

    step: int
    rank: np.ndarray
    sample_id: np.ndarray
    group_id: np.ndarray
    completion_len: np.ndarray
    truncated: np.ndarray
    prompt_len: np.ndarray | None          # float, NaN = null; None = column absent
    reward: np.ndarray | None
    reward_null: np.ndarray
    advantage: np.ndarray | None
    rewards: dict[str, np.ndarray] = field(default_factory=dict)
    fn_null: dict[str, np.ndarray] = field(default_factory=dict)

    def table(self, rows: np.ndarray | None = None) -> pa.Table:
        """The Parquet table of these samples (``rows``: a subset, e.g. one rank's)."""
        r = np.arange(len(self.sample_id)) if rows is None else rows

        def fl(x, null, typ=pa.float64()):
            return pa.array(x[r], typ, mask=null[r])

        cols = {
            "step": pa.array(np.full(len(r), self.step), pa.int64()),
            "rank": pa.array(self.rank[r], pa.int32()),
            "sample_id": pa.array(self.sample_id[r], pa.int64()),
            "group_id": pa.array(self.group_id[r], pa.int64()),
        }
        if self.prompt_len is not None:
            p = self.prompt_len[r]
            cols["prompt_len"] = pa.array(np.nan_to_num(p).astype(np.int32), pa.int32(), mask=np.isnan(p))
        cols["completion_len"] = pa.array(self.completion_len[r], pa.int32())
        cols["truncated"] = pa.array(self.truncated[r], pa.bool_())
        if self.reward is not None:
            cols["reward"] = fl(self.reward, self.reward_null)
        if self.advantage is not None:
            cols["advantage"] = pa.array(self.advantage[r], pa.float32())
        for name in sorted(self.rewards):
            cols[f"reward/{name}"] = fl(self.rewards[name], self.fn_null[name])
        return pa.table(cols)


def random_samples(
    rng: np.random.Generator,
    step: int,
    groups: int = 6,
    generations: int = 4,
    ranks: int = 2,
    reward_fns=("accuracy", "format"),
    max_len: int = 40,
    nonfinite: float = 0.1,
    single_sample_group: bool = True,
    equal_group: bool = True,
    unscored_group: bool = True,
    first_id: int = 0,
) -> Samples:
    """Random prompt groups with ragged lengths and the edge cases reward metrics need: null,
    NaN and ±inf rewards, a group of one completion, a group whose rewards are all equal, a group
    nothing could score. Completions reaching ``max_len`` are truncated; a few shorter ones too
    (no EOS for another reason), so EOS-based and length-based rules differ."""
    sizes = [generations] * groups
    if single_sample_group and groups > 1:
        sizes[-1] = 1
    gid = np.repeat(np.arange(groups) + 100 * step, sizes)
    n = len(gid)
    clen = rng.integers(1, max_len + 1, size=n)
    clen[rng.random(n) < 0.25] = max_len
    trunc = (clen >= max_len) | (rng.random(n) < 0.05)
    plen = np.repeat(rng.integers(3, 30, size=groups), sizes).astype(float)  # one prompt per group
    rewards = {name: np.round(rng.random(n) * 4) / 4 for name in reward_fns}  # ties are common
    fn_null = {name: rng.random(n) < nonfinite for name in reward_fns}
    total = sum(rewards.values()) if reward_fns else rng.normal(size=n)
    total = np.asarray(total, dtype=float)
    null = rng.random(n) < nonfinite
    if nonfinite > 0 and n > 3:
        total[rng.integers(n)] = np.nan
        total[rng.integers(n)] = rng.choice([np.inf, -np.inf])
    if equal_group and groups > 1:
        total[gid == gid[0]] = 0.75
        null[gid == gid[0]] = False
    if unscored_group and groups > 2:
        null[gid == np.unique(gid)[1]] = True
    adv = rng.normal(size=n).astype(np.float32).astype(float)
    adv[gid == gid[0]] = 0.0  # an all-equal group has zero advantages
    return Samples(step, rng.integers(0, ranks, size=n), np.arange(first_id, first_id + n), gid, clen, trunc,
                   plen, total, null, adv, rewards, fn_null)


def widen_world(path: Path, rank: int) -> None:
    """The manifest's world_size covers ``rank`` (a shard of a rank outside it is invalid)."""
    m = json.loads((path / fmt.MANIFEST_NAME).read_text())
    if m.get("world_size", 1) <= rank:
        m["world_size"] = rank + 1
        (path / fmt.MANIFEST_NAME).write_text(json.dumps(m))


def write_samples(path: Path, samples: list[Samples], ranks: bool = True) -> None:
    """Write each step's samples, one shard per rank that generated some (``ranks=False``: one)."""
    for s in samples:
        for rank in (np.unique(s.rank) if ranks else [None]):
            rows = None if rank is None else np.nonzero(s.rank == rank)[0]
            rel = fmt.shard_relpath(fmt.SAMPLES, s.step, 0 if rank is None else int(rank))
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(s.table(rows), path / rel)
            if rank is not None and (path / fmt.MANIFEST_NAME).is_file():
                widen_world(path, int(rank))


def samples_run(path: Path, samples: list[Samples], config: dict | None = None, calls: list[LossCall] | None = None) -> Path:
    """A run with these samples (and optionally token loss calls)."""
    write_run(path, calls or [], config)
    write_samples(path, samples)
    return path


def write_rounds(path: Path, rounds: list[Samples], config: dict | None = None,
                 calls: list[LossCall] | None = None) -> Path:
    """A run whose samples carry the ``generation`` column: ``rounds[i]`` is generation round
    ``i`` (several may share a step), written one shard per (step, rank) with every round of it."""
    write_run(path, calls or [], config)
    by_shard: dict[tuple[int, int], list[pa.Table]] = {}
    for i, s in enumerate(rounds):
        for rank in np.unique(s.rank):
            t = s.table(np.nonzero(s.rank == rank)[0])
            t = t.append_column(pa.field("generation", pa.int64()), pa.array(np.full(t.num_rows, i), pa.int64()))
            by_shard.setdefault((s.step, int(rank)), []).append(t)
    for (step, rank), tables in by_shard.items():
        rel = fmt.shard_relpath(fmt.SAMPLES, step, rank)
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.concat_tables(tables, promote_options="default"), path / rel)
        widen_world(path, rank)
    return path


def concat_samples(parts: list[Samples]) -> Samples:
    """One step's completions from several rounds' (same step): what pooling the rounds sees."""
    cat = lambda xs: None if xs[0] is None else np.concatenate(xs)  # noqa: E731
    return Samples(parts[0].step, *(cat([getattr(p, f) for p in parts]) for f in (
        "rank", "sample_id", "group_id", "completion_len", "truncated", "prompt_len", "reward", "reward_null",
        "advantage")),
        rewards={k: np.concatenate([p.rewards[k] for p in parts]) for k in parts[0].rewards},
        fn_null={k: np.concatenate([p.fn_null[k] for p in parts]) for k in parts[0].fn_null})
