"""A Hugging Face cache holding one tokenizer, as ``huggingface_hub`` lays it out on disk, for tests
of loading a hub name offline (point ``HF_HUB_CACHE`` at the directory returned)."""

from __future__ import annotations

from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo_id: str, tokenizer_json: Path) -> Path:
    """``root`` made a cache holding ``repo_id`` (``org/name``) at one snapshot: the tokenizer of
    ``tokenizer_json`` saved by transformers, and the model config AutoTokenizer reads first."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tokenizer_json))).save_pretrained(snapshot)
    (snapshot / "config.json").write_text('{"model_type": "gpt2"}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root
