"""``grpolens export RUN --to TRACKER``: a run's recomputed metrics into the tracker a team already uses.

One small module per tracker (:mod:`.wandb`, :mod:`.tensorboard`, :mod:`.mlflow`, :mod:`.trackio`),
each a :class:`~grpolens.export.base.Exporter` over its official client library, installed as an
extra (``pip install "grpolens[wandb]"``); nothing here imports a client until that tracker is
asked for, and the core never imports this package. What is exported, for every tracker:

* every value of ``metrics.jsonl`` (recomputed first when stale) as ``grpolens/<metric>`` at its
  training step, with ``grpolens/step`` beside it (the x-axis on trackers with a step metric);
* the rich-completion table (``completions.parquet``) and the worst tokens (``top_tokens.parquet``)
  as the tracker's table type where it has one;
* re-exporting never logs a step twice: W&B, MLflow and trackio add only the steps the destination
  does not have yet, TensorBoard rewrites the whole run (each module says how).

Nothing leaves the machine unless the user asks: W&B runs offline unless ``--online`` (or
``WANDB_MODE``), MLflow writes a local SQLite store unless ``--tracking-uri`` (or
``MLFLOW_TRACKING_URI``), trackio and TensorBoard write local files.
"""

from __future__ import annotations

import importlib

from grpolens.export.base import ExportOptions, ExportSource, Exporter, export_run

#: --to choice -> module under grpolens.export, and the extra that installs its client
TRACKERS = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow", "trackio": "trackio"}

__all__ = ["TRACKERS", "ExportOptions", "ExportSource", "Exporter", "export_run", "exporter_class"]


def exporter_class(to: str) -> type[Exporter]:
    """The exporter of tracker ``to`` (its module is imported only now)."""
    from grpolens.errors import UserError

    if to not in TRACKERS:
        raise UserError(f"--to: unknown tracker {to!r}; choose one of {', '.join(TRACKERS)}")
    return importlib.import_module(f"grpolens.export.{TRACKERS[to]}").EXPORTER
