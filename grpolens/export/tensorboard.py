"""TensorBoard: event files written with TensorBoard's own writer (no TensorFlow, no torch).

Each metric is a scalar summary of a float64 tensor (TensorBoard's ``simple_value`` is float32 and
would round the values), tagged ``grpolens/<metric>`` at its training step. The files go to
``--logdir`` (default ``RUN/grpolens/tensorboard``), in a subdirectory named after the run, so that
``tensorboard --logdir DIR`` shows it beside the trainer's own runs.

Re-export replaces: the new event file is written whole, then the event files of earlier exports
(suffix ``.grpolens``) in that directory are removed, so TensorBoard never sees a step twice.
TensorBoard has no table type: completions and top tokens are not exported to it.
"""

from __future__ import annotations

import time
from pathlib import Path

from grpolens.export.base import Exporter, needs, register_exporter, tracker_name
from grpolens.run.names import child

SUFFIX = ".grpolens"


@register_exporter
class TensorBoardExporter(Exporter):
    tracker = "tensorboard"
    owns = ("logdir",)

    def __init__(self, source, options):
        super().__init__(source, options)
        needs("tensorboard", "tensorboard")
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        root = Path(options.logdir) if options.logdir is not None else source.out_dir / "tensorboard"
        self.dir = child(root, *tracker_name(source, options))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.previous = sorted(self.dir.glob(f"events.out.tfevents.*{SUFFIX}"))
        self.writer = EventFileWriter(str(self.dir), filename_suffix=SUFFIX)
        from tensorboard.plugins.scalar import metadata

        self.metadata = metadata.create_summary_metadata(display_name="", description="")

    def exported_steps(self) -> set[int]:
        return set()  # every export writes the whole run; finish() removes the earlier files

    def log_step(self, step, values):
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2

        summary = summary_pb2.Summary()
        for tag, v in values.items():
            tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE, double_val=[float(v)])
            summary.value.add(tag=tag, tensor=tensor, metadata=self.metadata)
        self.writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

    def finish(self) -> str:
        self.writer.close()
        for old in self.previous:  # the new file is complete: earlier exports' files go
            old.unlink(missing_ok=True)
        return f"event files in {self.dir} (tensorboard --logdir {self.dir.parent})"

