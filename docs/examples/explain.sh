grpolens explain sample_runs/trl-tiny --metric kl --step 5 --profile trl --top 3
grpolens explain sample_runs/tiny --metric kl/k3 --step 3 --baseline 0:2 --by token_id,group --json
