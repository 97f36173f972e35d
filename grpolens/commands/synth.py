"""``grpolens synth OUT``: write a realistic synthetic run, optionally with injected pathologies."""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer


def synth_cmd(
    out: Path = typer.Argument(..., help="Directory to create the run in."),
    steps: int = typer.Option(10, "--steps", help="Optimizer steps."),
    ranks: int = typer.Option(1, "--ranks", help="Data-parallel ranks (world_size)."),
    micro_batches: int = typer.Option(1, "--micro-batches", help="Loss calls per step and rank (gradient accumulation)."),
    groups: int = typer.Option(4, "--groups", help="Prompt groups per step and rank."),
    generations: int = typer.Option(4, "--generations", help="Completions per prompt (>= 2)."),
    max_len: int = typer.Option(256, "--max-len", help="Max completion length; longer completions are truncated."),
    seed: int = typer.Option(0, "--seed", help="Same seed, same data."),
    inject: List[str] = typer.Option([], "--inject", help="KIND@STEP with KIND kl-spike, rollout-drift, "
                                                          "entropy-collapse, nan, clip-drift, advantage-collapse, "
                                                          "length-growth, reward-hacking or clip-inactive. Repeatable."),
    texts: bool = typer.Option(False, "--texts/--no-texts", help="Write fake prompt/completion texts (with hostile markup)."),
    vocab: int = typer.Option(32_000, "--vocab", help="Vocabulary size for token ids."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it is an existing grpolens run."),
    resume: bool = typer.Option(False, "--resume", help="Continue the synthetic run in OUT (same settings, --steps may "
                                                        "be more): keep its complete steps, write the others."),
) -> None:
    """Write a synthetic GRPO run through the training-side writer.

    Ratios, KL to the reference, entropy, rollout mismatch, rewards and advantages look like real
    training; --inject adds a pathology at a step and leaves every other step identical to the
    clean run of the same seed.
    """
    import time

    from rich.console import Console

    from grpolens.adapters.synth import synth_run

    t0 = time.perf_counter()
    path = synth_run(out, steps=steps, ranks=ranks, micro_batches=micro_batches, groups=groups,
                     generations=generations, max_len=max_len, seed=seed, vocab=vocab, texts=texts,
                     inject=inject, overwrite=overwrite, resume=resume)
    Console(stderr=True).print(f"wrote {path} ({steps} steps × {ranks} ranks) in {time.perf_counter() - t0:.2f}s",
                               highlight=False, markup=False)


def register(app: typer.Typer) -> None:
    app.command("synth")(synth_cmd)
