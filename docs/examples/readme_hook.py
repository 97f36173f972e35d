import torch
from grpolens.hook import GRPOLensHook

B, T = 4, 16                                       # completions per micro-batch, tokens per completion
hook = GRPOLensHook("runs/exp1", config={"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.04})
for step in range(2):
    for mb in range(2):
        # in a trainer: the policy's, old policy's, reference's and rollout engine's log-probs
        logp, old_logp, ref_logp, rollout_logp = (-torch.rand(B, T) for _ in range(4))
        entropy, advantages = torch.rand(B, T), torch.randn(B)
        completion_mask = torch.ones(B, T, dtype=torch.bool)
        sample_ids = torch.arange(B) + B * (2 * step + mb)  # unique within the run
        hook.log_loss_call(step=step, micro_batch=mb, logp=logp, old_logp=old_logp, ref_logp=ref_logp,
                           rollout_logp=rollout_logp, entropy=entropy, advantages=advantages,
                           mask=completion_mask, sample_ids=sample_ids)
    hook.end_step(step)
hook.close()

import grpolens

print(grpolens.recompute("runs/exp1", write=False)["health/masked_tokens"].to_list())  # 2 x 4 x 16 per step
