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


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--importance-sampling-level", default="token")
    p.add_argument("--epsilon", type=float, default=0.05)
    p.add_argument("--epsilon-high", type=float, default=0.08)
    p.add_argument("--delta", type=float, default=None)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--num-iterations", type=int, default=2)
    p.add_argument("--steps-per-generation", type=int, default=None)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--per-device-batch", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=12)
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--scale-rewards", default="group")
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
    return p.parse_args(argv)


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
        output_dir=str(out / "trainer"), per_device_train_batch_size=a.per_device_batch,
        gradient_accumulation_steps=a.grad_accum, steps_per_generation=a.steps_per_generation,
        num_generations=a.num_generations, max_completion_length=a.max_completion_length,
        num_iterations=a.num_iterations, beta=a.beta, epsilon=a.epsilon, epsilon_high=a.epsilon_high, delta=a.delta,
        loss_type=a.loss_type, importance_sampling_level=a.importance_sampling_level,
        mask_truncated_completions=a.mask_truncated_completions, scale_rewards=a.scale_rewards,
        temperature=a.temperature, learning_rate=a.lr, lr_scheduler_type="constant", max_steps=a.max_steps,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
        gradient_checkpointing=False, disable_dropout=True, seed=a.seed, data_seed=a.seed, **extra,
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
        trainer = GRPOLensTrainer(**kwargs, grpolens_dir=out / "run", grpolens_text=not a.no_text,
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
