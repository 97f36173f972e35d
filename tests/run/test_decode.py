"""Token text in the views: the run's tokenizer.json decodes every id (sample_runs/trl-tiny, recorded
from real TRL training), a run without one shows ids and says why in one line, and a training
step that reuses an earlier step's completions shows them, found by sample_id."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import polars as pl
import pytest
from tokenizers import Tokenizer

from grpolens.cli import main
from grpolens.run.decode import TOKENIZER_FILE, describe, make_decoder

TRL_TINY = Path(__file__).resolve().parents[2] / "sample_runs" / "trl-tiny"


@pytest.fixture
def run(tmp_path):
    dst = tmp_path / "trl-tiny"
    # the shards, manifest, tokenizer and TRL's log; no derived files of an earlier recompute
    shutil.copytree(TRL_TINY, dst, ignore=lambda d, names: [n for n in names if Path(d).name == "grpolens"
                                                              and n != "trl_log.jsonl"])
    return dst


def _samples(run, step):
    return pl.read_parquet(run / "samples" / f"step={step:08d}" / "*.parquet")


def _tokens(run, step):
    return pl.read_parquet(run / "tokens" / f"step={step:08d}" / "*.parquet")


def test_bundled_tokenizer_is_the_training_one(run):
    """Decoding the recorded ids of each completion gives back TRL's own completion text."""
    tok = Tokenizer.from_file(str(run / TOKENIZER_FILE))
    samples, tokens = _samples(run, 1), _tokens(run, 1)
    for sid, text in samples.select("sample_id", "completion").iter_rows():
        rows = tokens.filter(pl.col("sample_id") == sid).sort("rank", "micro_batch", "pos").unique("pos", keep="first")
        assert tok.decode(rows.sort("pos")["token_id"].to_list(), skip_special_tokens=True) == text


def test_tokens_view_shows_text(run, cli):
    tok = Tokenizer.from_file(str(run / TOKENIZER_FILE))
    code, out, _ = cli("tokens", run, "--step", 2, "-k", 5, "--json")
    rows = json.loads(out)
    assert code == 0 and rows
    assert [r["token"] for r in rows] == [tok.decode([r["token_id"]], skip_special_tokens=False) for r in rows]
    code, out, _ = cli("tokens", run, "--step", 2, "-k", 3)
    assert "decoded with the run's tokenizer.json" in out and "⟨" not in out


def test_without_tokenizer_ids_and_why(run, cli):
    (run / TOKENIZER_FILE).unlink()
    decode, source = make_decoder(run, {})
    assert source == "ids" and decode(5) == "⟨5⟩"
    code, out, _ = cli("tokens", run, "--step", 2, "-k", 3)
    assert code == 0 and "⟨" in out
    assert " ".join(describe("ids").split()[:6]) in " ".join(out.split())
    code, out, _ = cli("tokens", run, "--step", 2, "-k", 3, "--json")
    assert all(r["token"] is None for r in json.loads(out))


def test_unreadable_tokenizer_falls_back_to_ids(run):
    (run / TOKENIZER_FILE).write_text("{not json")
    assert make_decoder(run, {})[1] == "ids"


def test_completions_of_a_step_that_reuses_rollouts(run, cli):
    """trl-tiny generates at odd steps (steps_per_generation = 2); step 2 trains on step 1's
    completions and must show them, with step 1's group columns and step 2's token columns."""
    assert not (run / "samples" / "step=00000002").exists()
    code, out, err = cli("completions", run, "--step", 2, "--limit", 0, "--json")
    assert code == 0, err
    rows = json.loads(out)
    trained = set(_tokens(run, 2)["sample_id"].to_list())
    assert {r["sample_id"] for r in rows} == trained
    assert {r["generated_at_step"] for r in rows} == {1} and {r["step"] for r in rows} == {2}
    texts = dict(_samples(run, 1).select("sample_id", "completion").iter_rows())
    assert all(r["completion"] == texts[r["sample_id"]] for r in rows)
    # group columns as at step 1, where the group was generated
    code, out1, _ = cli("completions", run, "--step", 1, "--limit", 0, "--json")
    at1 = {r["sample_id"]: r for r in json.loads(out1)}
    for r in rows:
        for k in ("prompt_index", "completion_index", "reward_rank_desc", "reward_total", "advantage"):
            assert r[k] == at1[r["sample_id"]][k], k
    # the token columns are step 2's own (the policy moved: KL differs from step 1's for some)
    assert all(r["loss_calls"] >= 1 for r in rows)
    # and the same rows come out of completions.parquet after a recompute
    main(["recompute", str(run), "-q"])
    table = pl.read_parquet(run / "grpolens" / "completions.parquet").filter(pl.col("step") == 2)
    assert sorted(table["sample_id"].to_list()) == sorted(r["sample_id"] for r in rows)
    assert (table["generated_at_step"] == 1).all()


def test_dashboard_completion_of_a_reused_rollout(run):
    """The dashboard's completion view at step 2 shows the text generated at step 1."""
    from grpolens.serve import data

    sid = int(_tokens(run, 2)["sample_id"][0])
    got = data.completion(run, 2, sid)
    texts = dict(_samples(run, 1).select("sample_id", "completion").iter_rows())
    assert got is not None and got["sample"]["completion"] == texts[sid]


def test_each_source_of_token_text_in_order(run):
    """make_decoder's sources, each taken when the ones before it are missing or unreadable:
    tokenizer.json (special tokens kept), the manifest's vocab_file (an object of id -> text, or a
    list; ids it lacks shown as ⟨id⟩), the manifest's tokenizer (a directory inside the run, loaded
    with transformers, offline), else the ids themselves."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(run / TOKENIZER_FILE))
    ids = [0, 1, 7, 20]  # 0 and 1 are special tokens of the bundled tokenizer (<pad>, <eos>)
    decode, source = make_decoder(run, {"vocab_file": "vocab.json", "tokenizer": "hf"})
    assert source == "tokenizer.json"
    assert [decode(i) for i in ids] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert [decode(i) for i in ids] == ["<pad>", "<eos>", "b", "r"]

    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(run / "hf")
    (run / TOKENIZER_FILE).write_text("{not json")  # unreadable: the next source
    (run / "vocab.json").write_text(json.dumps({"0": "zero", "7": "seven"}))
    decode, source = make_decoder(run, {"vocab_file": "vocab.json", "tokenizer": "hf"})
    assert source == "vocab" and [decode(i) for i in (0, 7, 3)] == ["zero", "seven", "⟨3⟩"]
    (run / "vocab.json").write_text(json.dumps(["a", "b"]))
    decode, source = make_decoder(run, {"vocab_file": "vocab.json"})
    assert source == "vocab" and [decode(i) for i in (1, 0, 2)] == ["b", "a", "⟨2⟩"]

    (run / "vocab.json").write_text("[1, 2")  # unreadable: the next source
    decode, source = make_decoder(run, {"vocab_file": "vocab.json", "tokenizer": "hf"})
    assert source == "tokenizer"
    assert [decode(i) for i in ids] == ["<pad>", "<eos>", "b", "r"]  # transformers' decode keeps them too
    decode, source = make_decoder(run, {"vocab_file": "vocab.json", "tokenizer": "no-such-org/no-such-model"})
    assert source == "ids" and decode(7) == "⟨7⟩"
    assert make_decoder(run, {})[1] == "ids"


@pytest.mark.parametrize("key", ["vocab_file", "tokenizer"])
def test_a_file_the_manifest_names_outside_the_run_is_refused(run, key):
    from grpolens.errors import RunFormatError

    (run / TOKENIZER_FILE).unlink()
    with pytest.raises(RunFormatError) as e:
        make_decoder(run, {key: "../elsewhere.json"})
    assert str(e.value) == (f"{run / 'grpolens.json'}: config.{key} = '../elsewhere.json' points outside the run "
                            "directory; files a run references must be inside it (a path relative to the run)")


def test_a_tokenizer_directory_linked_from_outside_the_run_is_refused(run, tmp_path, cli):
    """The manifest's tokenizer may be a hub name or a directory of the run; a directory of the run
    that is a symbolic link to one outside it is refused like a path with '..' (validate says so
    too), not loaded. (The name-or-path key skipped the link check before.)"""
    from transformers import PreTrainedTokenizerFast

    from grpolens.errors import RunFormatError

    outside = tmp_path / "elsewhere"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(run / TOKENIZER_FILE))).save_pretrained(outside)
    (run / TOKENIZER_FILE).unlink()
    (run / "hf").symlink_to(outside, target_is_directory=True)
    with pytest.raises(RunFormatError) as e:
        make_decoder(run, {"tokenizer": "hf"})
    assert str(e.value) == (f"{run / 'grpolens.json'}: config.tokenizer = 'hf' resolves outside the run directory "
                            "(through a symbolic link)")
    manifest = json.loads((run / "grpolens.json").read_text())
    manifest["config"]["tokenizer"] = "hf"
    (run / "grpolens.json").write_text(json.dumps(manifest))
    code, out, _ = cli("validate", run, "--json")
    problems = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert code != 0 and any("config.tokenizer = 'hf' resolves outside the run directory" in p["message"]
                             for p in problems if p["severity"] == "error"), problems
    (run / "hf").unlink()
    shutil.copytree(outside, run / "hf")  # the same directory, inside the run: loaded
    assert make_decoder(run, {"tokenizer": "hf"})[1] == "tokenizer"


def test_a_hub_name_is_loaded_from_the_local_cache_only(run, tmp_path):
    """A manifest tokenizer that names a Hugging Face model (not a directory of the run) is loaded
    from the local cache and never downloaded: a cache holding it gives text, an empty one ids, and
    the hub (here a local server standing in for it, HF_ENDPOINT) gets no request either way; so
    for import --tokenizer NAME. A fresh process, whose Hugging Face cache is a directory of the
    test. (huggingface_hub 2.x asked the hub for an agent registry even with local_files_only.)"""
    import subprocess
    import sys
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tests.helpers.hub_cache import hub_cache

    requests = []

    class Hub(BaseHTTPRequestHandler):
        def _any(self):
            requests.append(f"{self.command} {self.path}")
            self.send_response(404)
            self.end_headers()

        do_GET = do_HEAD = do_POST = _any

        def log_message(self, *args):
            pass

    hub = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    cache = hub_cache(tmp_path / "hf-cache", "grpolens-test/tiny", run / TOKENIZER_FILE)
    (run / TOKENIZER_FILE).unlink()
    # the views' decoder, and import --tokenizer's token counter (its other user of a hub name)
    script = ("import sys; from pathlib import Path; from grpolens.run.decode import make_decoder; "
              "d, s = make_decoder(Path(sys.argv[1]), {'tokenizer': 'grpolens-test/tiny'}); print(s, d(7))\n"
              "from grpolens.adapters.importers import load_tokenizer\n"
              "try:\n    print(load_tokenizer('grpolens-test/tiny')('br'))\n"
              "except Exception as e:\n    print(type(e).__name__)")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    try:
        for hub_cache, want in ((cache, "tokenizer b\n2"), (tmp_path / "empty-cache", "ids ⟨7⟩\nUserError")):
            r = subprocess.run([sys.executable, "-c", script, str(run)], capture_output=True, text=True, timeout=300,
                               cwd=tmp_path, env={**env, "HF_HUB_CACHE": str(hub_cache), "PYTHONPATH": str(root),
                                                  "HF_ENDPOINT": f"http://127.0.0.1:{hub.server_port}"})
            assert r.returncode == 0, r.stderr[-2000:]
            assert r.stdout.strip() == want
    finally:
        hub.shutdown()
    assert requests == []


@pytest.mark.parametrize("before", [False, True])
def test_the_hugging_face_client_is_offline_only_while_a_tokenizer_loads(monkeypatch, before):
    """load_pretrained_tokenizer holds huggingface_hub offline while transformers loads, and gives
    the process its setting back after, whether the load fails or not (a Python caller may use the
    Hub afterwards: an export to a Hugging Face space)."""
    import huggingface_hub.constants as hub
    import transformers

    from grpolens.run.decode import load_pretrained_tokenizer

    seen = []

    def from_pretrained(name, **kw):
        seen.append((name, kw, hub.HF_HUB_OFFLINE))
        raise OSError("not in the cache")

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", before)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    with pytest.raises(OSError):
        load_pretrained_tokenizer("org/model")
    assert seen == [("org/model", {"local_files_only": True}, True)]
    assert hub.HF_HUB_OFFLINE is before
