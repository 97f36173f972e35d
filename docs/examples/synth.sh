# A 30-step synthetic run on 2 ranks with a KL spike injected at step 20.
grpolens synth demo --steps 30 --ranks 2 --micro-batches 2 --groups 4 --generations 4 --max-len 128 \
    --seed 1 --inject kl-spike@20
