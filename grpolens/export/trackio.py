"""trackio: the metrics into a trackio project through the ``trackio`` client, locally.

The run goes into the local project ``--project`` (default ``grpolens``; trackio's database under
``TRACKIO_DIR``, by default ``~/.cache/huggingface/trackio``), named after the grpolens run;
``trackio show --project grpolens`` opens its dashboard. trackio logs each call at the given step,
so the training step is the x-axis. Re-export resumes the run by name and logs only the steps its
database does not have yet (read back with trackio's own storage API). Tables: ``trackio.Table``
of the new steps' rows.
"""

from __future__ import annotations

import contextlib
import io

from grpolens.export.base import PREFIX, Exporter, needs, register_exporter
from grpolens.run.names import path_component


@register_exporter
class TrackioExporter(Exporter):
    tracker = "trackio"
    has_tables = True

    def __init__(self, source, options):
        super().__init__(source, options)
        # the project names trackio's database file (TRACKIO_DIR/<project>.db)
        path_component(options.project, "--project")
        self.trackio = trackio = needs("trackio", "trackio")
        self.name = options.name or source.run_name
        with contextlib.redirect_stdout(io.StringIO()):  # trackio prints a banner on init
            self.run = trackio.init(project=options.project, name=self.name, resume="allow", embed=False,
                                    auto_log_gpu=False, auto_log_cpu=False, config={"grpolens_run": str(source.run)})

    def exported_steps(self) -> set[int]:
        from trackio.sqlite_storage import SQLiteStorage

        logs = SQLiteStorage.get_logs(self.options.project, self.name)
        return {int(r["step"]) for r in logs if r.get("grpolens/step") is not None}

    def log_step(self, step, values):
        self.trackio.log(values, step=int(step))

    def log_table(self, name, df):
        table = self.trackio.Table(dataframe=df.to_pandas())
        self.trackio.log({f"{PREFIX}tables/{name}": table}, step=int(df["step"].max()))

    def finish(self) -> str:
        with contextlib.redirect_stdout(io.StringIO()):
            self.trackio.finish()
        from trackio.utils import TRACKIO_DIR

        return f"trackio project {self.options.project!r}, run {self.name!r} in {TRACKIO_DIR}"

