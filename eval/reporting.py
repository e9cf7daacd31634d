"""What the evaluation scripts' reports share: a method shown by its readable label (:mod:`eval.methods.labels`) with
its id kept beside it in tables, CSV files written from rows, and matplotlib loaded headless and figures saved.

Every markdown table with a method column has two: ``method`` (the label) and ``id`` (the registry id in code
style, the key of the records); a table whose columns are methods heads each with ``label (`id`)``; plots show the
label alone."""

from __future__ import annotations

import csv
from collections.abc import Iterable

from .methods.labels import label

METHOD_COLUMNS = "method | id"  # the two header cells of a method, between a table's bars
METHOD_RULE = "---|---"


def method_cells(method_id: str) -> str:
    """The two table cells of ``method_id``, its label and its id: ``uniform INT4 | `int4```."""
    return f"{label(method_id)} | `{method_id}`"


def method_heading(method_id: str) -> str:
    """One cell (a column header) naming ``method_id``: ``uniform INT4 (`int4`)``, or the id alone when it has no
    label."""
    name = label(method_id)
    return f"`{method_id}`" if name == method_id else f"{name} (`{method_id}`)"


def plot_name(method_id: str) -> str:
    """What a plot's legend or annotation shows for ``method_id``: its label."""
    return label(method_id)


def write_csv(path: str, columns: list[str], rows: Iterable[list]) -> None:
    """``columns`` as the header line, then one line per row (values already formatted)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows(rows)


def write_dict_csv(path: str, rows: list[dict], columns: list[str] | None = None) -> None:
    """``rows`` as CSV under ``columns`` (default: the first row's keys); a key a row lacks is left empty."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=columns or list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def csv_values(row: dict, columns: list[str]) -> list:
    """``row``'s values of ``columns``, floats to 6 significant digits."""
    return [f"{row[c]:.6g}" if isinstance(row[c], float) else row[c] for c in columns]


def pyplot(required: bool = True):
    """``matplotlib.pyplot`` on the headless Agg backend. Without matplotlib: ImportError saying how to install it, or
    None when not ``required`` (the caller then skips its plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        if not required:
            return None
        raise ImportError("the evaluation's plots need matplotlib: pip install -e '.[eval]'") from e
    return plt


def plotted_sources(rows: list[dict]) -> list[str]:
    """The sources of ``rows`` a plot draws one panel each for, in order: every source but the ``all`` rows."""
    return [s for s in dict.fromkeys(r["source"] for r in rows) if s != "all"]


def save_figure(fig, path: str, dpi: int = 120, rect: tuple[float, float, float, float] | None = None) -> None:
    """Lay ``fig`` out (within ``rect``, the figure's share left to the axes), write it to ``path`` and close it."""
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
