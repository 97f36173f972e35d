grpolens synth demo --steps 4 --ranks 2 --max-len 64 --texts --seed 1
# one step's completions, highest KL to the reference first
grpolens completions demo --step 2 --sort kl --limit 8
# one prompt group (its prompt_index, or its group_id), by reward
grpolens recompute demo --quiet
grpolens completions demo --step 3 --group 1 --sort reward
# MaxEnt-GRPO's own sidecar files load into the same view
grpolens sidecars demo --quiet
grpolens completions demo/grpolens --step 3 --sort reward --limit 5
