"""The dashboard's URL query: every page's view survives encode -> decode, and a hostile query is
refused key by key (the default applies) or escaped, never passed on."""

from __future__ import annotations

from urllib.parse import parse_qs

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpolens.serve import urlstate
from grpolens.serve.url_callbacks import completions_search, curves_search, range_value, tokens_search
from grpolens.serve.runs import RunSet

NAMES = ["alpha", "beta", "a&b=c#d?e", "ü <x>", "comma,run"]
CHOICES = {"by": ("kl", "entropy"), "color": ("kl", "mismatch")}


def roundtrip(group, state, defaults=None):
    return urlstate.decode(group, urlstate.encode(group, state, defaults), NAMES, CHOICES)


def test_every_page_roundtrips():
    curves = {"runs": ["beta", "a&b=c#d?e", "comma,run"], "smooth": 0.6, "from": 3, "to": 10,
              "filter": "raw seq & <b>", "y": ["log", "robust"], "baseline": "off"}
    assert roundtrip("curves", curves) == curves
    tokens = {"run": "ü <x>", "step": 412, "sample": 9, "pos": 17, "by": "entropy", "k": 7, "color": "mismatch"}
    assert roundtrip("tokens", tokens) == tokens
    comps = {"run": "beta", "step": 5, "group": 2, "rank": 1, "truncated": "yes", "vetoed": "no", "page": 3,
             "sort": [{"column_id": "kl_max", "direction": "desc"}, {"column_id": "reward", "direction": "asc"}],
             "where": '{completion} contains "sorry" && {kl_max} > 0.1'}
    assert roundtrip("completions", comps) == comps
    cmp = {"a": "beta", "b": "alpha", "delta": ["entropy", "mismatch/kl_k3"], "from": 0, "to": 4}
    assert roundtrip("compare", cmp) == cmp


def test_defaults_are_left_out():
    assert urlstate.encode("tokens", {"run": "alpha", "step": 3, "sample": None, "by": "kl", "k": 50},
                           {"by": "kl", "k": 50}) == "?run=alpha&step=3"
    assert urlstate.encode("curves", {"runs": ["alpha"], "smooth": 0.0, "y": []}, {"runs": ["alpha"], "smooth": 0.0}) == ""


def test_values_are_escaped():
    """A run name or filter with &, =, # or ? cannot add keys or end the query."""
    q = urlstate.encode("curves", {"runs": ["a&b=c#d?e"], "filter": "x&runs=alpha#frag"})
    assert "#" not in q and q.count("&") == 1 and q.count("=") == 2
    assert parse_qs(q[1:]) == {"runs": ["a&b=c#d?e"], "filter": ["x&runs=alpha#frag"]}


@pytest.mark.parametrize("query, group, want", [
    ("?run=../../etc/passwd&step=3", "tokens", {"step": 3}),          # unknown run: refused
    ("?run=/etc/passwd", "tokens", {}),
    ("?run=gamma&step=nan&sample=inf&pos=-1", "tokens", {}),         # not finite, negative
    ("?step=1e400&sample=3.5&pos=0x10", "tokens", {}),                 # overflow, fraction, hex
    ("?step=" + "9" * 40, "tokens", {}),                                # absurdly long number
    ("?k=100000&by=<script>&color=kl", "tokens", {"color": "kl"}),     # k out of range, unknown score
    ("?k=0", "tokens", {}),
    ("?smooth=inf", "curves", {}),
    ("?smooth=-3", "curves", {"smooth": 0.0}),                          # clamped into [0, 0.99]
    ("?smooth=7", "curves", {"smooth": 0.99}),
    ("?runs=alpha&runs=evil&runs=alpha", "curves", {"runs": ["alpha"]}),  # unknown dropped, duplicates once
    ("?runs=evil", "curves", {}),
    ("?y=log,evil,robust&baseline=maybe", "curves", {"y": ["log", "robust"]}),
    ("?from=9&to=3", "curves", {}),                                      # inverted range
    ("?filter=%00%1b%5b31m%7f", "curves", {"filter": "[31m"}),          # control characters removed
    ("?truncated=1&vetoed=yes&page=-2&rank=0", "completions", {"vetoed": "yes"}),
    ("?sort=kl_max:sideways&sort=x y:asc&sort=reward:desc", "completions",
     {"sort": [{"column_id": "reward", "direction": "desc"}]}),
    ("?delta=<img src=x>&delta=entropy", "compare", {"delta": ["entropy"]}),
    ("?a=beta&b=..", "compare", {"a": "beta"}),
])
def test_hostile_values_are_refused(query, group, want):
    assert urlstate.decode(group, query, NAMES, CHOICES) == want


def test_free_text_is_bounded():
    got = urlstate.decode("completions", "?where=" + "x" * 10_000, NAMES)
    assert got == {"where": "x" * urlstate.MAX_TEXT}
    many = "&".join("runs=alpha" for _ in range(5000))
    assert urlstate.decode("curves", "?" + many, NAMES) == {}  # more fields than a view has: ignored whole


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=300))
def test_any_query_decodes_to_valid_values(search):
    """Whatever the query, every value decoded is one the page accepts."""
    for group in urlstate.KEYS:
        got = urlstate.decode(group, search, NAMES, CHOICES)
        for k, v in got.items():
            if k in ("run", "a", "b"):
                assert v in NAMES
            elif k == "runs":
                assert v and set(v) <= set(NAMES)
            elif k in ("step", "sample", "pos", "group", "from", "to", "rank", "page", "k"):
                assert isinstance(v, int) and v >= 0
            elif k == "smooth":
                assert 0 <= v <= urlstate.SMOOTH_MAX
            elif k in ("filter", "where"):
                assert len(v) <= urlstate.MAX_TEXT and not any(ord(c) < 32 for c in v)


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=40).map(str.strip)
       .filter(bool))
def test_any_filter_text_roundtrips(text):
    assert roundtrip("curves", {"filter": text}) == {"filter": text}


def test_page_helpers():
    runs = RunSet({"alpha": None, "beta": None, "gold": None}, baseline="gold")  # paths unused here
    q = curves_search(runs, ["alpha", "beta"], 0.0, {}, None, [], ["on"])
    assert q == ""  # the header's default view
    q = curves_search(runs, ["beta"], 0.5, {"from": 2}, "kl", ["robust"], [])
    assert q == "?runs=beta&smooth=0.5&from=2&filter=kl&y=robust&baseline=off"
    assert tokens_search("alpha", 4, 7, 12, "entropy", 50, "kl") == "?run=alpha&step=4&sample=7&pos=12&by=entropy"
    assert completions_search("beta", 5, page=1, sort_by=[{"column_id": "kl_max", "direction": "asc"}]) == \
        "?run=beta&step=5&page=1&sort=kl_max%3Aasc"
    assert range_value("?from=-4&to=99", "/policy", 0, 13) == [0, 13]
    assert range_value("?from=3", "/compare", 0, 13) == [3, 13]
    assert range_value("?from=3", "/tokens", 0, 13) is None  # the Tokens page has no step range


def test_docs_list_every_key():
    """docs/serve.md's table of URL keys names exactly the keys each page reads."""
    import re
    from pathlib import Path

    section = (Path(__file__).resolve().parents[2] / "docs" / "serve.md").read_text(encoding="utf-8")
    section = section.split("## Links", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] not in ("page", "---"):
            rows[cells[0]] = set(re.findall(r"`([a-z]+)`", re.sub(r"\([^)]*\)", "", cells[1])))  # values in ()
    groups = {"Overview, Policy, Mismatch, Rewards, Health": "curves", "Tokens": "tokens", "Completions": "completions",
              "Compare": "compare", "Runs": "runs", "Findings": "findings"}
    assert set(rows) == set(groups)
    for label, group in groups.items():
        assert rows[label] == set(urlstate.KEYS[group]), label


def test_panel_log_boxes_ticked_runs_and_the_headers_runs_roundtrip():
    curves = {"runs": ["alpha"], "log": ["kl/k3", "clip/region"], "lin": ["entropy"]}
    assert roundtrip("curves", curves) == curves
    assert roundtrip("runs", {"tick": ["beta", "a&b=c#d?e"]}) == {"tick": ["beta", "a&b=c#d?e"]}
    tokens = {"run": "alpha", "step": 3, "runs": ["beta", "comma,run"]}
    assert roundtrip("tokens", tokens) == tokens
    assert roundtrip("completions", {"run": "alpha", "runs": ["beta"]}) == {"run": "alpha", "runs": ["beta"]}


@pytest.mark.parametrize("query, group, want", [
    ("?log=kl/k3&lin=kl/k3&lin=entropy", "curves", {"lin": ["entropy"]}),  # named both ways: neither
    ("?log=<script>&log=kl k3&lin=", "curves", {}),                        # not metric names
    ("?tick=gamma&tick=../x&tick=beta&tick=beta", "runs", {"tick": ["beta"]}),  # unknown runs, twice
    ("?runs=/etc/passwd", "tokens", {}),
])
def test_new_keys_refuse_what_is_not_theirs(query, group, want):
    assert urlstate.decode(group, query, NAMES, CHOICES) == want


def test_panel_flips_are_the_boxes_that_differ_from_the_header():
    from grpolens.serve.url_callbacks import panel_flips

    ids = [{"type": "panel-log", "key": k} for k in ("policy:kl/k3", "policy:entropy", "overview:kl/k3")]
    # header linear: a ticked box is a flip to log; the other page's box is not this page's
    assert panel_flips([["log"], [], ["log"]], ids, "policy", False) == {"log": ["kl/k3"]}
    # header log: an unticked box is a flip to linear
    assert panel_flips([["log"], [], []], ids, "policy", True) == {"lin": ["entropy"]}
    # the flips of panels not drawn now (filtered out) stay; those drawn are re-read
    assert panel_flips([[], []], ids[:2], "policy", False, {"log": ["kl/k3", "loss"]}) == {"log": ["loss"]}


def test_pages_keep_the_headers_values_in_their_urls_through_their_hooks():
    """The Compare page's URL takes the header's step range and keeps its own A, B and delta curves;
    the Tokens and Completions pages' URLs take the header's runs (left out when the default) and
    keep their own keys, and give the header the runs a link names (None: a link without them)."""
    from grpolens.serve.pages import by_path
    from grpolens.serve.pages.tokens import TOKEN_CHOICES
    from grpolens.serve.urlsync import Header

    runs = RunSet({"alpha": None, "beta": None, "gold": None}, baseline="gold")  # paths unused here
    header = Header(["beta"], 0.0, {"from": 3}, None, [], [])
    compare = by_path("/compare")
    q = compare.header_search(runs, "?b=alpha&delta=kl/k3&delta=entropy&from=1&to=9", header)
    assert urlstate.decode("compare", q, runs.names) == {"b": "alpha", "delta": ["kl/k3", "entropy"], "from": 3}
    assert compare.header_search(runs, "", header._replace(bounds={})) == ""  # every key at its default
    assert compare.header_runs is None  # the header's runs are not in its URL
    for path, group, own in (("/tokens", "tokens", {"run": "alpha", "step": 3, "by": "ratio"}),
                             ("/completions", "completions", {"run": "alpha", "step": 3, "page": 2})):
        page = by_path(path)
        search = urlstate.encode(group, {**own, "runs": ["alpha"]}, {})
        def read(q):
            return urlstate.decode(group, q, runs.names, TOKEN_CHOICES)

        assert read(page.header_search(runs, search, header)) == {**own, "runs": ["beta"]}
        default = header._replace(runs=["alpha", "beta"])  # the header's default selection: not written
        assert read(page.header_search(runs, search, default)) == own
        assert page.header_runs(runs, search) == ["alpha"]
        assert page.header_runs(runs, urlstate.encode(group, own, {})) is None
