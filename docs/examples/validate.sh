grpolens synth demo --steps 5 --seed 1
grpolens validate demo
