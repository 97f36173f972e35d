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

from grpolens.export.base import EXPORTERS, ExportOptions, ExportSource, Exporter, export_run, register_exporter

#: The built-in trackers, in the order ``--to`` lists them: each module registers its exporter
#: with :func:`~grpolens.export.base.register_exporter` on import (and imports its client only
#: when an export starts), as a plugin's module does.
TRACKERS = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow", "trackio": "trackio"}

__all__ = ["EXPORTERS", "TRACKERS", "ExportOptions", "ExportSource", "Exporter", "export_run", "exporter_class",
           "exporters", "register_exporter"]


def exporters() -> dict[str, type[Exporter]]:
    """Every registered exporter, ``--to`` name -> class: the built-ins, then the plugins'."""
    from grpolens.plugins import load_plugins

    for module in TRACKERS.values():
        importlib.import_module(f"grpolens.export.{module}")
    load_plugins()
    return EXPORTERS


def exporter_class(to: str) -> type[Exporter]:
    """The exporter of tracker ``to``."""
    from grpolens.errors import UserError

    known = exporters()
    if to not in known:
        raise UserError(f"--to: unknown tracker {to!r}; choose one of {', '.join(known)}")
    return known[to]
