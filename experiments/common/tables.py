"""The Markdown tables of the drivers' reports and of the pages' quoted numbers: one writer,
so every table has the same header, separator and row lines."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

LEFT, RIGHT = "---", "---:"
"""A column's alignment as the separator line writes it: left (text) or right (numbers)."""


def markdown(
    head: Sequence[str], rows: Iterable[Sequence[str]], align: str | Sequence[str] = LEFT
) -> list[str]:
    """The lines of a Markdown table: ``| head | ... |``, the separator, then one
    ``| cell | ... |`` per row (cells as given, empty ones too).

    ``align`` is each column's alignment, :data:`LEFT` or :data:`RIGHT`, or one of them for
    every column.
    """
    aligns = [align] * len(head) if isinstance(align, str) else align
    return [_line(head), "|" + "".join(f"{a}|" for a in aligns), *(_line(row) for row in rows)]


def _line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"
