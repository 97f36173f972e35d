grpolens synth demo --steps 4 --ranks 2 --max-len 64 --texts --seed 1
# every step: demo/grpolens/rich_completions/rich_completions_step_00000N.json (strict JSON)
grpolens sidecars demo
# the reference's exact bytes (bare NaN for missing numbers), steps 2..3, another key
grpolens sidecars demo --steps 2:3 --nan-literals --key completions
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['columns'][:5], len(d['data']))" demo/grpolens/rich_completions/completions_step_000002.json
