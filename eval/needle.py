"""Needle in a haystack over the Paul Graham essays, for several KV-cache methods side by side.

A needle sentence holding a random 7-digit passcode is inserted at a sentence boundary at a given depth (0 = start,
1 = end) of a haystack of ``length`` tokens cut from the essays; the model is asked for the passcode (chat template,
greedy, 16 new tokens). A case is correct when the passcode appears in the answer. Like ``eval/longbench.py``, each
case is prefilled once at full precision and branched into every method's cache (``eval/methods.py``).

Two uses (see eval/README.md)::

    # grid: one heatmap PNG per method (lengths x depths) + a CSV
    python eval/needle.py --out-dir eval/results/needle_grid --lengths 1000,2000,4000 --depths 0,0.25,0.5,0.75,1 \
        --methods fp16,cocktail,int2
    # fixed length: >= 20 cases at ~3000 tokens, accuracy table with each method's kv_ratio
    python eval/needle.py --out-dir eval/results/needle_3000 --lengths 3000 --depths 0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1 \
        --samples 2 --methods fp16,cocktail,int4,int2

Resumable: finished (case, method) results in ``records.jsonl`` are never recomputed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eval.common import (DATA_DIR, UsageError, append_jsonl, cache_kv_bytes, check_settings, command_line,  # noqa: E402
                         fp16_kv_bytes, git_commit, hardware_info, model_input_device, parse_float_list, parse_int_list,
                         set_threads, write_json)

NEEDLE = "The secret passcode for the vault is {code}."
QUESTION = "What is the secret passcode for the vault?"
INSTRUCTION = "Read the essays below and answer the question that follows them.\n\n"
ASK = "\n\nQuestion: {question} Answer with the passcode only.\nAnswer:"


def load_haystack(essay_dir: str) -> list[str]:
    if not os.path.isdir(essay_dir):
        raise UsageError(f"Paul Graham essays not found at {essay_dir} (--essay-dir; the data lives in "
                         "../shared/data/paul_graham_essays)")
    files = sorted(f for f in os.listdir(essay_dir) if f.endswith(".txt"))
    if not files:
        raise UsageError(f"no .txt essays in {essay_dir}")
    out = []
    for f in files:
        with open(os.path.join(essay_dir, f), encoding="utf-8") as fh:
            out.append(fh.read().strip())
    return out


def make_case(tok, essays: list[str], length: int, depth: float, sample: int, seed: int = 0) -> dict:
    """Haystack of ``length`` tokens (needle included) starting at essay ``sample*7 % n``, needle at ``depth``."""
    rng = random.Random(f"{seed}-{length}-{depth}-{sample}")
    code = str(rng.randint(1_000_000, 9_999_999))
    needle = NEEDLE.format(code=code)
    k = (sample * 7) % len(essays)
    text = "\n\n".join(essays[k:] + essays[:k])
    n_needle = len(tok(" " + needle, add_special_tokens=False)["input_ids"])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < length:
        raise UsageError(f"the haystack has only {len(ids)} tokens, fewer than --lengths {length}")
    hay = tok.decode(ids[:max(1, length - n_needle)])
    pos = len(tok.decode(ids[:int(round(depth * max(0, length - n_needle)))]))
    if pos >= len(hay):
        cut = len(hay)
    else:  # back off to the end of the previous sentence
        cut = max(hay.rfind(". ", 0, pos), hay.rfind(".\n", 0, pos))
        cut = 0 if cut < 0 else cut + 1
    context = (hay[:cut].rstrip() + " " + needle + " " + hay[cut:].lstrip()).strip()
    return {"length": length, "depth": depth, "sample": sample, "code": code, "context": context,
            "needle_char": cut}


def build_prompt(tok, context: str, raw: bool = False) -> tuple[str, dict]:
    """The chat prompt; ``raw``: the haystack at the very start of a plain prompt (no instruction, no template, no
    special tokens), so that the prompt's first tokens (the attention sinks) belong to the context."""
    if raw:
        return context + ASK.format(question=QUESTION), {"add_special_tokens": False}
    content = INSTRUCTION + context + ASK.format(question=QUESTION)
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True), {"add_special_tokens": False}
    return content, {}


def case_key(length, depth, sample) -> str:
    return f"L{length}-d{depth:g}-s{sample}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Needle in a haystack (Paul Graham essays) per KV-cache method",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device-map", default=None)
    p.add_argument("--essay-dir", default=os.path.join(DATA_DIR, "paul_graham_essays"))
    p.add_argument("--lengths", default="1000,2000,4000", help="haystack lengths in tokens, comma-separated")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1], comma-separated")
    p.add_argument("--samples", type=int, default=1, help="cases per (length, depth): other haystack / passcode")
    p.add_argument("--methods", default="fp16,cocktail,int4,int2")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--encoder", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw-prompt", action="store_true",
                   help="haystack first, no instruction or chat template (the attention-sink study)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.length_list = parse_int_list(args.lengths, "--lengths")
    args.depth_list = parse_float_list(args.depths, "--depths")
    if any(x < 64 for x in args.length_list):
        raise UsageError(f"--lengths must be >= 64 tokens, got {args.length_list}")
    if any(not 0 <= d <= 1 for d in args.depth_list):
        raise UsageError(f"--depths must lie in [0, 1], got {args.depth_list}")
    if args.samples < 1:
        raise UsageError(f"--samples must be >= 1, got {args.samples}")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be >= 1")
    return args


SETTINGS_KEYS = ("model", "dtype", "max_new_tokens", "encoder", "seed", "raw_prompt")


def _check_settings(args) -> None:
    """Refuse to resume into ``--out-dir`` with settings that change what a finished case means; folders written
    before settings.json existed are compared with their run_info's args."""
    fallback = None
    info = os.path.join(args.out_dir, "run_info.json")
    if os.path.isfile(info):
        with open(info, encoding="utf-8") as f:
            old_args = json.load(f).get("config", {}).get("args", {})
        defaults = vars(parse_args(["--out-dir", args.out_dir]))
        fallback = {k: old_args.get(k, defaults[k]) for k in SETTINGS_KEYS}
    check_settings(args.out_dir, {k: getattr(args, k) for k in SETTINGS_KEYS}, SETTINGS_KEYS, fallback)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    commit = git_commit(exclude=args.out_dir)  # the code that runs (read now: a commit made mid-run is not it)
    from eval.methods import parse_methods

    methods = parse_methods(args.methods)
    essays = load_haystack(args.essay_dir)
    set_threads(1, args.threads)
    import torch
    from tqdm.auto import tqdm

    from eval.common import load_model_and_tokenizer
    from eval.methods import branch, generate_from_branch, prefill
    from hf_cocktail import offline_encoder_path

    encoder = args.encoder or offline_encoder_path()
    _check_settings(args)
    rec_path = os.path.join(args.out_dir, "records.jsonl")
    done = {}
    if os.path.isfile(rec_path):
        with open(rec_path, encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                done[(r["case"], r["method"])] = r
    cases = [(L, d, s) for L in args.length_list for d in args.depth_list for s in range(args.samples)]
    todo = [(c, [m for m in methods if (case_key(*c), m.name) not in done]) for c in cases]
    todo = [(c, ms) for c, ms in todo if ms]
    if todo:
        model, tok = load_model_and_tokenizer(args.model, args.dtype, "cocktail", args.device_map)
        dev = model_input_device(model)
        eos = model.generation_config.eos_token_id
        eos = list(eos) if isinstance(eos, (list, tuple)) else [eos if eos is not None else tok.eos_token_id]
        for (L, d, s), ms in tqdm(todo, desc="needle", disable=args.no_progress, dynamic_ncols=True):
            case = make_case(tok, essays, L, d, s, args.seed)
            prompt, kw = build_prompt(tok, case["context"], raw=args.raw_prompt)
            input_ids = tok(prompt, return_tensors="pt", **kw)["input_ids"].to(dev)
            t0 = time.perf_counter()
            dyn, logits = prefill(model, input_ids)
            prefill_s = time.perf_counter() - t0
            for m in ms:
                br = branch(m, model, tok, dyn, input_ids, prompt, case["context"], QUESTION, case_key(L, d, s),
                            kw, encoder)
                t1 = time.perf_counter()
                new = generate_from_branch(model, br.cache, input_ids, logits, args.max_new_tokens, eos)
                dec = time.perf_counter() - t1
                pred = tok.decode(new[0], skip_special_tokens=True)
                seq = int(br.cache.get_seq_length())
                kv = cache_kv_bytes(br.cache)
                rec = {"case": case_key(L, d, s), "length": L, "depth": d, "sample": s, "method": m.name,
                       "code": case["code"], "pred": pred, "correct": int(case["code"] in pred),
                       "prompt_tokens": int(input_ids.shape[1]), "kv_bytes": kv,
                       "fp16_kv_bytes": fp16_kv_bytes(model.config, seq),
                       "kv_ratio": kv / fp16_kv_bytes(model.config, seq), "prefill_s": prefill_s + br.setup_s,
                       "decode_s": dec, "precision_counts": br.precision_counts,
                       "needle_chunk_bits": _needle_chunk_bits(tok, br, prompt, case, kw)}
                append_jsonl(rec_path, rec)
                done[(rec["case"], m.name)] = rec
                del br
            del dyn
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    report(args, methods, cases, done)
    info_path = os.path.join(args.out_dir, "run_info.json")
    old = json.load(open(info_path, encoding="utf-8")) if os.path.isfile(info_path) else {}
    prev = old.get("invocations") or ([{k: old[k] for k in ("command", "commit", "runtime_s")}] if old else [])
    inv = prev + [{"command": command_line(), "commit": commit,
                                         "runtime_s": round(time.time() - t_start, 1), "cases_processed": len(todo)}]
    write_json(info_path, {
        "command": inv[0]["command"], "commit": inv[0]["commit"],
        "runtime_s": round(sum(x["runtime_s"] for x in inv), 1), "hardware": old.get("hardware") or hardware_info(),
        "config": {"methods": {m.name: m.config_dict(encoder) for m in methods},
                   "args": {k: v for k, v in vars(args).items()}, "needle": NEEDLE, "question": QUESTION},
        "invocations": inv})
    return 0


def _needle_chunk_bits(tok, br, prompt, case, kw):
    """Precision given to the chunk(s) holding the needle (Cocktail kinds), to see whether the search found it."""
    if br.precision_map is None:
        return None
    plan = br.cache._plans[0]
    needle = NEEDLE.format(code=case["code"])
    c0 = prompt.find(needle)
    if c0 < 0:
        return None
    enc = tok(prompt, return_offsets_mapping=True, **kw)
    toks = [t for t, (a, b) in enumerate(enc["offset_mapping"]) if b > a and a < c0 + len(needle) and b > c0]
    C = br.cache.config.chunk_size
    chunks = sorted({(t - plan.ctx_start) // C for t in toks if plan.ctx_start <= t < plan.ctx_end})
    return [br.precision_map[i] for i in chunks]


def report(args, methods, cases, done) -> None:
    keys = [case_key(*c) for c in cases]
    rows = [done[(k, m.name)] for k in keys for m in methods if (k, m.name) in done]
    with open(os.path.join(args.out_dir, "needle.csv"), "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["length", "depth", "sample", "method", "correct", "kv_ratio", "code", "pred",
                    "needle_chunk_bits"])
        for r in rows:
            w.writerow([r["length"], r["depth"], r["sample"], r["method"], r["correct"], f"{r['kv_ratio']:.4f}",
                        r["code"], r["pred"], r.get("needle_chunk_bits")])
    lines = ["| method | accuracy | correct / cases | kv_ratio | needle chunk at FP16 | acc. needle in 1 chunk | "
             "acc. needle split over 2 chunks |", "|---|---|---|---|---|---|---|"]
    for m in methods:
        rs = [r for r in rows if r["method"] == m.name]
        if not rs:
            continue
        acc = sum(r["correct"] for r in rs) / len(rs)
        kvr = sum(r["kv_ratio"] for r in rs) / len(rs)
        nb = [r.get("needle_chunk_bits") for r in rs if r.get("needle_chunk_bits")]
        fp = f"{sum(16 in b for b in nb)}/{len(nb)}" if nb else "-"

        def sub(pred):
            sel = [r for r in rs if r.get("needle_chunk_bits") and pred(len(r["needle_chunk_bits"]))]
            return f"{sum(r['correct'] for r in sel)}/{len(sel)}" if sel else "-"

        lines.append(f"| {m.name} | {100 * acc:.1f}% | {sum(r['correct'] for r in rs)}/{len(rs)} | {kvr:.3f} | {fp} | "
                     f"{sub(lambda n: n == 1)} | {sub(lambda n: n > 1)} |")
    lens = sorted({r["length"] for r in rows})
    header = (f"Needle in a haystack (Paul Graham essays), lengths {lens} tokens, depths {sorted(set(args.depth_list))}, "
              f"{args.samples} sample(s) per cell; kv_ratio = KV bytes / FP16 DynamicCache bytes of the same tokens. "
              "'needle chunk at FP16': cases where a chunk holding the needle sentence got FP16 (CocktailCache kinds); "
              "the last two columns split the cases by whether the needle sentence lies in one chunk or straddles "
              "two.")
    table = header + "\n\n" + "\n".join(lines) + "\n"
    with open(os.path.join(args.out_dir, "needle_accuracy.md"), "w", encoding="utf-8") as f:
        f.write("# Needle accuracy\n\n" + table)
    print(table)
    _heatmaps(args, methods, rows)


def _heatmaps(args, methods, rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = sorted(set(args.length_list))
    depths = sorted(set(args.depth_list))
    for m in methods:
        rs = [r for r in rows if r["method"] == m.name]
        if not rs:
            continue
        grid = np.full((len(lengths), len(depths)), np.nan)
        for i, L in enumerate(lengths):
            for j, d in enumerate(depths):
                cell = [r["correct"] for r in rs if r["length"] == L and abs(r["depth"] - d) < 1e-9]
                if cell:
                    grid[i, j] = sum(cell) / len(cell)
        kvr = sum(r["kv_ratio"] for r in rs) / len(rs)
        fig, ax = plt.subplots(figsize=(1.0 + 0.7 * len(depths), 1.2 + 0.55 * len(lengths)))
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(L) for L in lengths])
        ax.set_xlabel("needle depth")
        ax.set_ylabel("context tokens")
        for i in range(len(lengths)):
            for j in range(len(depths)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
        ax.set_title(f"{m.name}: accuracy {100 * np.nanmean(grid):.0f}%, kv_ratio {kvr:.2f}", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out_dir, f"heatmap_{m.name}.png"), dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    from eval.common import run_cli  # noqa: E402

    run_cli(main)
