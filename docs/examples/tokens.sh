grpolens synth demo --steps 3 --max-len 64 --seed 1
grpolens tokens demo --step 2 --by mismatch --top 5
