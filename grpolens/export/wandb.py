"""Weights & Biases: the metrics into a W&B run through the ``wandb`` client.

Offline by default: the run is written to ``RUN/grpolens/wandb/offline-run-*`` and nothing is sent
(``wandb sync DIR`` uploads it later). ``--online``, or ``WANDB_MODE`` set in the environment, is
the user asking to send it. ``define_metric("grpolens/*", step_metric="grpolens/step")`` makes
the training step the x-axis of every grpolens chart, so the export can join an existing run (the
trainer's, with its loss and learning rate): ``--resume RUN_ID``; without it the run id is derived
from the run's path and profile, the same on every export.

W&B offers no query of an offline run, so re-export keeps a ledger: after a successful export the
steps sent to a run id are recorded in ``RUN/grpolens/export/wandb-<run id>.json``, and the next
export to that id sends only the others. Tables: ``wandb.Table`` of the new steps' rows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from grpolens.export.base import PREFIX, STEP_KEY, Exporter, needs, register_exporter
from grpolens.run.names import child


@register_exporter
class WandbExporter(Exporter):
    tracker = "wandb"
    owns = ("resume", "online")
    has_tables = True

    def __init__(self, source, options):
        super().__init__(source, options)
        self.wandb = wandb = needs("wandb", "wandb")
        self.run_id = options.resume or f"grpolens-{source.key}"
        # the run id names the ledger file: an id given with --resume is checked like any name
        self.ledger = child(source.out_dir / "export", f"wandb-{self.run_id}.json", "--resume")
        self.mode = "online" if options.online else os.environ.get("WANDB_MODE") or "offline"
        self.sent: set[int] = set()
        self._run = None

    @property
    def run(self):
        """The W&B run, started at the first value to send (an export with nothing new starts none)."""
        if self._run is None:
            wandb, opts = self.wandb, self.options
            self._run = wandb.init(
                project=opts.project, id=self.run_id, resume="allow", mode=self.mode,
                name=None if opts.resume else (opts.name or self.source.run_name), dir=str(self.source.out_dir),
                settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_machine_info=True),
            )
            self._run.define_metric(STEP_KEY)
            self._run.define_metric(PREFIX + "*", step_metric=STEP_KEY)
        return self._run

    def exported_steps(self) -> set[int]:
        if not self.ledger.is_file():
            return set()
        return set(json.loads(self.ledger.read_text()).get("steps", []))

    def log_step(self, step, values):
        self.run.log(values)  # W&B's own _step counts calls; grpolens/step is the x-axis
        self.sent.add(int(step))

    def log_table(self, name, df):
        cols = df.columns
        table = self.wandb.Table(columns=cols, data=[list(r) for r in df.iter_rows()])
        self.run.log({f"{PREFIX}tables/{name}": table, STEP_KEY: int(df["step"].max())})

    def finish(self) -> str:
        if self._run is None:
            return f"W&B run {self.run_id}: nothing new to send"
        self._run.finish()
        from grpolens.run import format as fmt

        if self.mode != "disabled":  # WANDB_MODE=disabled keeps nothing: nothing to remember
            steps = sorted(self.exported_steps() | self.sent)
            fmt.atomic_write_bytes(self.ledger, json.dumps({"run_id": self.run_id, "steps": steps}).encode())
        where = Path(self._run.dir).parent if self.mode != "online" else getattr(self._run, "url", None) or self.run_id
        return f"W&B run {self.run_id} ({self.mode}): {where}"

