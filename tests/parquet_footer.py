"""Edit a Parquet file's footer (its Thrift FileMetaData, compact protocol) as another writer would
have written it, for statistics that pyarrow does not write: e.g. a minimum and a maximum without a
null count. Only what a footer holds is handled (no maps, no boolean lists); offsets stay valid, as
the footer is the file's last part."""

from __future__ import annotations

import struct
from pathlib import Path

_BOOL = (1, 2)  # compact protocol types: true, false (the value is the type)
_INTS = (3, 4, 5, 6)  # byte, i16, i32, i64 (zigzag varints but the byte)


def _varint(b: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        c = b[i]
        i += 1
        n |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return n, i


def _read(b: bytes, i: int, t: int):
    if t in _BOOL:
        return t == 1, i
    if t == 3:
        return b[i], i + 1
    if t in _INTS:
        n, i = _varint(b, i)
        return (n >> 1) ^ -(n & 1), i
    if t == 7:  # double
        return b[i:i + 8], i + 8
    if t == 8:  # binary
        n, i = _varint(b, i)
        return b[i:i + n], i + n
    if t in (9, 10):  # list, set
        n, et = b[i] >> 4, b[i] & 15
        i += 1
        if n == 15:
            n, i = _varint(b, i)
        items = []
        for _ in range(n):
            v, i = _read(b, i, et)
            items.append(v)
        return (et, items), i
    if t == 12:
        return _read_struct(b, i)
    raise ValueError(f"compact protocol type {t}")


def _read_struct(b: bytes, i: int) -> tuple[list, int]:
    """A struct as [[field id, type, value], ...] in the order written."""
    fields, last = [], 0
    while True:
        h = b[i]
        i += 1
        if h == 0:
            return fields, i
        if h >> 4:
            fid = last + (h >> 4)
        else:
            n, i = _varint(b, i)
            fid = (n >> 1) ^ -(n & 1)
        v, i = _read(b, i, h & 15)
        fields.append([fid, h & 15, v])
        last = fid


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _zigzag(n: int) -> bytes:
    return _uvarint((n << 1) ^ (n >> 63))


def _write(t: int, v) -> bytes:
    if t in _BOOL:
        return b""
    if t == 3:
        return bytes([v])
    if t in _INTS:
        return _zigzag(v)
    if t == 7:
        return bytes(v)
    if t == 8:
        return _uvarint(len(v)) + bytes(v)
    if t in (9, 10):
        et, items = v
        head = bytes([len(items) << 4 | et]) if len(items) < 15 else bytes([0xF0 | et]) + _uvarint(len(items))
        return head + b"".join(_write(et, x) for x in items)
    if t == 12:
        return _write_struct(v)
    raise ValueError(f"compact protocol type {t}")


def _write_struct(fields: list) -> bytes:
    out, last = bytearray(), 0
    for fid, t, v in fields:
        if t in _BOOL:
            t = 1 if v else 2
        d = fid - last
        out += bytes([d << 4 | t]) if 0 < d < 16 else bytes([t]) + _zigzag(fid)
        out += _write(t, v)
        last = fid
    out.append(0)
    return bytes(out)


def edit_footer(path: Path, edit) -> None:
    """Rewrite ``path``'s footer with ``edit(file_metadata)`` applied to its parsed fields."""
    data = Path(path).read_bytes()
    n = struct.unpack("<I", data[-8:-4])[0]
    start = len(data) - 8 - n
    meta, end = _read_struct(data, start)
    assert end == start + n, "not a footer this reader understands"
    edit(meta)
    new = _write_struct(meta)
    Path(path).write_bytes(data[:start] + new + struct.pack("<I", len(new)) + b"PAR1")


def _field(fields: list, fid: int):
    return next((f[2] for f in fields if f[0] == fid), None)


def drop_statistics_field(path: Path, field_id: int) -> None:
    """Remove one field of every column chunk's Statistics (parquet.thrift: 3 is null_count)."""
    def edit(meta):
        for row_group in _field(meta, 4)[1]:  # FileMetaData.row_groups
            for chunk in _field(row_group, 1)[1]:  # RowGroup.columns
                stats = _field(_field(chunk, 3), 12)  # ColumnChunk.meta_data.statistics
                if stats is not None:
                    stats[:] = [f for f in stats if f[0] != field_id]
    edit_footer(path, edit)


def set_statistics(path: Path, column: int, **fields: bytes | int) -> None:
    """Overwrite fields of one column's Statistics in every row group, as a lying writer would:
    ``max_value``/``min_value`` (plain-encoded bytes; the deprecated ``max``/``min`` follow) or
    ``null_count`` (an int)."""
    ids = {"max_value": (5, 1), "min_value": (6, 2), "null_count": (3,)}

    def edit(meta):
        for row_group in _field(meta, 4)[1]:
            chunk = _field(row_group, 1)[1][column]
            stats = _field(_field(chunk, 3), 12)
            for name, value in fields.items():
                for fid in ids[name]:
                    t = 6 if name == "null_count" else 8  # i64, binary
                    stats[:] = [f for f in stats if f[0] != fid] + [[fid, t, value]]
            stats.sort(key=lambda f: f[0])
    edit_footer(path, edit)
