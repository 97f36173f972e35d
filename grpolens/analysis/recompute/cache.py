"""A recompute's per-step cache, and the keys it is checked with (shard fingerprints, the config
hash, the outputs key)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from grpolens.metrics.registry import REGISTRY
from grpolens.run import format as fmt

CACHE_VERSION = 2  # 2: rows of a profile with a log schedule carry appended-value counts


def fingerprints(shards: list[fmt.Shard]) -> list:
    return [sh.fingerprint() for sh in shards]


def key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_hash(cfg: dict, profile: str) -> str:
    blob = json.dumps({"cfg": cfg, "profile": profile, "cache": CACHE_VERSION, "metrics": sorted(REGISTRY)},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class StepCache:
    """One profile's per-step cache under ``ROOT/cache/``: ``steps-<profile>.parquet`` (each step's
    row of raw values, before renaming and running totals) and ``state-<profile>.json`` (the config
    hash, each step's shard fingerprints, the samples shards' fingerprints and columns, the key and
    files of the outputs last written, the run's notes, the freshness stamp). A row is valid while
    the config hash and its step's fingerprints match; the state is written last, so a recompute cut
    short leaves a state that does not vouch for rows it did not finish."""

    rows_path: Path
    state_path: Path
    fingerprints: dict[int, list]  # each step's token and samples shard fingerprints
    samples_fp: list               # every samples shard's fingerprint
    state: dict                    # as read: {} when not read, absent or damaged

    @classmethod
    def open(cls, root: Path, profile: str, run, steps: list[int], read_state: bool) -> StepCache:
        """The cache under ``root`` with the run's fingerprints now; its state is read when ``read_state``."""
        rows_path = root / "cache" / f"steps-{profile}.parquet"
        state_path = root / "cache" / f"state-{profile}.json"
        # one listing per table (not one per step: a 1,000-step run would list 2,000 directories)
        token_shards, sample_shards = fmt.list_shards(run, fmt.TOKENS), fmt.list_shards(run, fmt.SAMPLES)
        by_step: dict[int, list] = {s: [] for s in steps}
        for sh in token_shards + sample_shards:
            if sh.step in by_step:
                by_step[sh.step].append(sh.fingerprint())
        samples_fp = fingerprints(sample_shards)
        state: dict = {}
        if read_state and state_path.is_file():
            try:
                state = json.loads(state_path.read_text())
            except Exception:  # noqa: BLE001 - a damaged cache is simply rebuilt
                state = {}
        return cls(rows_path, state_path, by_step, samples_fp, state)

    def sample_columns(self, reader) -> set[str]:
        """The run's sample columns: from every samples shard's footer, or from the state while no
        samples shard changed (on object storage that is one GET per shard saved on every run)."""
        if self.state.get("samples") == self.samples_fp and isinstance(self.state.get("sample_columns"), list):
            return set(self.state["sample_columns"])
        return reader.sample_columns()

    def valid_rows(self, chash: str) -> dict[int, dict]:
        """Every step of the run whose cached row is still valid (not only the selected ones: the
        cache is rewritten whole, and cumulative metrics need the steps before --steps)."""
        if not self.rows_path.is_file() or not self.state:
            return {}
        valid: dict[int, dict] = {}
        try:
            if self.state.get("config_hash") == chash:
                old = pl.read_parquet(self.rows_path)
                for row in old.iter_rows(named=True):
                    s = row["step"]
                    if s in self.fingerprints and self.state.get("steps", {}).get(str(s)) == self.fingerprints[s]:
                        valid[s] = row
        except Exception:  # noqa: BLE001 - a damaged cache is simply rebuilt
            return {}
        return valid

    def restamp(self, fresh_state: dict | None) -> None:
        """Add the freshness stamp to a state written before stamps (outputs otherwise unchanged)."""
        if fresh_state is not None and self.state.get("fresh") != fresh_state:
            fmt.atomic_write_bytes(self.state_path, json.dumps({**self.state, "fresh": fresh_state}).encode())

    def write(self, rows: dict[int, dict], valid: dict[int, dict], names: list[str], schema: dict, chash: str,
              sample_columns, outputs: dict, notes: list[str], fresh_state: dict | None) -> None:
        """The rows (the computed ones, and the still valid ones of steps not selected), then the state."""
        keep = {s: r for s, r in valid.items() if s not in rows}
        table = pl.DataFrame([{k: r.get(k) for k in names} for _, r in sorted({**keep, **rows}.items())],
                             schema=schema, orient="row")
        fmt.atomic_write_table(self.rows_path, table.to_arrow())
        state = {"config_hash": chash, "steps": {str(s): self.fingerprints[s] for s in sorted({*keep, *rows})},
                 "samples": self.samples_fp, "sample_columns": sorted(sample_columns), "outputs": outputs,
                 "notes": notes}
        if fresh_state is not None:
            state["fresh"] = fresh_state
        fmt.atomic_write_bytes(self.state_path, json.dumps(state).encode())
