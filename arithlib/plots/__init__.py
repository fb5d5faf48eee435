"""Figures from tables, one module per study: each function takes the DataFrame a notebook
also saves as CSV and returns a matplotlib Figure (saving: :func:`arithlib.run.outputs.save_figure`).

``accuracy`` (notebook 00), ``heads`` (01), ``probing`` (02), ``neurons`` (03), ``cna`` (04),
``finetune`` (05, 08), ``pruning`` (06), ``bias`` (07), ``report`` (the cross-model figure)."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=8)
def _font_chars(path: str) -> frozenset[int]:
    from matplotlib.ft2font import FT2Font

    return frozenset(FT2Font(path).get_charmap())


def font_safe(text: str) -> str:
    """``text`` as a label matplotlib's current font can draw: each character the font
    lacks (a CJK or Cyrillic piece of a token, say: matplotlib would draw an empty box and
    warn "Glyph ... missing from font(s)") and each unprintable one written as its escape
    (``\\u4e2d``, ``\\n``), as ``repr`` would."""
    from matplotlib import font_manager, rcParams

    chars = _font_chars(font_manager.findfont(font_manager.FontProperties(family=rcParams["font.family"])))
    out = []
    for ch in text:
        if ch.isprintable() and ord(ch) in chars:
            out.append(ch)
        else:
            out.append(
                repr(ch)[1:-1]
                if not ch.isprintable()
                else (f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
            )
    return "".join(out)
