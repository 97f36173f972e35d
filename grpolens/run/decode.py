"""Turning token ids back into text for display, when the run says how.

The manifest config may name ``vocab_file`` (a JSON list of token strings, or an object
id -> string; a relative path is relative to the run) or ``tokenizer`` (a Hugging Face tokenizer
name or directory, loaded from local files only, when transformers is installed). Without
either, tokens show as ``⟨id⟩``. Decoded text is untrusted: see :mod:`grpolens.text`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


def make_decoder(run: Path, cfg: dict) -> tuple[Callable[[int], str], str]:
    """A function id -> text and a word saying where it comes from ("vocab", "tokenizer", "ids")."""
    vocab = cfg.get("vocab_file")
    if vocab:
        p = Path(vocab)
        if not p.is_absolute():
            p = run / p
        try:
            data = json.loads(p.read_text())
            table = {int(k): str(v) for k, v in data.items()} if isinstance(data, dict) else dict(enumerate(map(str, data)))
            return (lambda i: table.get(int(i), f"⟨{int(i)}⟩")), "vocab"
        except (OSError, ValueError, TypeError):
            pass
    name = cfg.get("tokenizer")
    if name:
        try:
            from transformers import AutoTokenizer  # optional

            tok = AutoTokenizer.from_pretrained(str(name), local_files_only=True)
            return (lambda i: tok.decode([int(i)])), "tokenizer"
        except Exception:  # noqa: BLE001 - no tokenizer available offline: fall back to ids
            pass
    return (lambda i: f"⟨{int(i)}⟩"), "ids"
