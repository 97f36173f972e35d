"""Train TRL's real GRPOTrainer on CPU for a few steps with a tiny random model, through grpolens.

Nothing is downloaded: a BPE tokenizer is trained on the prompts below and a 2-layer Qwen2 with
random weights is saved to ``OUT/model`` (TRL loads its reference model from that path). Runs in
a few seconds; under ``torchrun --nproc_per_node 2`` (gloo, CPU) each rank runs it.

    python tests/integration/trl_tiny.py OUT [--loss-type dapo] [--grad-accum 2] ...
    torchrun --nproc_per_node 2 tests/integration/trl_tiny.py OUT ...

Writes ``OUT/run`` (the grpolens run, TRL's logs in ``OUT/run/grpolens/trl_log.jsonl``) and, from
rank 0, ``OUT/result.json`` (the per-step ``loss`` TRL logged and a digest of the final weights)
and ``OUT/params.pt`` (the final weights), so two runs can be compared for identical training.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

PROMPTS = [
    "write a word with many a letters",
    "say banana",
    "count to three",
    "name an animal",
    "what is a cat",
    "tell me a tale",
    "give a short answer",
    "repeat after me: abracadabra",
]
SPECIALS = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}{% else %}<|assistant|>{{ m['content'] }}<eos>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(vocab_size: int = 48):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(PROMPTS * 4, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer, seed: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, initializer_range=0.2,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


# -- rewards: plain functions of the decoded completion (TRL names them by __name__) ---------------
def _text(c) -> str:
    return c if isinstance(c, str) else c[-1]["content"]


def count_a(completions, **kwargs):
    return [float(_text(c).count("a")) for c in completions]


def brevity(completions, completion_ids, **kwargs):
    return [-0.25 * len(ids) for ids in completion_ids]


def sometimes_none(completions, completion_ids, **kwargs):
    """Cannot score completions of odd length (TRL turns None into NaN and skips it)."""
    return [None if len(ids) % 2 else float(len(set(ids))) for ids in completion_ids]


def simulated_rollout(noise: float, seed: int):
    """A ``rollout_func`` standing in for vLLM: samples with HF generate and returns the sampled tokens'
    log-probs (of logits / temperature) plus N(0, noise) from its own generator, so that TRL's vLLM
    importance-sampling branch has a rollout engine that differs slightly from the trainer."""
    import torch
    from transformers import GenerationConfig

    gen = torch.Generator().manual_seed(seed)

    def rollout(prompts, trainer):
        tok = trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        cfg = GenerationConfig(max_new_tokens=trainer.args.max_completion_length, do_sample=True,
                               temperature=trainer.args.temperature, top_k=0, top_p=1.0,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        out_p, out_c, out_l = [], [], []
        with torch.no_grad():
            for ids in prompt_ids:
                x = torch.tensor([ids])
                res = model.generate(x, generation_config=cfg, output_scores=True, return_dict_in_generate=True)
                new = res.sequences[0, len(ids):].tolist()
                if tok.eos_token_id in new:
                    new = new[: new.index(tok.eos_token_id) + 1]
                lps = [torch.log_softmax(res.scores[t][0].float(), -1)[tok_id].item() for t, tok_id in enumerate(new)]
                lps = [lp + float(torch.randn(1, generator=gen)) * noise for lp in lps]
                out_p.append(ids), out_c.append(new), out_l.append(lps)
        return {"prompt_ids": out_p, "completion_ids": out_c, "logprobs": out_l}

    return rollout


#: Named configurations used by the tests and ``sample_runs/make_trl_tiny.py``. Each makes TRL clip,
#: compute a KL and truncate completions within 4 steps (num_iterations=2: steps 2 and 4 are second
#: passes over a generation batch, with a ratio away from 1).
CONFIGS: dict[str, list[str]] = {
    "dapo": [],  # TRL's default loss; 2 micro-batches per step, beta 0.04, eps 0.05/0.08
    "grpo_masked": ["--loss-type", "grpo", "--mask-truncated-completions", "--delta", "1.03"],
    "cispo": ["--loss-type", "cispo", "--epsilon-high", "1.02"],
    "gspo": ["--loss-type", "grpo", "--importance-sampling-level", "sequence", "--epsilon", "0.01",
             "--epsilon-high", "0.015"],
    "gspo_masked": ["--loss-type", "grpo", "--importance-sampling-level", "sequence", "--mask-truncated-completions",
                    "--epsilon", "0.003", "--epsilon-high", "0.004"],
    "dr_grpo": ["--loss-type", "dr_grpo", "--temperature", "0.7", "--nan-reward", "--scale-rewards", "batch"],
    "is_sequence_mask": ["--simulate-vllm-is", "sequence_mask"],
    "is_token_truncate": ["--simulate-vllm-is", "token_truncate", "--is-clip-min", "0.97", "--is-clip-max", "1.03"],
    # 4 loss calls per step, a generation every 2: two generation rounds per optimizer step
    "two_generations_per_step": ["--grad-accum", "4", "--per-device-batch", "4", "--steps-per-generation", "2",
                                 "--num-iterations", "1"],
    # for torchrun --nproc_per_node 2: 4 completions per rank and micro-batch
    "ddp": ["--per-device-batch", "4"],
}

#: TRL as users leave it: GRPOConfig's defaults (logging_steps=10, dapo, beta 0, num_iterations 1,
#: lr 1e-6, 8 completions per prompt ...) plus the one or two options each case is about. Enough
#: steps for two logging windows and an unfinished one (logged with TRL's end-of-training summary).
DEFAULT_CONFIGS: dict[str, list[str]] = {
    "defaults": ["--trl-defaults", "--max-steps", "23"],
    "defaults_window5_ga2_iter2_beta": ["--trl-defaults", "--logging-steps", "5", "--grad-accum", "2",
                                        "--num-iterations", "2", "--beta", "0.04", "--max-steps", "12"],
    "defaults_gspo": ["--trl-defaults", "--importance-sampling-level", "sequence", "--max-steps", "12"],
    "defaults_steps_per_generation": ["--trl-defaults", "--steps-per-generation", "2", "--max-steps", "12"],
    "defaults_first_step": ["--trl-defaults", "--logging-first-step", "--max-steps", "12"],
    "defaults_epoch": ["--trl-defaults", "--logging-strategy", "epoch", "--max-steps", "-1",
                       "--num-train-epochs", "3", "--num-generations", "4"],
    "defaults_no_logging": ["--trl-defaults", "--logging-strategy", "no", "--max-steps", "5"],
    # for torchrun --nproc_per_node 2: 4 completions per rank, one group of 8 per step
    "defaults_ddp": ["--trl-defaults", "--per-device-batch", "4", "--max-steps", "12"],
}
#: This script's clipping setup (lr 1e-4, eps 0.05/0.08, num_iterations 2, beta 0.04) with logging
#: windows that cut generation rounds unevenly (generations at steps 1, 3, 5; logs at 3 and, in the
#: summary, 5), one per loss type TRL 1.16 has, plus GSPO, rounds within a step and vLLM-IS.
WINDOW = ["--logging-steps", "3", "--max-steps", "5"]
WINDOW_CONFIGS: dict[str, list[str]] = {
    **{f"window_{lt}": ["--loss-type", lt, *WINDOW] for lt in ("grpo", "dapo", "dr_grpo", "bnpo", "sapo", "vespo")},
    "window_cispo": ["--loss-type", "cispo", "--epsilon-high", "1.02", *WINDOW],
    "window_luspo": ["--loss-type", "luspo", "--importance-sampling-level", "sequence", "--epsilon", "0.01",
                     "--epsilon-high", "0.015", *WINDOW],
    "window_gspo": [*CONFIGS["gspo"], *WINDOW],
    "window_two_generations_per_step": [*CONFIGS["two_generations_per_step"], *WINDOW],
    "window_is_sequence_mask": [*CONFIGS["is_sequence_mask"], *WINDOW],
    # VESPO folds the vLLM IS weights into φ: truncation at a band that cuts the simulated engine's noise,
    # and masking at a wider one (a masked token puts ln 1e-8 into its sequence's φ)
    "window_vespo_is_token_truncate": ["--loss-type", "vespo", "--simulate-vllm-is", "token_truncate",
                                       "--is-clip-min", "0.97", "--is-clip-max", "1.03", *WINDOW],
    "window_vespo_is_token_mask": ["--loss-type", "vespo", "--simulate-vllm-is", "token_mask",
                                   "--is-clip-min", "0.9", "--is-clip-max", "1.1", *WINDOW],
    "window_ddp": [*CONFIGS["ddp"], *WINDOW],
}
CONFIGS.update(DEFAULT_CONFIGS)
CONFIGS.update(WINDOW_CONFIGS)


#: The values this script uses for an option the command line does not give. ``--trl-defaults``
#: leaves every one of them to GRPOConfig instead (its defaults: dapo, beta 0, epsilon 0.2,
#: num_iterations 1, lr 1e-6, logging_steps 10, ...), except what a CPU needs and the tiny sizes.
SCRIPT_DEFAULTS = dict(loss_type="dapo", importance_sampling_level="token", epsilon=0.05, epsilon_high=0.08,
                       beta=0.04, num_iterations=2, grad_accum=2, num_generations=4, lr=1e-4, temperature=1.0,
                       scale_rewards="group", logging_steps=1)
#: Sizes that keep a run to seconds on CPU (also under --trl-defaults).
SIZES = dict(per_device_batch=8, max_completion_length=12, max_steps=4)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--trl-defaults", action="store_true",
                   help="leave every training option not given here to GRPOConfig's default")
    p.add_argument("--loss-type")
    p.add_argument("--importance-sampling-level")
    p.add_argument("--epsilon", type=float)
    p.add_argument("--epsilon-high", type=float)
    p.add_argument("--delta", type=float, default=None)
    p.add_argument("--beta", type=float)
    p.add_argument("--num-iterations", type=int)
    p.add_argument("--steps-per-generation", type=int, default=None)
    p.add_argument("--grad-accum", type=int)
    p.add_argument("--per-device-batch", type=int)
    p.add_argument("--num-generations", type=int)
    p.add_argument("--max-completion-length", type=int)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--num-train-epochs", type=float, default=None, help="train by epochs (with --max-steps -1)")
    p.add_argument("--lr", type=float)
    p.add_argument("--temperature", type=float)
    p.add_argument("--scale-rewards")
    p.add_argument("--logging-steps", type=float)
    p.add_argument("--logging-first-step", action="store_true")
    p.add_argument("--logging-strategy", default=None, help="steps | epoch | no")
    p.add_argument("--mask-truncated-completions", action="store_true")
    p.add_argument("--nan-reward", action="store_true", help="add a reward function that returns None sometimes")
    p.add_argument("--simulate-vllm-is", default=None, metavar="MODE",
                   help="token_truncate | token_mask | sequence_truncate | sequence_mask")
    p.add_argument("--is-clip-min", type=float, default=None)
    p.add_argument("--is-clip-max", type=float, default=3.0)
    p.add_argument("--no-grpolens", action="store_true", help="plain GRPOTrainer (for the no-change check)")
    p.add_argument("--no-text", action="store_true")
    p.add_argument("--run-name", default=None, help="the run's name in its manifest (default: the directory's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grpolens-mode", default="new", help="new | resume | overwrite (an existing run in OUT/run)")
    p.add_argument("--grpolens-dir", default=None, help="where the run goes [default: OUT/run]; s3://... writes to object storage")
    a = p.parse_args(argv)
    for k, v in SIZES.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if not a.trl_defaults:
        for k, v in SCRIPT_DEFAULTS.items():
            if getattr(a, k) is None:
                setattr(a, k, v)
    if a.logging_steps is not None and a.logging_steps >= 1:
        a.logging_steps = int(a.logging_steps)
    return a


def grpo_options(a) -> dict:
    """GRPOConfig keyword arguments for the options that were given (or have a script default)."""
    names = dict(grad_accum="gradient_accumulation_steps", lr="learning_rate", per_device_batch="per_device_train_batch_size")
    keys = ["loss_type", "importance_sampling_level", "epsilon", "epsilon_high", "delta", "beta", "num_iterations",
            "steps_per_generation", "grad_accum", "per_device_batch", "num_generations", "max_completion_length",
            "max_steps", "num_train_epochs", "lr", "temperature", "scale_rewards", "logging_steps", "logging_strategy"]
    out = {names.get(k, k): getattr(a, k) for k in keys if getattr(a, k) is not None}
    if a.logging_first_step:
        out["logging_first_step"] = True
    if a.mask_truncated_completions:
        out["mask_truncated_completions"] = True
    return out


def main(argv=None) -> None:
    a = parse(argv)
    import torch

    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpolens.integrations.trl import GRPOLensTrainer

    out = Path(a.out)
    rank = int(os.environ.get("RANK", "0"))
    model_dir = out / "model"
    # Built in memory on every rank (BPE training is deterministic): transformers' AutoTokenizer
    # would reload it with another pre-tokenizer and decoder.
    tokenizer = build_tokenizer()
    if rank == 0:
        build_model(tokenizer, a.seed).save_pretrained(model_dir)
        (model_dir / "ready").write_text("")
    while not (model_dir / "ready").exists():  # the other ranks wait for rank 0's weights
        time.sleep(0.05)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    rewards = [count_a, brevity] + ([sometimes_none] if a.nan_reward else [])

    extra = {}
    if a.simulate_vllm_is:
        extra = dict(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=a.simulate_vllm_is,
                     vllm_importance_sampling_clip_min=a.is_clip_min, vllm_importance_sampling_clip_max=a.is_clip_max)
    args = GRPOConfig(
        output_dir=str(out / "trainer"), **grpo_options(a), save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, gradient_checkpointing=False, seed=a.seed, data_seed=a.seed, **extra,
        **({} if a.trl_defaults else dict(lr_scheduler_type="constant", disable_dropout=True)),
    )

    losses: dict[int, float] = {}

    class KeepLoss(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses[state.global_step] = logs["loss"]

    kwargs = dict(model=str(model_dir), reward_funcs=rewards, args=args, train_dataset=dataset,
                  processing_class=tokenizer, callbacks=[KeepLoss()])
    if a.simulate_vllm_is:
        kwargs["rollout_func"] = simulated_rollout(0.05, a.seed + 1000 + rank)
    if a.no_grpolens:
        trainer = GRPOTrainer(**kwargs)
    else:
        trainer = GRPOLensTrainer(**kwargs, grpolens_dir=a.grpolens_dir or out / "run", grpolens_text=not a.no_text,
                                  grpolens_run_name=a.run_name, grpolens_mode=a.grpolens_mode)
    if a.simulate_vllm_is:  # drive TRL's vLLM IS branch with the simulated engine (a test hack, not a recipe)
        from types import SimpleNamespace

        trainer.use_vllm = True
        trainer.vllm_generation = SimpleNamespace(sync_weights=lambda: None)
        trainer._last_loaded_step = -1
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    if rank == 0:
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        torch.save(state, out / "params.pt")
        digest = hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()
        (out / "result.json").write_text(json.dumps({"losses": losses, "params_sha256": digest,
                                                     "train_seconds": seconds, "steps": a.max_steps}))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
