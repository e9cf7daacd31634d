"""Offline demo: SmolLM2-135M-Instruct (or Gemma 3 270M base, ``--model gemma-3-270m``) + MiniLM on a long generated
document, three KV caches side by side: FP16 (``DynamicCache``), Cocktail with the paper's settings, and Cocktail
with the model's calibrated preset (``model_cards/<model>`` of a source checkout, written by
``python -m hf_cocktail.calibrate``; where the package is installed without it, :meth:`CocktailConfig.recommended`;
``--preset`` picks another). Gemma 3 270M is a base model without a chat template: it gets a completion-form prompt.

    python -m hf_cocktail.demo                       # a generated ~4.4K-token document with one hidden fact
    python -m hf_cocktail.demo --model gemma-3-270m
    python -m hf_cocktail.demo --text-file my.txt --question "..."

Prints the answers, each precision mix, KV bytes vs FP16 and timings; writes a PNG of the chunk search's scores and
precisions (the recommended setting's, or the paper setting's where the recommended one runs no search).
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
from transformers import DynamicCache

from hf_cocktail.cache.cache import CocktailCache
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.offline_models import OFFLINE_MODELS, load_offline_model
from hf_cocktail.planning.scoring import offline_encoder_path
from hf_cocktail.presets.config import CocktailConfig
from hf_cocktail.storage.layer_bits import mean_code_bits

_PLACES = [
    "Ashford",
    "Brindle",
    "Corvale",
    "Dunmere",
    "Eastwick",
    "Fallow",
    "Glenrock",
    "Harrowgate",
    "Ivel",
    "Juniper Hollow",
    "Kestrel",
    "Larchmont",
    "Millbrook",
    "Northcott",
    "Oakhurst",
    "Pendle",
    "Quarry End",
    "Redfern",
    "Stonebridge",
    "Thornbury",
    "Upton",
    "Varley",
    "Westmere",
    "Yarrow",
]
_GOODS = [
    "barley",
    "copper wire",
    "wool",
    "salt",
    "timber",
    "glass jars",
    "lamp oil",
    "rope",
    "tea",
    "iron nails",
    "candles",
    "paper",
    "linen",
    "clay pots",
    "honey",
    "dried fish",
]
_PEOPLE = ["Mara", "Tobin", "Elsie", "Rowan", "Jasper", "Nell", "Ivo", "Perrin", "Wren", "Orla", "Silas", "Hedda"]
_EVENTS = [
    "a late frost damaged the orchards",
    "the river bridge was repaired",
    "a new well was dug",
    "the market moved to the old mill",
    "two carts were lost in a storm",
    "the school roof was replaced",
    "a fair drew visitors from the coast",
    "the road north was closed for a week",
]


def generate_document(n_paragraphs: int = 60, seed: int = 0) -> tuple[str, str, str]:
    """A synthetic ledger of village reports (no copied text) with one unique fact.

    Returns ``(document, question, answer)``.
    """
    rng = random.Random(seed)
    paras = []
    for i in range(n_paragraphs):
        place, good, person = rng.choice(_PLACES), rng.choice(_GOODS), rng.choice(_PEOPLE)
        paras.append(
            f"Report {i + 1} from {place}. The stores of {place} hold {rng.randint(20, 900)} crates of {good}, "
            f"counted by {person} in the {rng.choice(['spring', 'summer', 'autumn', 'winter'])}. This season "
            f"{rng.choice(_EVENTS)}, and {rng.choice(_EVENTS)}. {person} notes that {rng.randint(2, 40)} families "
            f"traded {rng.choice(_GOODS)} for {rng.choice(_GOODS)} at a rate of {rng.randint(2, 9)} to one."
        )
    code = f"{rng.randint(10000, 99999)}"
    needle = f"Special note: the lock combination of the Harbor Archive is {code}. Keep it safe."
    paras.insert(int(n_paragraphs * 0.37), needle)
    return "\n".join(paras), "What is the lock combination of the Harbor Archive?", code


def build_prompt(tok, document: str, question: str) -> str:
    """The chat-template prompt, or a completion-form one for a model without a chat template (a base model)."""
    if not getattr(tok, "chat_template", None):
        return f"Read the document and answer the question.\n\n{document}\n\nQuestion: {question}\nAnswer:"
    msgs = [
        {
            "role": "user",
            "content": f"Read the document and answer the question.\n\n{document}\n\n"
            f"Question: {question}\nAnswer briefly.",
        }
    ]
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def plot_chunks(scores, bits, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {16: "#d62728", 4: "#ff7f0e", 3: "#2ca02c", 2: "#1f77b4"}
    fig, ax = plt.subplots(figsize=(10, 3.2))
    ax.bar(range(len(scores)), scores, color=[colors[b] for b in bits], width=1.0)
    handles = [
        Patch(color=colors[b], label=f"{name} ({bits.count(b)} chunks)")
        for b, name in ((16, "FP16"), (4, "INT4"), (3, "INT3"), (2, "INT2"))
        if b in bits or b != 3
    ]
    ax.set_xlabel("context chunk (original order)")
    ax.set_ylabel("cosine similarity to the query")
    lo = min(scores) if scores else 0.0
    ax.set_ylim(lo - 0.05 * abs(lo), None)
    ax.set_title(title)
    ax.legend(handles=handles, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _run(model, tok, prompt, document, question, config, gen):
    """Generate with a fresh Cocktail cache; returns (answer, seconds, cache)."""
    cache = CocktailCache(config)
    inputs = cache.prepare_inputs(tok, prompt, contexts=document, queries=question)
    t0 = time.perf_counter()
    out = model.generate(**inputs, **cache_kwargs(model, cache), **gen)
    n_prompt = inputs["input_ids"].shape[1]
    return tok.decode(out[0, n_prompt:], skip_special_tokens=True).strip(), time.perf_counter() - t0, cache


def _describe(name, answer, seconds, cache, fp16_bytes, expected):
    rep = cache.memory_report()
    bits = cache.precision_map()[0]
    ok = "" if expected is None else f"  correct: {expected in answer}"
    setup = "chunk search" if cache.chunk_scores()[0] is not None else "quantization, no chunk search"
    print(f"\n{name}: {answer!r}   [{seconds:.1f}s incl. {setup}]{ok}")
    cfg, vb = cache.config, cache.config.value_bits
    print(
        f"  precision mix over {len(bits)} chunks: FP16 {bits.count(16)}, INT4 {bits.count(4)}"
        + (f" (values at {vb} bits)" if vb is not None and vb < 4 and 4 in bits else "")
        + (
            f" (capped per layer: {mean_code_bits(4, cfg.layer_bits, vb):.2f} code bits on average)"
            if cfg.layer_bits and 4 in bits
            else ""
        )
        + ", "
        + (f"INT3 {bits.count(3)}, " if 3 in bits else "")
        + f"INT2 {bits.count(2)}; "
        f"KV {rep['total_bytes'] / 2**20:.2f} MiB = {rep['total_bytes'] / fp16_bytes:.3f}x FP16 (codes "
        f"{rep['codes_bytes'] / 2**20:.2f}, scales/zeros {rep['scales_zeros_bytes'] / 2**20:.2f}, full precision "
        f"{rep['full_precision_bytes'] / 2**20:.2f} MiB"
        + (", 8-bit" if cfg.full_part_bits == 8 else "")
        + (f", with {cfg.salient_tokens:.0%} salient tokens per layer" if cfg.salient_tokens else "")
        + ")"
        + (
            f"; the quantized (full-attention) layers alone: {rep['quantized_layers_ratio_to_fp16']:.3f}x"
            if rep["native_layers_bytes"]
            else ""
        )
    )


CARDS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_cards")
SMOLLM2_PRESET = os.path.join(CARDS_DIR, "smollm2-135m-instruct")
PRESETS = {"smollm2-135m-instruct": SMOLLM2_PRESET, "gemma-3-270m": os.path.join(CARDS_DIR, "gemma-3-270m")}


def recommended_config(
    preset: str | None, encoder: str, model: str = "smollm2-135m-instruct"
) -> tuple[CocktailConfig, str]:
    """The demo's recommended setting and where it came from: ``preset`` if given, else the checkout's preset of
    ``model`` (:data:`PRESETS`) where it exists, else :meth:`CocktailConfig.recommended`."""
    default = SMOLLM2_PRESET if model == "smollm2-135m-instruct" else PRESETS[model]
    if preset is None and os.path.isdir(default):
        preset = default
    if preset is not None:
        return CocktailConfig.from_pretrained(preset, encoder=encoder), f"CocktailConfig.from_pretrained({preset!r})"
    return CocktailConfig.recommended(encoder=encoder), f"CocktailConfig.recommended() (no {model} preset here)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text-file", help="your own document (UTF-8 text); default: a generated one")
    ap.add_argument("--question", help="question about the document (required with --text-file)")
    ap.add_argument("--model", default="smollm2-135m-instruct", choices=list(OFFLINE_MODELS), help="offline model")
    ap.add_argument("--preset", help="folder or Hub id of a cocktail_config.json used instead of the model's preset")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--out-dir", default="demo_out")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args(argv)
    if args.text_file and not args.question:
        ap.error("--question is required with --text-file")
    if args.text_file:
        with open(args.text_file, encoding="utf-8") as f:
            document, question, answer = f.read().strip(), args.question, None
    else:
        document, question, answer = generate_document()
        if args.question:
            question, answer = args.question, None
    t0 = time.perf_counter()
    model, tok = load_offline_model(args.model, getattr(torch, args.dtype))
    print(f"{args.model} loaded in {time.perf_counter() - t0:.1f}s ({args.dtype})")
    encoder = offline_encoder_path()
    paper = CocktailConfig(encoder=encoder)
    recommended, source = recommended_config(args.preset, encoder, args.model)
    print(f"recommended setting: {source}")
    prompt = build_prompt(tok, document, question)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    inputs = tok(prompt, return_tensors="pt")
    n_prompt = inputs["input_ids"].shape[1]
    print(f"prompt: {n_prompt} tokens; question: {question}" + (f" (expected: {answer})" if answer else ""))
    t0 = time.perf_counter()
    dyn = DynamicCache(config=model.config)  # sliding-window layers (Gemma 3) keep their window, as by default
    out = model.generate(**inputs, **cache_kwargs(model, dyn), **gen)
    t_fp16 = time.perf_counter() - t0
    fp16_answer = tok.decode(out[0, n_prompt:], skip_special_tokens=True).strip()
    fp16_bytes = sum(layer.keys.numel() * 2 * 2 for layer in dyn.layers)  # K and V at 2 bytes per element
    ok = "" if answer is None else f"  correct: {answer in fp16_answer}"
    print(f"\nFP16 (DynamicCache): {fp16_answer!r}   [{t_fp16:.1f}s]{ok}  KV {fp16_bytes / 2**20:.2f} MiB")

    runs = {}
    for name, config in (("Cocktail, paper settings", paper), ("Cocktail, recommended setting", recommended)):
        runs[name] = _run(model, tok, prompt, document, question, config, gen)
        _describe(name, *runs[name], fp16_bytes, answer)
    os.makedirs(args.out_dir, exist_ok=True)
    png = os.path.join(args.out_dir, "chunk_precisions.png")
    searched = [(n, r[2]) for n, r in runs.items() if r[2].chunk_scores()[0] is not None]
    name, cache = searched[-1] if searched else ("recommended", runs["Cocktail, recommended setting"][2])
    scores = cache.chunk_scores()[0] or [0.0] * len(cache.precision_map()[0])
    label = name.split(", ")[-1] if searched else name
    plot_chunks(scores, cache.precision_map()[0], png, f"Cocktail chunk search ({label}): {question[:60]}")
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
