"""Rank 1 of the 2-process gloo group in tests/capture/test_hook.py (rank 0 is the test itself):

    python dist_hook.py STORE_FILE RUN 1

It starts its hook only after rank 0 has closed (the barrier), so a manifest written by rank 1
would overwrite rank 0's.
"""

import sys

import torch
import torch.distributed as dist

from grpolens.hook import GRPOLensHook

store, run, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
dist.barrier()
with GRPOLensHook(run, config={"written_by": rank}) as hook:
    assert (hook.rank, hook.world_size) == (rank, 2)
    hook.log_loss_call(step=0, logp=torch.randn(2, 3), advantages=torch.zeros(2), sample_ids=torch.tensor([rank, rank + 10]))
    hook.end_step(0)
dist.destroy_process_group()
