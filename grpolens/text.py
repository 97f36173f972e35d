"""How grpolens shows things as text: numbers (:func:`format_value`) and untrusted model text (:func:`printable`).

A leaf module (no grpolens imports) so that every layer can show values the same way.

Model-generated text is untrusted: make it safe to show in a terminal.

Rich markup is never parsed from it (callers append it to :class:`rich.text.Text` as plain
text), and control characters -- terminal escape sequences above all -- are shown as visible
escapes instead of being sent to the terminal.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str, keep_newlines: bool = True) -> str:
    """Replace control and bidi-override characters by ``\\xNN`` / ``\\uNNNN`` escapes."""

    def esc(m: re.Match) -> str:
        c = ord(m.group(0))
        return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"

    out = _CONTROL.sub(esc, text)
    if not keep_newlines:
        out = out.replace("\n", "⏎").replace("\t", "⇥")
    return out


def format_value(v) -> str:
    """Short and exact enough to read: 4 significant digits, integers as integers."""
    if v is None:
        return "—"
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v.is_integer() and abs(v) < 1e9:
            return str(int(v))
        return f"{v:.4g}"
    return str(v)
