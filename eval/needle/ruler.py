"""RULER-style needles (``python -m eval.needle --variant ...``): the NIAH tasks of RULER (Hsieh et al. 2024,
github.com/NVIDIA/RULER, ``scripts/data/synthetic/niah.py`` and ``synthetic.yaml``) over the Paul Graham essays.

A needle is "One of the special magic numbers for {key} is: {value}." (key: an adjective-noun word pair, value: a
random 7-digit number, RULER's ``type_needle_k=words``, ``type_needle_v=numbers``). A variant plants
``num_k`` keys with ``num_v`` values each (``num_k * num_v`` needles) at depths drawn without replacement from RULER's
40 evenly spaced depths, and asks for the values of ``num_q`` keys (``num_k = max(num_k, num_q)`` as in RULER):

* ``single`` (RULER ``niah_single_2``): one key, one value, asked.
* ``multikey`` (``niah_multikey_1``): four keys with one value each; one is asked, three are distractors.
* ``multivalue`` (``niah_multivalue``): one key with four values; all four are expected.
* ``multiquery`` (``niah_multiquery``): four keys with one value each; all four are asked at once.

The prompt is RULER's template and answer prefix (singular wording when one value is expected) inside the model's
chat template, the answer prefix after the assistant header as RULER's chat templates do. ``length`` is RULER's
``max_seq_length``: prompt tokens + RULER's 128 tokens to generate fit in it, the haystack filling the rest.
The score of a case is RULER's ``string_match_all``: the fraction of the expected values found in the output
(case-insensitive substring match).

Differences from RULER, all stated in eval/README.md: the haystack is sized in tokens (within a few tokens of the
budget) instead of RULER's 500-word steps; sample ``s`` starts at essay ``7s mod n`` (as the classic needle harness)
where RULER starts every sample at the first essay; sentences are split with a regular expression (NLTK's punkt data
is not available offline); the keys come from a built-in adjective and noun list rather than wonderwords'; each
needle goes at the sentence boundary at or before its depth's share of the haystack's characters (RULER: sentence
index ``int(n_sentences * depth)``).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from ..chat import CHAT_TOKENIZER_KWARGS, chat_prompt, has_chat_template
from ..cli import UsageError

TOKENS_TO_GENERATE = 128  # RULER's niah tokens_to_generate: part of the length budget
MIN_LENGTH = 512
NEEDLE = "One of the special magic numbers for {key} is: {value}."
TEMPLATE = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz "
    "you about the numbers afterwards.\n{context}\nWhat are all the special magic numbers for {query} "
    "mentioned in the provided text?"
)
ANSWER_PREFIX = " The special magic numbers for {query} mentioned in the provided text are"
DEPTHS = [round(100 * i / 39) / 100 for i in range(40)]  # RULER: np.round(np.linspace(0, 100, num=40))
SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


@dataclass(frozen=True)
class Variant:
    name: str
    ruler_task: str
    num_k: int
    num_v: int
    num_q: int


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in [
        Variant("single", "niah_single_2", 1, 1, 1),
        Variant("multikey", "niah_multikey_1", 4, 1, 1),
        Variant("multivalue", "niah_multivalue", 1, 4, 1),
        Variant("multiquery", "niah_multiquery", 4, 1, 4),
    ]
}

ADJECTIVES = """able acid angry amused brave bright broad calm cheap clean clever cold crazy curly damp dark deep
dizzy dry eager early easy empty fancy fast fierce flat fresh funny gentle giant glad grumpy happy heavy hollow huge
icy jolly kind large lazy little loud lucky mellow messy mighty modern narrow neat nervous noisy odd old orange plain
polite proud quick quiet rapid rare rich rough round royal rusty sad scary shiny short silent silly slow small smooth
soft sour spicy steep sticky strong sunny sweet swift tall tame tender thin tidy tiny tough ugly upset vast warm weak
wet whole wide wild wise witty young zany""".split()
NOUNS = """anchor apple arrow badge banjo barrel basket beacon bell bicycle blanket bottle bridge bucket butter
button cabin camel candle canoe carpet castle cherry circle cloud compass cookie copper cotton crayon crystal dagger
desert diamond dolphin dragon drum eagle engine falcon feather fiddle forest fountain garden giraffe glacier goblet
guitar hammer harbor helmet island jacket jungle kettle ladder lantern lemon lizard magnet marble meadow mirror
monkey needle noodle ocean orchard otter paddle parrot pebble pepper piano pillow planet pocket puzzle rabbit radish
ribbon river rocket saddle sailor salmon shovel spider spoon squirrel statue sunset teapot thimble tiger tractor
trumpet tulip turnip umbrella valley violin wagon walnut whistle window wizard zebra""".split()


def case_key(variant: str, length: int, sample: int) -> str:
    return f"{variant}-L{length}-s{sample}"


def parse_variants(spec: str) -> list[str]:
    """``--variant``: comma-separated names from :data:`VARIANTS`, each once."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise UsageError(f"--variant is empty; choose from {', '.join(VARIANTS)}")
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        raise UsageError(
            f"unknown --variant {', '.join(repr(b) for b in bad)}; choose from {', '.join(VARIANTS)} (comma-separated)"
        )
    if len(set(names)) != len(names):
        raise UsageError(f"--variant lists a variant twice: {names}")
    return names


def check_lengths(lengths: list[int], max_positions: int | None = None) -> None:
    """RULER lengths: at least :data:`MIN_LENGTH` tokens, at most the model's window (``max_positions``)."""
    small = [x for x in lengths if x < MIN_LENGTH]
    if small:
        raise UsageError(
            f"--lengths {small}: RULER variants need lengths >= {MIN_LENGTH} tokens (the template, the "
            f"needles and the {TOKENS_TO_GENERATE} tokens to generate take ~350)"
        )
    if max_positions:
        big = [x for x in lengths if x > max_positions]
        if big:
            raise UsageError(
                f"--lengths {big} exceed the model's window of {max_positions} tokens (max_position_embeddings)"
            )


def string_match_all(pred: str, refs: list[str]) -> float:
    """RULER's niah metric for one case: the fraction of ``refs`` that occur in ``pred`` (case-insensitive)."""
    return sum(1.0 if r.lower() in pred.lower() else 0.0 for r in refs) / len(refs)


def _template(single_answer: bool) -> tuple[str, str]:
    """RULER's template and answer prefix; with one expected value RULER rewrites them to the singular."""
    template, prefix = TEMPLATE, ANSWER_PREFIX
    if single_answer:

        def sing(t):
            t = t.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")
            return t.replace("numbers", "number")

        template, prefix = sing(template), sing(prefix)
    return template, prefix


def join_query(keys: list[str]) -> str:
    return ", ".join(keys[:-1]) + ", and " + keys[-1] if len(keys) > 1 else keys[0]


def draw_needles(variant: Variant, rng: random.Random) -> tuple[list[str], list[list[str]], list[str]]:
    """Keys (distinct), their values (distinct 7-digit numbers) and the needle sentences, shuffled (RULER order)."""
    num_k = max(variant.num_k, variant.num_q)
    keys, values, needles = [], [], []
    seen: set[str] = set()
    while len(keys) < num_k:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in keys:
            keys.append(key)
    for key in keys:
        vs = []
        while len(vs) < variant.num_v:
            v = str(rng.randint(1_000_000, 9_999_999))
            if v not in seen:
                seen.add(v)
                vs.append(v)
                needles.append(NEEDLE.format(key=key, value=v))
        values.append(vs)
    rng.shuffle(needles)
    return keys, values, needles


def sentence_starts(text: str) -> list[int]:
    """Character offsets where a sentence may be inserted: 0, after each sentence end, and the end of ``text``."""
    return sorted({0, len(text)} | {m.end() for m in SENTENCE_END.finditer(text)})


def insert_needles(hay: str, needles: list[str], depths: list[float]) -> tuple[str, list[float]]:
    """``hay`` with ``needles[i]`` at the sentence boundary at or before ``depths[i]`` of its characters (needles
    sorted by depth go in that order; one space on each side). Returns the context and each needle's haystack
    fraction (characters of haystack before it / all)."""
    starts = sentence_starts(hay)
    spots = [max(b for b in starts if b <= d * len(hay)) for d in depths]
    order = sorted(range(len(needles)), key=lambda i: (spots[i], depths[i]))
    parts, prev = [], 0
    for i in order:
        parts.append(hay[prev : spots[i]].strip())
        parts.append(needles[i])
        prev = spots[i]
    parts.append(hay[prev:].strip())
    context = " ".join(p for p in parts if p)
    return context, [spots[i] / max(1, len(hay)) for i in range(len(needles))]


def haystack_source(essays: list[str], sample: int, min_chars: int) -> str:
    """Essays from ``7*sample mod n`` on, whitespace collapsed as RULER does, joined by spaces, at least ``min_chars``
    long when the essays allow."""
    k = (sample * 7) % len(essays)
    parts, n = [], 0
    for e in essays[k:] + essays[:k]:
        parts.append(re.sub(r"\s+", " ", e).strip())
        n += len(parts[-1]) + 1
        if n >= min_chars:
            break
    return " ".join(parts)


def build_prompt(tok, context: str, query_keys: list[str], single_answer: bool) -> tuple[str, str, dict]:
    """The chat prompt (RULER's template as the user turn, the answer prefix after the assistant header; without a
    chat template the completion form, :mod:`eval.chat`: the template's text, then the answer prefix), the
    question (the search query of Cocktail kinds) and the tokenizer keyword arguments."""
    template, prefix = _template(single_answer)
    query = join_query(query_keys)
    content = template.format(context=context, query=query)
    question = content[content.rindex("\n") + 1 :]
    answer_prefix = prefix.format(query=query).lstrip()
    if has_chat_template(tok):
        return chat_prompt(tok, content) + answer_prefix, question, dict(CHAT_TOKENIZER_KWARGS)
    return content + " " + answer_prefix, question, {}  # the completion form (eval.chat)


def make_case(
    tok,
    essays: list[str],
    variant: str,
    length: int,
    sample: int,
    seed: int = 0,
    depths: list[float] | None = None,
    tolerance: int = 8,
) -> dict:
    """One RULER case: ``prompt_tokens + TOKENS_TO_GENERATE`` within ``tolerance`` tokens below ``length`` (never
    above). ``depths``: one per needle (default: drawn without replacement from RULER's 40 depths)."""
    spec = VARIANTS[variant]
    rng = random.Random(f"ruler-{seed}-{variant}-{length}-{sample}")
    keys, values, needles = draw_needles(spec, rng)
    if depths is None:
        depths = rng.sample(DEPTHS, len(needles))
    if len(depths) != len(needles):
        raise ValueError(f"{variant} plants {len(needles)} needles, got {len(depths)} depths")
    query_idx = rng.sample(range(len(keys)), spec.num_q)
    queries = [keys[i] for i in query_idx]
    expected = [v for i in query_idx for v in values[i]]
    single = len(expected) == 1
    budget = length - TOKENS_TO_GENERATE
    src = haystack_source(essays, sample, 6 * budget)
    enc = tok(src, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    n_hay = budget - 150
    best = None
    for _ in range(8):
        if n_hay > len(offsets):
            raise UsageError(f"the essays have only {len(offsets)} tokens, too few for --lengths {length}")
        cut = offsets[max(0, n_hay - 1)][1]
        hay = src[:cut]
        if cut < len(src) and not src[cut].isspace() and " " in hay:  # end on a word boundary
            hay = hay[: hay.rindex(" ")]
        context, fracs = insert_needles(hay, needles, depths)
        prompt, question, kw = build_prompt(tok, context, queries, single)
        n = len(tok(prompt, **kw)["input_ids"])
        if n <= budget and (best is None or n > best[0]):
            best = (n, context, fracs, prompt, question, kw)
        if budget - tolerance <= n <= budget:
            break
        n_hay += budget - n - (1 if n > budget else 0)
    if best is None:
        raise UsageError(f"could not fit a prompt into --lengths {length}")
    n, context, fracs, prompt, question, kw = best
    return {
        "variant": variant,
        "ruler_task": spec.ruler_task,
        "length": length,
        "sample": sample,
        "keys": keys,
        "values": values,
        "queries": queries,
        "expected": expected,
        "context": context,
        "prompt": prompt,
        "question": question,
        "tokenizer_kwargs": kw,
        "prompt_tokens": n,
        "needles": [{"text": t, "depth": d, "haystack_frac": round(f, 4)} for t, d, f in zip(needles, depths, fracs)],
    }
