"""Read each tracker's local output back with the tracker's own reader, for the export tests."""

from __future__ import annotations

import struct
from pathlib import Path


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] through TensorBoard's EventAccumulator (every event kept)."""
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(logdir), size_guidance={TENSORS: 0})
    acc.Reload()
    return {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]}


def wandb_records(path: Path):
    """The protobuf ``Record``s of a W&B transaction log (``run-<id>.wandb``).

    wandb 0.31 ships no Python reader of this file (its Go core reads it), so this walks the log
    format it is written in (LevelDB's: 32 KiB blocks of chunks with a 7-byte header: CRC-32C,
    length, type FULL/FIRST/MIDDLE/LAST, after a 7-byte file header ':W&B', magic, version) and
    decodes each record with wandb's own ``wandb_internal_pb2.Record``.
    """
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", path
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind == 1:
            pending = b""
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(chunk)
            yield rec
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending + chunk)
            pending = b""
            yield rec


def wandb_history(run_dirs: list[Path]) -> list[dict]:
    """Every history row logged in these offline run directories, in order, as {key: value}."""
    import json

    rows = []
    for d in run_dirs:
        for log in sorted(d.glob("run-*.wandb")):
            for rec in wandb_records(log):
                if rec.WhichOneof("record_type") == "history":
                    row = {}
                    for item in rec.history.item:
                        key = item.key or "/".join(item.nested_key)
                        row[key] = json.loads(item.value_json)
                    rows.append(row)
    return rows
