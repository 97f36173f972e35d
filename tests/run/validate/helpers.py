"""What the validate tests share: the shard paths they break, rewriting a shard, re-marking a run
after moving its files, and the one problem of a report."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from grpolens.run import format as fmt
from grpolens.run.validate import ERROR


TOK = "tokens/step=00000001/rank=00000.parquet"
SMP = "samples/step=00000001/rank=00000.parquet"


def rewrite(path, fn):
    t = pq.read_table(path)
    pq.write_table(fn(t), path)


def remark(run):
    """Make every completion marker name the shard files now on disk, as the writer would have had
    it written them: for tests that restructure files to exercise other checks."""
    for marker in (run / fmt.COMPLETE_DIR).glob("step=*.json"):
        data = json.loads(marker.read_text())
        data["files"] = sorted(str(sh.path.relative_to(run)) for t in fmt.TABLES
                               for sh in fmt.list_shards(run, t, [data["step"]], complete_only=False)
                               if sh.rank == data["rank"])
        marker.write_text(json.dumps(data))


def only(report, severity=ERROR):
    probs = [p for p in report.problems if p.severity == severity]
    assert len(probs) == 1, report.problems
    return probs[0]
