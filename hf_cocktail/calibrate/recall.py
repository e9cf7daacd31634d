"""Recall probes: a held-out window's context with key-value needles inserted, the question asking one of them.

The continuation KL of an essay (:mod:`.texts`) measures how a setting disturbs the model continuing the text; it
does not see retrieval from deep in the quantized context, which is what long-context prompts ask for (on Gemma 3
270M two settings within 5% of each other in continuation KL lost 0.8 and 5.1 points on RULER-style needles). A
recall probe is RULER's multi-key needle in completion form, built from the user's own text and in its own wording
(not RULER's, so that the RULER-style evaluation in ``eval/`` stays a held-out test of the choice):

* :data:`NEEDLES` sentences ``"Remember this: the access code of the {key} account is {value}."`` inserted into the
  window's context at evenly spread depths (:func:`insertion_points`), keys from :data:`KEYS`, values 7-digit
  numbers, both drawn from a generator seeded by the window's name;
* the question ``"Question: what is the access code of the {key} account?\nAnswer: the access code of the {key}
  account"`` for one of them (kept at full precision, the query of the chunk search and of the salient tokens);
* the continuation ``" is {value}."`` (its token ids as they follow the question), teacher-forced: the KL over it
  includes the prediction of every digit of the value.
"""

from __future__ import annotations

import random
import zlib

from hf_cocktail.calibrate.texts import Window

KEYS = (
    "harbor", "lantern", "meadow", "copper", "falcon", "orchard", "glacier", "violin",
    "quarry", "saddle", "thimble", "walnut", "beacon", "cobalt", "juniper", "marble",
)  # fmt: skip
NEEDLE = "Remember this: the access code of the {key} account is {value}."
QUESTION = "\n\nQuestion: what is the access code of the {key} account?\nAnswer: the access code of the {key} account"
ANSWER = " is {value}."
NEEDLES = 4  # needles per probe, one of them asked


def insertion_points(context: str, n: int) -> list[int]:
    """``n`` character offsets of ``context`` at depths ``(i + 0.5) / n``: just after the sentence end (``". "``)
    nearest each depth when one lies within half a spacing (``len / (2 n)``) of it, else just after the nearest space,
    else the depth itself; sorted."""
    depths = [round(len(context) * (i + 0.5) / n) for i in range(n)]
    reach = len(context) / (2 * n)
    ends = [j + 2 for j in _offsets_of(context, ". ")]
    spaces = [j + 1 for j in _offsets_of(context, " ")]
    points = []
    for d in depths:
        near_end = min(ends, key=lambda j: abs(j - d), default=None)
        if near_end is not None and abs(near_end - d) <= reach:
            points.append(near_end)
        else:
            points.append(min(spaces, key=lambda j: abs(j - d), default=d))
    return sorted(points)


def _offsets_of(text: str, sub: str) -> list[int]:
    out, j = [], text.find(sub)
    while j >= 0:
        out.append(j)
        j = text.find(sub, j + 1)
    return out


def recall_window(tok, window: Window, needles: int = NEEDLES) -> Window:
    """The recall probe of ``window`` (see the module docstring): its context with ``needles`` needles, the question
    for one of them and the answer's token ids as the continuation. Deterministic in ``window.name``."""
    if not 1 <= needles <= len(KEYS):
        raise ValueError(f"needles must be in [1, {len(KEYS)}], got {needles!r}")
    rng = random.Random(zlib.crc32(window.name.encode("utf-8")))
    keys = rng.sample(KEYS, needles)
    values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in keys]
    context = window.context
    for at, key, value in reversed(list(zip(insertion_points(context, needles), keys, values))):
        context = context[:at] + NEEDLE.format(key=key, value=value) + " " + context[at:]
    asked = rng.randrange(needles)
    question = QUESTION.format(key=keys[asked])
    answer = answer_ids(tok, question, ANSWER.format(value=values[asked]))
    return Window(f"{window.name} (recall)", context, question, answer)


def answer_ids(tok, question: str, answer: str) -> tuple[int, ...]:
    """The ids ``answer`` takes after ``question``: the tail of ``question + answer``'s ids when ``question``'s ids
    are their prefix (tokenizers that mark a word's start, e.g. SentencePiece's ``▁``, would give a lone ``answer``
    other ids), else ``answer``'s own."""
    q = tok(question, add_special_tokens=False)["input_ids"]
    qa = tok(question + answer, add_special_tokens=False)["input_ids"]
    if len(qa) > len(q) and qa[: len(q)] == q:
        return tuple(qa[len(q) :])
    return tuple(tok(answer, add_special_tokens=False)["input_ids"])
