# verl's rollout_data_dir (<step>.jsonl files) -> a samples-only run, then its reward metrics
grpolens import verl-jsonl "$GRPOLENS_REPO/tests/data/import/verl-rollouts" verl-run
grpolens recompute verl-run
# MaxEnt-GRPO rich-completion sidecars (bare NaN literals are fine)
grpolens import maxent-sidecars "$GRPOLENS_REPO/tests/data/import/maxent" maxent-run
