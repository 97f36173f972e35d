"""Does grpolens reproduce what the trainer itself logged? Compare a profile's recompute with a log.

The trainer's log is a JSONL file, one object per logging call, in any of these layouts:

* a flat object with a ``step`` key: TRL's ``on_log`` dicts (the TRL integration writes them to
  ``RUN/grpolens/trl_log.jsonl``), or Twinkle's metric dicts (the merged ``calculate()`` results of
  its metrics) with the step added;
* ms-swift's ``logging.jsonl`` (its output directory): the logged dict with
  ``"global_step/max_steps": "N/M"`` for the step, floats rounded to 8 decimals;
* ``{"step": N, "data": {...}}``: verl's file logger (``trainer.logger=['file']``, one line per
  step, written to ``$VERL_FILE_LOGGER_PATH`` or ``<project>/<experiment>.jsonl``).

A value may be a number or a number formatted as text (Twinkle's ``LossMetric`` logs ``loss`` as
``f"{loss:.4f}"``): text compares at its own rounding, ``|a − b| ≤ ½·10^−decimals``. Each key the
log has *and* the profile produces is compared at each step:

``ok``        both agree within ``|a − b| ≤ atol + rtol·max(|a|, |b|)`` (or both are absent)
``mismatch``  both have a value and they differ
``missing``   the trainer logged a value, grpolens has none at that step
``extra``     grpolens has a value for a key the trainer logs, at a step where it did not log it
``undetermined``  the trainer logged a value the run does not determine (verl's Clip-Cov draws the
              tokens it zeroes at random): grpolens leaves it empty and says why; not a failure

Keys only one side knows (``grad_norm``, ``learning_rate``: the optimiser's) are not compared.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

from grpolens.errors import UserError

RTOL = 1e-5
ATOL = 1e-8
# A profile names the log file its trainer's integration writes inside the run (``log_file``) and
# the absolute floors where the trainer's own float32 arithmetic is the larger error
# (``float32_floors``): see grpolens/profiles/<trainer>.py.


@dataclass
class Row:
    step: int
    key: str
    logged: float | None
    ours: float | None
    status: str
    #: why the run does not determine the value (status ``undetermined``)
    why: str = ""

    def __str__(self) -> str:
        line = f"{self.status:8s} step {self.step:3d} {self.key:40s} logged={self.logged!r:24s} grpolens={self.ours!r}"
        return f"{line}: {self.why}" if self.why else line


def close(a: float | None, b: float | None, rtol: float = RTOL, atol: float = ATOL) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= atol + rtol * max(abs(a), abs(b))


def read_log(path: os.PathLike | str) -> dict[int, dict]:
    """Step -> the values logged at that step (lines without a step are skipped). TRL's end-of-
    training summary (``train_runtime``...) is kept: it carries the metrics of the last, unfinished
    logging window."""
    from grpolens.run.format import as_run

    path = as_run(path)  # a local file, or an object (s3://...: a run's own log lives with it)
    if not path.is_file():
        raise UserError(f"--log: no such file {path}")
    out: dict[int, dict] = {}
    text = path.read_text()
    openrlhf_console = _OPENRLHF_LINE.search(text) is not None
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if openrlhf_console:  # OpenRLHF's console log: only its per-step status lines count
            rec = _openrlhf_status(line, path, i)
            if rec is None:
                continue
        else:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{i}: not a JSON object ({e.msg})") from None
        if not isinstance(rec, dict):
            raise UserError(f"{path}:{i}: not a JSON object")
        if "step" not in rec and "train/global_step" in rec:  # OpenRLHF's wandb/TensorBoard keys, exported
            rec = {"step": rec["train/global_step"], **rec}
        gm = rec.get("global_step/max_steps")
        done = gm.split("/", 1)[0].strip() if isinstance(gm, str) else ""
        if "step" not in rec and done.isascii() and done.isdigit():
            rec = {"step": int(done), **rec}  # ms-swift's logging.jsonl ("N/M")
        step = rec.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            continue
        if set(rec) == {"step", "data"} and isinstance(rec["data"], dict):  # verl's file logger
            rec = {"step": step, **rec["data"]}
        out.setdefault(int(step), {}).update(rec)
    if not out:
        raise UserError(f"{path}: no line with a numeric 'step' key")
    return out


#: OpenRLHF's console line per global step (``PPOTrainer.fit``: ``✨ Global step N: {status}``)
_OPENRLHF_LINE = re.compile(r"Global step ([0-9]+): (\{.*\})\s*$", re.MULTILINE)


def _openrlhf_status(line: str, path, i: int) -> dict | None:
    """The status dict of an OpenRLHF console line, under the names its loggers write
    (``train/<key>``), or None for any other line. The dict is Python's repr of plain numbers:
    read with ``ast.literal_eval``, which evaluates literals only (the line is untrusted)."""
    import ast

    m = _OPENRLHF_LINE.search(line)
    if m is None:
        return None
    try:
        status = ast.literal_eval(m.group(2))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise UserError(f"{path}:{i}: an OpenRLHF status line whose dict is not plain literals") from None
    if not isinstance(status, dict):
        raise UserError(f"{path}:{i}: an OpenRLHF status line without a dict")
    return {"step": int(m.group(1)), **{f"train/{k}": v for k, v in status.items() if isinstance(k, str)}}


def compare(run: os.PathLike | str, log: os.PathLike | str | None = None, *, profile: str = "trl",
            rtol: float = RTOL, atol: float = ATOL, overrides: dict | None = None) -> list[Row]:
    """One :class:`Row` per (step, key) the log and the profile's recompute have in common."""
    from grpolens import plugins
    from grpolens.analysis.recompute import recompute

    from grpolens.run.format import as_run

    run = as_run(run)
    prof = plugins.get(profile)
    if log is None:
        if prof.log_file is None:
            raise UserError(f"--log: profile {profile!r} has no default log file; name one with --log")
        log = run / "grpolens" / prof.log_file
    logged = read_log(log)
    df = recompute(run, profile=profile, write=False, overrides=overrides)
    produced = set(df.columns) - {"step"}
    ours = {int(r["step"]): r for r in df.iter_rows(named=True)}
    keys_logged = {k for rec in logged.values() for k in rec}
    floors = prof.float32_floors
    rows: list[Row] = []
    for step, rec in sorted(logged.items()):
        mine = ours.get(step, {})
        for key, val in rec.items():
            tol = 0.0
            if isinstance(val, str):  # a number formatted by the trainer: compare at its rounding
                text = val.strip()
                try:
                    val = float(text)
                except ValueError:
                    continue
                decimals = len(text.split(".", 1)[1]) if "." in text and "e" not in text.lower() else None
                tol = 0.5 * 10.0 ** -decimals if decimals is not None else 0.0
            if key not in produced or (val is not None and not isinstance(val, (int, float))) or isinstance(val, bool):
                continue
            got = mine.get(key)
            if val is None and got is None:
                rows.append(Row(step, key, val, got, "ok"))
            elif got is None:
                why = "; ".join(w for col, w in prof.undetermined.get(key, ()) if mine.get(col))
                rows.append(Row(step, key, val, None, "undetermined", why) if why else Row(step, key, val, None, "missing"))
            elif val is None:
                rows.append(Row(step, key, None, got, "extra"))
            else:
                ok = close(float(val), float(got), rtol, max(atol, floors.get(key, 0.0), tol * (1 + 1e-9)))
                rows.append(Row(step, key, val, got, "ok" if ok else "mismatch"))
        for key, got in mine.items():
            if key in produced and key in keys_logged and key not in rec and got is not None:
                rows.append(Row(step, key, None, got, "extra"))
    return rows


def failed(rows: list[Row]) -> list[Row]:
    """The rows that disagree: every status but ``ok`` and ``undetermined``."""
    return [r for r in rows if r.status not in ("ok", "undetermined")]


def summary(rows: list[Row]) -> str:
    bad = [r for r in rows if r.status != "ok"]
    keys = sorted({r.key for r in rows})
    ok_keys = sorted({r.key for r in rows} - {r.key for r in bad})
    lines = [f"{len(rows) - len(bad)}/{len(rows)} values agree; metrics all agreeing: {len(ok_keys)}/{len(keys)}"]
    lines += [str(r) for r in bad]
    return "\n".join(lines)
