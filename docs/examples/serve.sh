grpolens synth demo --steps 12 --max-len 64 --texts --inject kl-spike@6
grpolens synth demo-b --steps 12 --max-len 64 --texts --seed 1 --inject rollout-drift@4
grpolens serve demo demo-b --baseline demo-b --port 8765
