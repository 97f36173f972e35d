"""The terminal view of an :class:`~grpolens.analysis.explain.model.Explanation`: the headline,
one table per dimension, the concentration line. Keys that are model text (decoded tokens) are
shown escaped (:func:`grpolens.text.printable`) and never as markup."""

from __future__ import annotations

from grpolens.analysis.explain.model import Explanation
from grpolens.text import printable

_CONC = (("top_0.1%_tokens", "top 0.1 % tokens"), ("top_1%_tokens", "top 1 % tokens"),
         ("top_10%_tokens", "top 10 % tokens"), ("top_1_completions", "top completion"),
         ("top_10_completions", "top 10 completions"))


#: the "in" column: where a key is
_IN = {"both": "both", "step": "step only", "baseline": "baseline only"}


def _num(v) -> str:
    return "" if v is None else f"{v:+.4g}"


def _pct(v) -> str:
    return "" if v is None else f"{100 * v + 0.0:.1f} %" if abs(v) >= 0.0005 else "0.0 %"


def render(e: Explanation, console) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    console.print(Text(e.headline(k=3)))
    for n in e.notes:
        console.print(Text(f"note: {n}", style="dim"))
    if e.extremum is not None:
        for u in [e.extremum["step"], *e.extremum["baseline"]]:
            if u is None:
                continue
            where = f"sample {u['sample_id']}"
            if "rank" in u:
                where += f" (rank {u['rank']}, micro-batch {u['micro_batch']})"
            if u.get("pos") is not None:
                where += f", position {u['pos']}, token {printable(str(u['label']), keep_newlines=False)!s}"
            console.print(Text(f"step {u['step']}: {u['column']} = {u['value']:.6g} at {where}"))
    for dim, entries in e.by.items():
        t = Table(title=f"by {dim}", box=box.SIMPLE_HEAD, padding=(0, 1), title_justify="left")
        per_completion = e.units == "completions"  # the count is the completions then
        columns = [("key", "left"), ("contribution", "right"), ("share", "right"), ("mix", "right"),
                   ("rate", "right"), (e.units or "units", "right")]
        columns += [] if per_completion else [("completions", "right")]
        for c, j in columns + [("in", "left")]:
            t.add_column(c, justify=j, no_wrap=c != "key")
        for r in entries:
            label = Text(printable(str(r["label"]), keep_newlines=False))
            cells = [label, _num(r["contribution"]), _pct(r["share"]), _num(r["mix"]), _num(r["rate"]), str(r["count"])]
            if not per_completion:
                cells.append("" if r.get("completions") is None else str(r["completions"]))
            t.add_row(*cells, _IN.get(r.get("present"), ""))
        console.print(t)
    if e.concentration and any(v is not None for v in e.concentration.values()):
        parts = [f"{label} {_pct(e.concentration.get(k))}" for k, label in _CONC if e.concentration.get(k) is not None]
        console.print(Text(f"concentration at step {e.step}: " + ", ".join(parts)))
