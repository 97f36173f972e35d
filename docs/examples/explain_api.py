from grpolens.analysis.explain import explain

e = explain("sample_runs/trl-tiny", "kl", 5, profile="trl", by=["token_id"], top=2)
d = e.to_dict()  # the --json object
print(e.headline(k=2))
print([(x["label"], round(x["share"], 3), x["present"]) for x in d["by"]["token_id"]])
print({k: round(v, 3) for k, v in d["concentration"].items()})
