"""The user's texts as calibration prompts: reading them, cutting one window per text, splitting them in two sets.

A window is the first ``window`` tokens of a text, in completion form (no chat template, so base models work too):

* the **context**: the first ``window - question_tokens - continuation_tokens`` tokens, what the cache quantizes;
* the **question**: the next ``question_tokens`` tokens (64 by default), kept at full precision like a question;
  they are the query of the chunk search and the queries that pick salient tokens;
* the **continuation**: the next ``continuation_tokens`` tokens (32 by default), teacher-forced after the prompt;
  KL(P_fp16 || P_quant) is averaged over their positions.

The texts are split deterministically: in the given order, usable texts alternate between calibration (even) and
validation (odd) until each set has its count.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    """One calibration prompt: ``prompt = context + question`` (text), ``continuation`` (token ids after it)."""

    name: str
    context: str
    question: str
    continuation: tuple[int, ...]

    @property
    def prompt(self) -> str:
        return self.context + self.question


def read_texts(paths: Sequence[str | os.PathLike], text_field: str = "text") -> list[tuple[str, str]]:
    """``(name, text)`` pairs from ``paths``: a ``.txt`` file is one text; a ``.jsonl`` file holds one text per line,
    a JSON string or an object whose ``text_field`` is the text."""
    if not paths:
        raise ValueError("texts: no files given; pass your own texts (.txt: one text per file, .jsonl: one per line)")
    out = []
    for path in (os.fspath(p) for p in paths):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"texts: {path!r} is not a file")
        with open(path, encoding="utf-8") as f:
            if path.endswith(".txt"):
                out.append((os.path.basename(path), f.read()))
            elif path.endswith(".jsonl"):
                out.extend(
                    (f"{os.path.basename(path)}:{i + 1}", _jsonl_text(line, text_field, path, i + 1))
                    for i, line in enumerate(f)
                    if line.strip()
                )
            else:
                raise ValueError(f"texts: {path!r} must end with .txt (one text) or .jsonl (one text per line)")
    return out


def _jsonl_text(line: str, field: str, path: str, lineno: int) -> str:
    row = json.loads(line)
    if isinstance(row, str):
        return row
    if isinstance(row, dict) and isinstance(row.get(field), str):
        return row[field]
    raise ValueError(
        f"{path}:{lineno}: expected a JSON string or an object with a string field {field!r} (--text-field)"
    )


def make_window(
    tok, name: str, text: str, window: int, question_tokens: int, continuation_tokens: int
) -> Window | None:
    """The window of ``text`` (see the module docstring), or ``None`` when the text has fewer than ``window`` tokens."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < window:
        return None
    n_ctx = window - question_tokens - continuation_tokens
    q_end = n_ctx + question_tokens
    return Window(name, tok.decode(ids[:n_ctx]), tok.decode(ids[n_ctx:q_end]), tuple(ids[q_end:window]))


def split_windows(
    tok,
    texts: Sequence[tuple[str, str]],
    n_calibration: int,
    n_validation: int,
    window: int = 2048,
    question_tokens: int = 64,
    continuation_tokens: int = 32,
) -> tuple[list[Window], list[Window]]:
    """``(calibration, validation)`` windows, one per text (see the module docstring). Raises ValueError when the
    layout does not fit or fewer than 2 texts have ``window`` tokens."""
    if n_calibration < 1 or n_validation < 1:
        raise ValueError(f"need at least 1 calibration and 1 validation text, got {n_calibration} and {n_validation}")
    if question_tokens < 1 or continuation_tokens < 2 or window < question_tokens + continuation_tokens + 64:
        raise ValueError(
            f"window must leave at least 64 context tokens after question_tokens (>= 1) and continuation_tokens "
            f"(>= 2); got window={window}, question_tokens={question_tokens}, continuation_tokens={continuation_tokens}"
        )
    cal: list[Window] = []
    val: list[Window] = []
    short = []
    for name, text in texts:
        if len(cal) >= n_calibration and len(val) >= n_validation:
            break
        w = make_window(tok, name, text, window, question_tokens, continuation_tokens)
        if w is None:
            short.append(name)
            continue
        target = cal if (len(cal) + len(val)) % 2 == 0 and len(cal) < n_calibration or len(val) >= n_validation else val
        target.append(w)
    if not cal or not val:
        raise ValueError(
            f"texts too short: {len(cal) + len(val)} of {len(texts)} texts have window={window} tokens, at least 2 are "
            f"needed (one to calibrate on, one to validate on); too short: {short[:8]}"
            f"; give longer or more texts, or a smaller --window"
        )
    if short:
        warnings.warn(
            f"{len(short)} texts have fewer than window={window} tokens and are not used: {short[:8]}", stacklevel=2
        )
    return cal, val


def bytes_window(
    tok, texts: Sequence[tuple[str, str]], tokens: int, question_tokens: int = 64, continuation_tokens: int = 32
) -> Window:
    """The prompt the byte target is measured on: the window of ``tokens`` tokens of the first text that long (the
    length users give: a larger share of it is packed context than of a short window's); when no text is, the whole
    longest text, with a warning."""
    if tokens < question_tokens + continuation_tokens + 64:
        raise ValueError(f"bytes_window must be at least {question_tokens + continuation_tokens + 64}, got {tokens}")
    lengths = []
    for name, text in texts:
        w = make_window(tok, name, text, tokens, question_tokens, continuation_tokens)
        if w is not None:
            return w
        lengths.append((len(tok(text, add_special_tokens=False)["input_ids"]), name, text))
    n, name, text = max(lengths)
    warnings.warn(
        f"no text has bytes_window={tokens} tokens: the bytes are measured on {name} ({n} tokens)", stacklevel=2
    )
    if n < question_tokens + continuation_tokens + 64:
        raise ValueError(f"texts too short to measure bytes on: the longest, {name}, has {n} tokens")
    w = make_window(tok, name, text, n, question_tokens, continuation_tokens)
    assert w is not None  # the text has n tokens
    return w
