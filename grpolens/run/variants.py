"""What-if variants of a run: a recompute under config overrides, kept apart from the run's own metrics.

``grpolens recompute RUN --set k=v`` (or ``--config FILE``) writes under
``RUN/grpolens/variants/<key>/``, where ``<key>`` is a hash of the effective override mapping
(the ``--config`` file's keys with the ``--set`` ones merged over them). The directory holds the
variant's outputs exactly as ``RUN/grpolens/`` holds the run's (``metrics.parquet``,
``metrics.jsonl``, tables, its own per-step ``cache/``) plus ``variant.json``: the override mapping
and a human label (``rollout_is.upper=3``). The run's own metrics are never touched by a what-if,
and the same overrides always land in the same directory, so re-running one is incremental.

Readers name a variant by its key, a unique prefix of it, or its label (``--variant`` of ``check``
and ``export``); ``serve`` lists every variant of a served run as a run of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpolens.errors import UserError
from grpolens.run import format as fmt

#: Subdirectory of a run's derived directory (``RUN/grpolens/``) holding its variants.
VARIANTS_DIR = "variants"
#: The file in a variant's directory that says what it is.
VARIANT_FILE = "variant.json"


def variant_key(overrides: dict[str, Any]) -> str:
    """The directory name of the variant with these effective overrides: order-independent."""
    blob = json.dumps(overrides, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _flat(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k in sorted(d):
        v = d[k]
        if isinstance(v, dict) and v:
            out += _flat(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def variant_label(overrides: dict[str, Any]) -> str:
    """``rollout_is.upper=3, loss_type=dr_grpo``: the overrides as one would type them after ``--set``."""
    return ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v, default=str)}" for k, v in _flat(overrides))


def variants_root(run) -> Path:
    return fmt.derived_dir(run) / VARIANTS_DIR


@dataclass(frozen=True)
class Variant:
    """One variant of ``run``: its key, overrides, label and directory."""

    run: Any  # the run (a local Path, or a storage Location)
    key: str
    overrides: dict[str, Any]
    label: str

    @property
    def dir(self) -> Path:
        return variants_root(self.run) / self.key

    @classmethod
    def of(cls, run, overrides: dict[str, Any]) -> "Variant":
        return cls(run, variant_key(overrides), overrides, variant_label(overrides))

    def record(self) -> bytes:
        return json.dumps({"key": self.key, "label": self.label, "overrides": self.overrides},
                          indent=1, sort_keys=True, default=str).encode()

    def write_record(self, where: Path | None = None) -> None:
        """``variant.json`` in ``where`` (default: the variant's directory), atomically."""
        d = self.dir if where is None else where
        d.mkdir(parents=True, exist_ok=True)
        p = d / VARIANT_FILE
        if not p.is_file() or p.read_bytes() != self.record():
            fmt.atomic_write_bytes(p, self.record())


def effective_overrides(overrides: dict[str, Any] | None, config_file: os.PathLike | str | None) -> dict[str, Any]:
    """The override mapping a recompute applies: ``--config FILE``'s keys, then ``--set`` over them."""
    from grpolens.run.reader import deep_update, load_config_file

    out: dict[str, Any] = load_config_file(config_file) if config_file is not None else {}
    return deep_update(out, overrides or {})


def _read(run, d: Path) -> Variant | None:
    """The variant recorded in ``d``; None for a directory that is not one (or a damaged record)."""
    try:
        raw = json.loads((d / VARIANT_FILE).read_text())
        overrides = raw["overrides"]
        if not isinstance(overrides, dict) or variant_key(overrides) != d.name:
            return None  # moved or edited by hand: its outputs are not what the record says
        return Variant(run, d.name, overrides, variant_label(overrides))
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None


def list_variants(run) -> list[Variant]:
    """The run's variants (sorted by label); directories without a valid ``variant.json`` are skipped."""
    root = variants_root(run)
    if not root.is_dir():
        return []
    found = [_read(run, d) for d in sorted(root.iterdir()) if d.is_dir()]
    return sorted((v for v in found if v is not None), key=lambda v: (v.label, v.key))


def find_variant(run, spec: str) -> Variant:
    """The variant named by ``spec``: its key, a unique prefix of the key (4+ characters), or its
    label (as ``grpolens serve`` and ``recompute`` show it). Anything else: a one-line error."""
    spec = spec.strip()
    found = list_variants(run)
    hits = [v for v in found if v.key == spec or v.label == spec]
    if not hits and len(spec) >= 4:
        hits = [v for v in found if v.key.startswith(spec)]
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        raise UserError(f"--variant {spec!r} matches {len(hits)} variants of {run}: "
                        + ", ".join(f"{v.key} ({v.label})" for v in hits))
    known = ", ".join(f"{v.key} ({v.label})" for v in found) or "none; make one with grpolens recompute RUN --set KEY=VALUE"
    raise UserError(f"--variant {spec!r}: no such variant of {run} (known: {known})")


class VariantRun(type(Path())):  # type: ignore[misc] - the concrete PosixPath/WindowsPath
    """A run read through one of its variants (what the dashboard serves as a run of its own).

    It is the run's own path, so shards and manifest are read as usual; only what grpolens derives
    differs: :func:`grpolens.run.format.derived_dir` returns the variant's directory, and
    :func:`grpolens.analysis.recompute.recompute` applies the variant's overrides. A path made from
    it (``run / "tokens"``, ``Path(run)``) carries no variant and is read as a plain path."""

    variant: Variant | None = None

    def __eq__(self, other):
        return super().__eq__(other) and getattr(other, "variant", None) == self.variant

    def __hash__(self):
        return hash((super().__hash__(), self.variant and self.variant.key))


def variant_run(variant: Variant) -> VariantRun:
    p = VariantRun(variant.run)
    p.variant = variant
    return p
