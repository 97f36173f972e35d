"""A rollout-IS configuration as the formulas read it: level, mode, bands, veto, rejection filters.

:func:`grpolens.run.config.normalize_rollout_is` turns each trainer's spelling into the mapping
:meth:`ISConfig.from_cfg` reads; the choices it accepts are the ones named here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from grpolens.functional.jit import inline, kernel

LEVELS = ("token", "sequence", "geometric")
MODES = ("none", "truncate", "truncate_upper", "mask", "both", "icepop")
#: verl's rejection-sampling filters (``rollout_rs``): a per-token statistic k1/k2/k3 of the
#: bounded log-ratio, per token or per sequence as a sum, a mean or a max
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


@dataclass(frozen=True)
class RSFilter:
    """One verl rejection filter, e.g. ``token_k1`` with band [0.5, 2] or ``seq_max_k3`` ≤ 3."""

    option: str
    lower: float | None
    upper: float

    @property
    def k(self) -> int:
        return int(self.option[-1])

    @property
    def scope(self) -> str:
        """``token``, ``sum``, ``mean`` or ``max``."""
        return "token" if self.option.startswith("token") else self.option.split("_")[1]

    @property
    def log_band(self) -> tuple[float, float]:
        """The bounds the statistic is compared with (log space for k1)."""
        if self.k == 1:
            return float(np.log(self.lower)), float(np.log(self.upper))
        return 0.0, float(self.upper)

    def keep(self, stat: np.ndarray) -> np.ndarray:
        stat = np.asarray(stat, dtype=np.float64)
        return _kept(stat.ravel(), self.k, *self.log_band).reshape(stat.shape)


@inline
def kept(k, stat, lo, hi):
    """Whether a filter with statistic ``k`` keeps a value: k1 inside [lo, hi] (log space), k2/k3
    at most hi; NaN is never kept."""
    return (stat >= lo and stat <= hi) if k == 1 else stat <= hi


@kernel
def _kept(stat, k, lo, hi):
    out = np.empty(len(stat), dtype=np.bool_)
    for i in range(len(stat)):
        out[i] = kept(k, stat[i], lo, hi)
    return out


@dataclass(frozen=True)
class ISConfig:
    """A normalised ``rollout_is`` config (see :func:`grpolens.run.config.normalize_rollout_is`).

    ``configured`` is False for the analysis default used when a run has no ``rollout_is``:
    token level, nothing changed, no thresholds (raw-weight statistics only).
    """

    level: str = "token"
    mode: str = "none"
    lower: float | None = None
    upper: float | None = None
    mask_lower: float | None = None
    mask_upper: float | None = None
    veto_lower: float | None = None
    veto_upper: float | None = None
    rs: tuple[RSFilter, ...] = field(default_factory=tuple)
    configured: bool = False
    #: verl's ``rollout_is_batch_normalize``: the applied weights divided by their batch mean (a
    #: factor over the trainer's batch, applied where the trainer's batch is known: the verl profile)
    batch_normalize: bool = False

    @classmethod
    def from_cfg(cls, cfg: dict | None) -> "ISConfig":
        """From a checked config (the whole config, or its ``rollout_is`` mapping)."""
        # A checked whole config always holds the ``rollout_is`` key and its mapping never does.
        # (Telling them apart by ``level``/``mode`` read a user's own top-level ``mode`` key as the
        # IS settings.)
        ris = cfg.get("rollout_is") if isinstance(cfg, dict) and "rollout_is" in cfg else cfg
        if not ris:
            return cls()
        rs = tuple(RSFilter(f["option"], f.get("lower"), float(f["upper"])) for f in ris.get("rs") or ())
        keys = ("level", "mode", "lower", "upper", "mask_lower", "mask_upper", "veto_lower", "veto_upper")
        return cls(**{k: ris.get(k) for k in keys if ris.get(k) is not None}, rs=rs, configured=True,
                   batch_normalize=bool(ris.get("batch_normalize", False)))

    @property
    def has_band(self) -> bool:
        return self.upper is not None

    @property
    def masks(self) -> bool:
        return self.mode in ("mask", "both")

    @property
    def truncates(self) -> bool:
        return self.mode in ("truncate", "truncate_upper", "both")

    @property
    def zeroes(self) -> bool:
        return self.mode == "icepop"

    @property
    def veto(self) -> bool:
        return (self.veto_lower is not None and self.veto_lower > 0) or self.veto_upper is not None

    @property
    def token_filters(self) -> tuple[RSFilter, ...]:
        return tuple(f for f in self.rs if f.scope == "token")

    @property
    def seq_filters(self) -> tuple[RSFilter, ...]:
        return tuple(f for f in self.rs if f.scope != "token")
