import grpolens

df = grpolens.recompute("sample_runs/tiny", profile="trl", write=False, steps="0:2")
print(df.select("step", "kl", "clip_ratio/low_mean", "clip_ratio/high_max", "loss"))
