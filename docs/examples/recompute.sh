grpolens synth demo --steps 10 --max-len 64 --seed 1
# canonical names, pooled token means; writes demo/grpolens/metrics.{parquet,jsonl}
grpolens recompute demo
# TRL's names and reductions, with a what-if on the clip range
grpolens recompute demo --profile trl --set epsilon_high=0.28 --last 3
# only steps 5..9, from the per-step cache
grpolens recompute demo --steps 5:9 --quiet
