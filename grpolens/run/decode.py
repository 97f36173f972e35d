"""Turning token ids back into text for display, when the run says how.

In order: the run's own ``tokenizer.json`` (a Hugging Face *fast* tokenizer saved by the TRL
integration, read with the ``tokenizers`` library: offline, no transformers), a ``vocab_file`` named
in the manifest config (a JSON list of token strings, or an object id -> string; a path relative to
the run, which must stay inside it: a manifest naming a file outside the run is refused with a
RunFormatError), or a ``tokenizer`` named there (a Hugging Face tokenizer name or a directory inside
the run, loaded from local files only, when transformers is installed). Without any of them tokens show as
``⟨id⟩`` and :func:`describe` says why. Decoded text is untrusted: see :mod:`grpolens.text`.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Callable

#: The run's tokenizer, beside grpolens.json (docs/run-format.md).
TOKENIZER_FILE = "tokenizer.json"

_DESCRIBE = {
    "tokenizer.json": "decoded with the run's tokenizer.json",
    "vocab": "decoded with the run's vocab_file",
    "tokenizer": "decoded with the tokenizer named in the run's config",
    "ids": f"token ids: the run has no {TOKENIZER_FILE} (the TRL integration saves one; copy the model's "
           f"tokenizer.json into the run to add it) and names no vocab_file",
}


def describe(source: str) -> str:
    """One line saying how tokens are shown, and for ``"ids"`` why."""
    return _DESCRIBE.get(source, source)


class TokenizerFileError(Exception):
    """A ``tokenizer.json`` the ``tokenizers`` library does not load; the message is the first line of
    its error (or the error's class, for one without a message)."""


def load_tokenizer_file(path, *, remote: bool):
    """The ``tokenizers.Tokenizer`` of a ``tokenizer.json`` (``remote``: an object read as text), or
    :class:`TokenizerFileError` for any failure to load it, a panic in the library's Rust code too:
    pyo3 raises that as ``PanicException``, a ``BaseException``, which ``except Exception`` lets through."""
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_str(path.read_text()) if remote else Tokenizer.from_file(str(path))
    except BaseException as e:  # noqa: BLE001 - see the docstring; Ctrl-C and exit go through
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        text = str(e)
        raise TokenizerFileError(text.splitlines()[0] if text else type(e).__name__) from None


_HUB_OFFLINE_LOCK = threading.Lock()


def load_pretrained_tokenizer(name: str):
    """transformers' tokenizer for a hub name or a local directory, from local files only, with the
    Hugging Face client held offline while it loads: ``local_files_only`` alone does not stop
    huggingface_hub from asking the Hub for things of its own (an agent registry, since 2.x), and
    nothing leaves the machine unless the user asks. Raises whatever transformers raises."""
    import huggingface_hub.constants as hub  # a dependency of transformers

    from transformers import AutoTokenizer  # optional

    # The switch is a process global: loads take turns (the dashboard serves from threads), or one
    # thread's restore would put the client back online while another thread's load runs.
    with _HUB_OFFLINE_LOCK:
        offline = hub.HF_HUB_OFFLINE
        hub.HF_HUB_OFFLINE = True
        try:
            return AutoTokenizer.from_pretrained(name, local_files_only=True)
        finally:
            hub.HF_HUB_OFFLINE = offline


def make_decoder(run: Path, cfg: dict) -> tuple[Callable[[int], str], str]:
    """A function id -> text and a word saying where it comes from ("tokenizer.json", "vocab",
    "tokenizer", "ids"); see :func:`describe`."""
    from grpolens.run.format import as_run, is_remote_run, referenced_path_problem, run_file

    run = as_run(run)  # a local directory, or a run on object storage (its files read as objects)
    path = run / TOKENIZER_FILE
    if path.is_file():
        try:
            tok = load_tokenizer_file(path, remote=is_remote_run(run))
            # one id at a time, special tokens kept: the views show every token the loss saw
            return (lambda i: tok.decode([int(i)], skip_special_tokens=False)), "tokenizer.json"
        except TokenizerFileError:  # an unreadable tokenizer.json (validate names it): ids
            pass
    vocab = cfg.get("vocab_file")
    if vocab:
        p = run_file(run, "vocab_file", vocab)  # inside the run, or RunFormatError
        try:
            data = json.loads(p.read_text())
            table = {int(k): str(v) for k, v in data.items()} if isinstance(data, dict) else dict(enumerate(map(str, data)))
            return (lambda i: table.get(int(i), f"⟨{int(i)}⟩")), "vocab"
        except (OSError, ValueError, TypeError, RecursionError):
            pass
    name = cfg.get("tokenizer")
    if name:
        problem = referenced_path_problem(run, "tokenizer", name)
        if problem:
            from grpolens.run.format import MANIFEST_NAME, RunFormatError

            raise RunFormatError(run / MANIFEST_NAME, problem)
        if not is_remote_run(run) and (run / str(name)).is_dir():
            name = run / str(name)  # a tokenizer directory inside the run (local runs only)
        try:
            tok = load_pretrained_tokenizer(str(name))
            return (lambda i: tok.decode([int(i)])), "tokenizer"
        except Exception:  # noqa: BLE001 - no tokenizer available offline: fall back to ids
            pass
    return (lambda i: f"⟨{int(i)}⟩"), "ids"
