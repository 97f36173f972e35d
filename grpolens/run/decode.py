"""Turning token ids back into text for display, when the run says how.

The manifest config may name ``vocab_file`` (a JSON list of token strings, or an object
id -> string; a path relative to the run, which must stay inside it) or ``tokenizer`` (a Hugging
Face tokenizer name, or a directory inside the run, loaded from local files only, when transformers
is installed). A manifest naming a file outside the run is refused (RunFormatError). Without
either, tokens show as ``⟨id⟩``. Decoded text is untrusted: see :mod:`grpolens.text`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


def make_decoder(run: Path, cfg: dict) -> tuple[Callable[[int], str], str]:
    """A function id -> text and a word saying where it comes from ("vocab", "tokenizer", "ids")."""
    from grpolens.run.format import referenced_path_problem, run_file

    vocab = cfg.get("vocab_file")
    if vocab:
        p = run_file(run, "vocab_file", vocab)  # inside the run, or RunFormatError
        try:
            data = json.loads(p.read_text())
            table = {int(k): str(v) for k, v in data.items()} if isinstance(data, dict) else dict(enumerate(map(str, data)))
            return (lambda i: table.get(int(i), f"⟨{int(i)}⟩")), "vocab"
        except (OSError, ValueError, TypeError):
            pass
    name = cfg.get("tokenizer")
    if name:
        problem = referenced_path_problem(run, "tokenizer", name)
        if problem:
            from grpolens.run.format import MANIFEST_NAME, RunFormatError

            raise RunFormatError(run / MANIFEST_NAME, problem)
        if (run / str(name)).is_dir():
            name = run / str(name)  # a tokenizer directory inside the run
        try:
            from transformers import AutoTokenizer  # optional

            tok = AutoTokenizer.from_pretrained(str(name), local_files_only=True)
            return (lambda i: tok.decode([int(i)])), "tokenizer"
        except Exception:  # noqa: BLE001 - no tokenizer available offline: fall back to ids
            pass
    return (lambda i: f"⟨{int(i)}⟩"), "ids"
