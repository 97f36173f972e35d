grpolens synth drift --steps 8 --max-len 64 --inject rollout-drift@4 --seed 1
# per-token IS weights and the modified loss mask next to the metrics (drift/grpolens/is_weights/)
grpolens recompute drift --is-weights --quiet
# four caps x two veto bounds, all eight grid points in one pass over the tokens; table + chart
grpolens sweep drift --param rollout_is.upper=1.5,2,3,5 --param rollout_is.veto_lower=1e-4,0.9 --html drift-sweep.html
# sequence-level masking on the first steps only, table to a file of our choice
grpolens sweep drift --level sequence --mode mask --param rollout_is.upper=1.2,2 --steps 0:3 --out seq.parquet --quiet
