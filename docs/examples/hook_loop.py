import torch
from grpolens.hook import GRPOLensHook

torch.manual_seed(0)
vocab, B, T, G = 32, 8, 12, 4                       # 8 completions: 2 prompts x 4 generations
policy = torch.nn.Embedding(vocab, vocab)           # toy model: next-token logits from the previous token
opt = torch.optim.SGD(policy.parameters(), lr=0.1)

with GRPOLensHook("runs/toy", config={"loss_type": "grpo", "epsilon": 0.2, "num_generations": G},
                  trainer={"name": "toy", "version": "0"}) as hook:
    for step in range(3):
        # rollout: ragged completions, right-padded to T
        tokens = torch.randint(0, vocab, (B, T + 1))
        lengths = torch.randint(1, T + 1, (B,))
        mask = torch.arange(T)[None, :] < lengths[:, None]
        rewards = torch.rand(B)
        g = rewards.view(-1, G)
        advantages = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(-1)
        sample_ids = torch.arange(B) + step * B     # unique within the run
        hook.log_samples(step=step, sample_ids=sample_ids, group_ids=sample_ids // G, completion_lens=lengths,
                         truncated=lengths == T, rewards={"random": rewards}, reward=rewards, advantages=advantages)

        # loss: give the hook exactly what the loss uses
        logp = torch.log_softmax(policy(tokens[:, :-1]), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        old_logp = logp.detach()                    # one update per generation: ratio 1
        loss = -(torch.exp(logp - old_logp) * advantages[:, None] * mask).sum() / mask.sum()
        hook.log_loss_call(step=step, logp=logp, old_logp=old_logp, advantages=advantages,
                           sample_ids=sample_ids, mask=mask, token_ids=tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        hook.end_step(step)                         # this step's shards are written in the background

import grpolens

df = grpolens.recompute("runs/toy", write=False)
print(df.height, "steps; largest ratio:", df["policy/ratio_max"].max())  # old_logp = logp: on-policy
