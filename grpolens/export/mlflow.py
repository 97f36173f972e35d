"""MLflow: one MLflow run per grpolens run (and profile), through MLflow's own client.

``--tracking-uri`` names the store or server; without it, ``MLFLOW_TRACKING_URI`` when set, else a
local SQLite store beside the run (``sqlite:///RUN/grpolens/mlflow.db``, its artifacts in
``RUN/grpolens/mlflow-artifacts/``; ``mlflow ui --backend-store-uri`` that URI shows it). The run is
found again by its tag ``grpolens.run`` in the experiment ``--project`` (default ``grpolens``):
re-export logs only the steps whose ``grpolens/step`` marker the run does not have yet. Each step goes in one ``log_batch`` call (one
transaction), metrics at their training step (a character MLflow refuses in a name becomes
``_``: :func:`metric_key`); the tables are logged with ``log_table`` (JSON
artifacts under ``grpolens/``), the new steps' rows only.
"""

from __future__ import annotations

import os
import re
import time

from grpolens.export.base import STEP_KEY, Exporter, needs, register_exporter

TAG = "grpolens.run"
_INVALID = re.compile(r"[^A-Za-z0-9_\-. :/]")


def metric_key(name: str) -> str:
    """MLflow accepts only alphanumerics, ``_ - . : /`` and spaces in a metric name: any other
    character becomes ``_`` (``kl/by_length_tokens/257+`` -> ``kl/by_length_tokens/257_``)."""
    return _INVALID.sub("_", name)


@register_exporter
class MLflowExporter(Exporter):
    tracker = "mlflow"
    owns = ("tracking_uri",)
    has_tables = True

    def __init__(self, source, options):
        super().__init__(source, options)
        needs("mlflow", "mlflow")
        from mlflow import MlflowClient

        uri = options.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        # A SQLite store's experiments keep their artifacts under ./mlruns of the process's working
        # directory unless told otherwise: with the store we chose, they go beside it instead, so an
        # export writes nothing outside the run. A store the user named keeps its own convention.
        artifacts = None
        if uri is None:
            uri = f"sqlite:///{(source.out_dir / 'mlflow.db').resolve()}"
            artifacts = (source.out_dir / "mlflow-artifacts").resolve().as_uri()
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(options.project)
        exp_id = exp.experiment_id if exp is not None \
            else self.client.create_experiment(options.project, artifact_location=artifacts)
        found = self.client.search_runs([exp_id], filter_string=f"tags.`{TAG}` = '{source.key}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(exp_id, run_name=options.name or source.run_name,
                                         tags={TAG: source.key, "grpolens.profile": source.profile,
                                               "grpolens.path": source.where})
            self.run_id = run.info.run_id

    def exported_steps(self) -> set[int]:
        return {int(m.step) for m in self.client.get_metric_history(self.run_id, STEP_KEY)}

    def log_step(self, step, values):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(metric_key(k), float(v), now, int(step)) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's limit of metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_table(self, name, df):
        self.client.log_table(self.run_id, df.to_pandas(), artifact_file=f"grpolens/{name}.json")

    def finish(self) -> str:
        self.client.set_terminated(self.run_id)
        return f"MLflow run {self.run_id} in experiment {self.options.project!r} at {self.uri}"

