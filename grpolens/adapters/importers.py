"""Import existing generation dumps into a grpolens run (a ``samples`` table, no ``tokens``).

Two sources:

``verl-jsonl``       verl's ``trainer.rollout_data_dir`` (or ``validation_data_dir``): one
                     ``<global_step>.jsonl`` per step, one JSON object per completion with
                     ``input``, ``output``, ``score``, ``step``, optionally ``gts`` and every
                     reward-info key (``acc``, ...).
``maxent-sidecars``  MaxEnt-GRPO's rich-completion sidecars ``rich_completions/<key>_step_<NNNNNN>.json``:
                     ``{"columns": [...], "data": [[...], ...]}`` written by ``json.dump``, so
                     missing values are bare ``NaN`` literals (accepted here).

What such a run can and cannot give is fixed by what the dumps hold: text and scores, no
per-token log-probs. :func:`capabilities` states it; the CLI prints it and ``docs/import.md``
repeats it.

Everything is read and checked before anything is written; the run is written into a temporary
directory beside ``OUT`` and renamed at the end, so a failed import leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from grpolens.run import format as fmt
from grpolens.errors import UserError

__all__ = ["ImportResult", "import_verl_jsonl", "import_maxent_sidecars", "capabilities", "SOURCES"]

SOURCES = ("verl-jsonl", "maxent-sidecars")
#: ``sample_id = step * SAMPLE_ID_STRIDE + row`` (row: position of the completion within its step).
SAMPLE_ID_STRIDE = 1_000_000
#: verl keys that are not reward components.
_VERL_NOT_REWARDS = {"input", "output", "gts", "score", "step"}
#: MaxEnt sidecar columns with a home in the samples table (the others are listed as dropped).
_MAXENT_USED = {"step", "prompt_index", "completion_index", "group_size", "prompt", "completion", "reward_total",
                "advantage"}
_SIDECAR_RE = re.compile(r"^(?P<key>.+)_step_(?P<step>[0-9]+)\.json$")


@dataclass
class ImportResult:
    out: Path
    source: str
    steps: list[int]
    completions: int
    length_unit: str
    truncation_known: bool
    has_advantage: bool
    dropped_columns: list[str] = field(default_factory=list)

    def statement(self) -> str:
        return capabilities(self)


def capabilities(r: ImportResult) -> str:
    """What an imported run can and cannot give (printed by ``grpolens import``)."""
    unit = "tokens" if r.length_unit == "tokens" else "characters (pass --tokenizer to count tokens)"
    can = ["rewards: reward/* and rewards/<name>/* (mean, std, quantiles, non-finite counts)",
           "prompt-group statistics: frac_reward_zero_std, group spread of rewards",
           f"completion lengths, in {unit}",
           "diversity per prompt group (from the text), and the completions themselves (text)"]
    if r.has_advantage:
        can.append("advantages as the trainer logged them (advantage/*)")
    if r.truncation_known:
        can.append("truncation: completions of --max-response-length tokens or more count as truncated")
    cannot = ["no per-token data, so no policy metrics: policy ratio, clipping, KL to the reference, entropy, "
              "rollout importance sampling and train-inference mismatch, losses, token drill-down",
              "prompt lengths and num_tokens (the dumps hold decoded text, not token counts)"]
    if not r.truncation_known:
        cannot.append("truncation: unknown, every completion is recorded as not truncated "
                      "(verl-jsonl: pass --tokenizer and --max-response-length)")
    if not r.has_advantage:
        cannot.append("advantages (not in these dumps)")
    lines = [f"imported {r.completions} completions over {len(r.steps)} step(s) from {r.source} into {r.out} "
             "(samples table only)",
             "this run CAN give:", *[f"  + {c}" for c in can],
             "this run CANNOT give:", *[f"  - {c}" for c in cannot]]
    if r.dropped_columns:
        lines.append(f"columns with no place in the samples table (not imported): {', '.join(r.dropped_columns)}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Lengths (characters, or tokens with a tokenizer)
# ---------------------------------------------------------------------------------------------

def load_tokenizer(spec: str | None) -> Callable[[str], int] | None:
    """A function text -> token count from a tokenizer directory / hub cache name (transformers) or
    a ``tokenizer.json`` file (tokenizers); ``None`` without a spec."""
    if spec is None:
        return None
    path = Path(spec)
    if path.is_file() and path.suffix == ".json":
        try:
            import tokenizers  # noqa: F401 - only whether it is installed, for this message
        except ImportError:
            raise UserError("--tokenizer: reading tokenizer.json needs the 'tokenizers' package") from None
        from grpolens.run.decode import TokenizerFileError, load_tokenizer_file

        try:
            tok = load_tokenizer_file(path, remote=False)  # a local file the user named
        except TokenizerFileError as e:
            raise UserError(f"--tokenizer: {path} is not a tokenizers JSON file ({e})") from None
        return lambda text: len(tok.encode(text, add_special_tokens=False).ids)
    try:
        import transformers  # noqa: F401 - only whether it is installed, for this message
    except ImportError:
        raise UserError("--tokenizer: needs the 'transformers' package (or give a tokenizer.json file)") from None
    from grpolens.run.decode import load_pretrained_tokenizer

    try:
        tok = load_pretrained_tokenizer(spec)
    except Exception as e:  # noqa: BLE001 - any loading failure is the user's path
        raise UserError(f"--tokenizer: cannot load {spec!r} from local files: {e}") from None
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

def _number(v: Any) -> float:
    """A JSON value as a float reward: None/null/NaN and non-numbers -> NaN (stored as null)."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return math.nan


def _write_run(out: Path, steps: dict[int, dict[str, Any]], trainer: dict, imported: dict, overwrite: bool) -> None:
    """Write ``steps`` (step -> samples columns) as a run at ``out``, atomically."""
    from grpolens.capture.writer import ShardWriter

    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        if not overwrite:
            raise UserError(f"{out} exists and is not empty; choose a new directory or pass --overwrite")
        if not fmt.is_run(out):
            raise UserError(f"--overwrite: {out} is not a grpolens run (no grpolens.json); refusing to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.import-", dir=out.parent))
    try:
        manifest = fmt.Manifest(run_name=out.name, world_size=1, trainer=trainer, config={},
                                extra={"imported": imported})
        writer = ShardWriter(tmp, 0, 1, manifest=manifest)
        for step in sorted(steps):
            writer.add_samples(step, steps[step])
            writer.end_step(step)
        writer.close()
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _columns(rows: list[dict[str, Any]], step: int, reward_names: Iterable[str], count: Callable[[str], int] | None,
             max_len: int | None) -> dict[str, Any]:
    n = len(rows)
    texts = [r["completion"] for r in rows]
    lengths = np.array([count(t) if count else len(t) for t in texts], dtype=np.int64)
    truncated = lengths >= max_len if (count is not None and max_len is not None) else np.zeros(n, bool)
    cols: dict[str, Any] = {
        "sample_id": step * SAMPLE_ID_STRIDE + np.arange(n, dtype=np.int64),
        "group_id": np.array([r["group"] for r in rows], dtype=np.int64),
        "completion_len": lengths,
        "truncated": truncated,
        "reward": np.array([_number(r.get("reward")) for r in rows]),
        "prompt": [r.get("prompt") for r in rows],
        "completion": texts,
    }
    if any("advantage" in r for r in rows):
        cols["advantage"] = np.array([_number(r.get("advantage")) for r in rows])
    for name in reward_names:
        cols[fmt.REWARD_PREFIX + name] = np.array([_number(r["rewards"].get(name)) for r in rows])
    return cols


def _reward_name(key: str) -> str:
    return key.replace("/", "_")


def _group_by_prompt(rows: list[dict[str, Any]], step: int) -> None:
    """group = the step's index of the first completion with the same prompt text."""
    first: dict[Any, int] = {}
    for i, r in enumerate(rows):
        r["group"] = step * SAMPLE_ID_STRIDE + first.setdefault(r.get("prompt"), i)


# ---------------------------------------------------------------------------------------------
# verl rollout_data_dir JSONL
# ---------------------------------------------------------------------------------------------

def read_verl_jsonl(src: Path) -> dict[int, list[dict[str, Any]]]:
    """Step -> rows (``prompt``, ``completion``, ``reward``, ``rewards``) from a verl dump directory."""
    src = Path(src)
    if not src.is_dir():
        raise UserError(f"{src}: not a directory (expected verl's rollout_data_dir with <step>.jsonl files)")
    files = sorted(src.glob("*.jsonl"))
    if not files:
        raise UserError(f"{src}: no *.jsonl files (verl writes <global_step>.jsonl into rollout_data_dir)")
    steps: dict[int, list[dict[str, Any]]] = {}
    for path in files:
        name_step = int(path.stem) if path.stem.isascii() and path.stem.isdigit() else None
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{where}: not valid JSON ({e.msg})") from None
                if not isinstance(rec, dict):
                    raise UserError(f"{where}: expected a JSON object per line")
                for key in ("input", "output"):
                    if not isinstance(rec.get(key), str):
                        raise UserError(f"{where}: missing or non-text {key!r} (verl dumps input, output, score, step)")
                step = rec.get("step", name_step)
                if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                    raise UserError(f"{where}: no usable step: 'step' is {rec.get('step')!r} and the file name is not a step number")
                extra = {k: v for k, v in rec.items() if k not in _VERL_NOT_REWARDS}
                steps.setdefault(step, []).append({"prompt": rec["input"], "completion": rec["output"],
                                                   "reward": rec.get("score"), "rewards": extra})
    # reward components: the extra keys whose values are all numbers (or null), e.g. acc; not pred/gts
    values: dict[str, list] = {}
    for rows in steps.values():
        for r in rows:
            for k, v in r["rewards"].items():
                values.setdefault(k, []).append(v)
    numeric = {k for k, vs in values.items()
               if any(v is not None for v in vs) and all(v is None or isinstance(v, (int, float)) for v in vs)}
    for rows in steps.values():
        for r in rows:
            r["rewards"] = {_reward_name(k): v for k, v in r["rewards"].items() if k in numeric}
    return steps


def import_verl_jsonl(src: Path, out: Path, *, tokenizer: str | None = None, max_response_length: int | None = None,
                      overwrite: bool = False) -> ImportResult:
    if max_response_length is not None and tokenizer is None:
        raise UserError("--max-response-length needs --tokenizer (lengths must be in tokens to compare)")
    steps = read_verl_jsonl(src)
    count = load_tokenizer(tokenizer)
    names = sorted({k for rows in steps.values() for r in rows for k in r["rewards"]})
    cols = {}
    for step, rows in steps.items():
        _group_by_prompt(rows, step)
        cols[step] = _columns(rows, step, names, count, max_response_length)
    res = ImportResult(Path(out), "verl-jsonl", sorted(steps), sum(map(len, steps.values())),
                       "tokens" if count else "characters", count is not None and max_response_length is not None,
                       has_advantage=False)
    _write_run(out, cols, {"name": "verl", "version": None}, _imported_info(res, src, tokenizer), overwrite)
    return res


# ---------------------------------------------------------------------------------------------
# MaxEnt-GRPO rich-completion sidecars
# ---------------------------------------------------------------------------------------------

def _sidecar_files(src: Path, key: str | None) -> list[tuple[int, Path]]:
    src = Path(src)
    if not src.is_dir():
        raise UserError(f"{src}: not a directory (expected MaxEnt's output_dir or its rich_completions/)")
    base = src / "rich_completions" if (src / "rich_completions").is_dir() else src
    found: dict[str, list[tuple[int, Path]]] = {}
    for p in sorted(base.iterdir()):
        m = _SIDECAR_RE.match(p.name)
        if m and p.is_file():
            found.setdefault(m.group("key"), []).append((int(m.group("step")), p))
    if not found:
        raise UserError(f"{base}: no sidecar files named <key>_step_<NNNNNN>.json")
    if key is None:
        if len(found) > 1:
            raise UserError(f"{base}: sidecars of several tables ({', '.join(sorted(found))}); choose one with --key")
        key = next(iter(found))
    if key not in found:
        raise UserError(f"--key {key!r}: no {key}_step_*.json in {base} (found: {', '.join(sorted(found))})")
    return sorted(found[key])


def read_maxent_sidecars(src: Path, key: str | None = None) -> tuple[dict[int, list[dict[str, Any]]], list[str]]:
    """Step -> rows, and the columns that have no place in the samples table.

    Files are parsed by :func:`grpolens.analysis.sidecars.read_sidecar`, the one reader of the reference's
    format (bare NaN literals, either writer's columns)."""
    from grpolens.analysis.sidecars import read_sidecar

    steps: dict[int, list[dict[str, Any]]] = {}
    dropped: set[str] = set()
    for file_step, path in _sidecar_files(src, key):
        df = read_sidecar(path)
        if df.height and df["completion"].null_count() == df.height:
            raise UserError(f"{path}: no 'completion' column with text (columns: {', '.join(df.columns)})")
        # columns the reader added as nulls are not the file's: only report those with values
        dropped |= {c for c in df.columns if c not in _MAXENT_USED and not c.startswith(fmt.REWARD_PREFIX)
                    and df[c].null_count() < df.height}
        rows = []
        for rec in df.iter_rows(named=True):
            step = rec.get("step")
            step = file_step if not isinstance(step, int) or step < 0 else step
            rows.append({
                "step": step,
                "prompt": rec.get("prompt") if isinstance(rec.get("prompt"), str) else None,
                "completion": rec["completion"] if isinstance(rec["completion"], str) else "",
                "reward": rec.get("reward_total"),
                "advantage": rec.get("advantage"),
                "prompt_index": rec.get("prompt_index"),
                "rewards": {_reward_name(c[len(fmt.REWARD_PREFIX):]): v for c, v in rec.items()
                            if c.startswith(fmt.REWARD_PREFIX) and len(c) > len(fmt.REWARD_PREFIX)},
            })
        for r in rows:
            steps.setdefault(r["step"], []).append(r)
    return steps, sorted(dropped)


def _group_maxent(rows: list[dict[str, Any]], step: int) -> None:
    """group = (step, prompt_index) when the writer knew it; else runs of equal prompt text."""
    if all(isinstance(r.get("prompt_index"), int) and r["prompt_index"] >= 0 for r in rows):
        for r in rows:
            r["group"] = step * SAMPLE_ID_STRIDE + r["prompt_index"]
        return
    group, prev = -1, object()
    for i, r in enumerate(rows):
        if r.get("prompt") != prev or r.get("prompt") is None:
            group, prev = i, r.get("prompt")
        r["group"] = step * SAMPLE_ID_STRIDE + group


def import_maxent_sidecars(src: Path, out: Path, *, key: str | None = None, tokenizer: str | None = None,
                           overwrite: bool = False) -> ImportResult:
    steps, dropped = read_maxent_sidecars(src, key)
    count = load_tokenizer(tokenizer)
    names = sorted({k for rows in steps.values() for r in rows for k in r["rewards"]})
    cols = {}
    has_adv = any(isinstance(r.get("advantage"), (int, float)) and not isinstance(r.get("advantage"), bool)
                  and math.isfinite(r["advantage"]) for rows in steps.values() for r in rows)
    for step, rows in steps.items():
        _group_maxent(rows, step)
        if not has_adv:
            for r in rows:
                r.pop("advantage", None)
        cols[step] = _columns(rows, step, names, count, None)
    res = ImportResult(Path(out), "maxent-sidecars", sorted(steps), sum(map(len, steps.values())),
                       "tokens" if count else "characters", False, has_adv, dropped)
    _write_run(out, cols, {"name": "maxent-grpo", "version": None}, _imported_info(res, src, tokenizer), overwrite)
    return res


def _imported_info(r: ImportResult, src: Path, tokenizer: str | None) -> dict[str, Any]:
    return {"source": r.source, "from": str(Path(src).resolve()), "length_unit": r.length_unit,
            "tokenizer": tokenizer, "truncation_known": r.truncation_known, "per_token_data": False}
