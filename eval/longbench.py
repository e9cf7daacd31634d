"""LongBench v1 evaluation of KV-cache methods side by side (official ``pred.py`` / ``eval.py`` protocol).

Per example: the task's prompt template is filled, the tokenized prompt is truncated in the middle to ``--window``
tokens, the chat template is applied (except for trec, triviaqa, samsum, lsht, lcc, repobench-p), the whole prompt is
prefilled ONCE into a full-precision ``DynamicCache`` and that prefill is branched into every method's cache (see
``eval/methods.py``); the first new token is the argmax of the shared prefill's last logits (as in a plain
``generate``: every cache attends at full precision during its own prefill) and each method's cache decodes the rest
greedily, up to the task's ``dataset2maxlen`` new tokens (samsum also stops at a newline, as the official code does).

Usage (see eval/README.md)::

    python eval/longbench.py --out-dir eval/runs/lb --tasks qasper,trec --limit 2 --methods fp16,cocktail,int2
    accelerate launch --cpu --num_processes 2 eval/longbench.py --out-dir eval/runs/lb ...

Outputs under ``--out-dir``: ``predictions/<task>/<method>.jsonl``, ``scores.json``, ``summary.md``,
``summary.csv``, ``score_vs_kv.png``, ``precision_mix.png``, ``run_info.json``. Runs resume: a finished (task, method,
example) prediction is never recomputed or overwritten.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import glob
import json
import os
import sys
import time
from dataclasses import dataclass, field

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eval.common import (DATA_DIR, UsageError, append_jsonl, cache_kv_bytes, check_settings, command_line,  # noqa: E402
                         fp16_kv_bytes, git_commit, hardware_info, model_input_device, set_threads, write_json)
from eval.metrics import ENGLISH_TASKS, example_score, metric_for  # noqa: E402

NO_CHAT_TASKS = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
CODE_TASKS = ("lcc", "repobench-p")
DEFAULT_METHODS = "fp16,cocktail,int4,int2,kivi2,nosearch,hqq2"
SETTINGS_KEYS = ("model", "dtype", "window", "chat", "encoder", "max_new_tokens_cap")  # must match to resume
_SENTINEL = "\u2063\u2063CONTEXT\u2063\u2063"


# ---------------------------------------------------------------------------------------------- data
def load_config(config_dir: str) -> tuple[dict, dict]:
    p = os.path.join(config_dir, "dataset2prompt.json")
    m = os.path.join(config_dir, "dataset2maxlen.json")
    for f in (p, m):
        if not os.path.isfile(f):
            raise UsageError(f"LongBench config file {f} not found (set --config-dir to the folder holding "
                             "dataset2prompt.json and dataset2maxlen.json from the LongBench repository)")
    with open(p, encoding="utf-8") as f1, open(m, encoding="utf-8") as f2:
        return json.load(f1), json.load(f2)


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_task_rows(task: str, data_dir: str | None, hub: bool) -> list[dict]:
    """Rows of ``task`` in the LongBench schema, from ``data_dir/<task>.jsonl`` or the Hub (THUDM/LongBench)."""
    if hub:
        import zipfile

        from huggingface_hub import hf_hub_download

        try:
            z = hf_hub_download("THUDM/LongBench", "data.zip", repo_type="dataset")
        except Exception as e:  # offline, no cache
            raise UsageError(f"--hub: could not download THUDM/LongBench data.zip ({type(e).__name__}: {e}); "
                             "use --data-dir with local jsonl files instead") from e
        with zipfile.ZipFile(z) as zf:
            with zf.open(f"data/{task}.jsonl") as f:
                return [json.loads(line) for line in f.read().decode("utf-8").splitlines() if line.strip()]
    path = os.path.join(data_dir, f"{task}.jsonl")
    if not os.path.isfile(path):
        raise UsageError(f"no data for task {task!r}: {path} does not exist (--data-dir {data_dir})")
    return read_jsonl(path)


def example_ids(rows: list[dict]) -> list[str]:
    ids, seen = [], set()
    for i, r in enumerate(rows):
        x = str(r.get("_id", i))
        if x in seen:
            x = f"{x}#{i}"
        seen.add(x)
        ids.append(x)
    return ids


# ---------------------------------------------------------------------------------------------- prompts
@dataclass
class PromptInfo:
    prompt: str  # the final prompt (chat template applied where the protocol says so)
    context: str  # the context as it appears in ``prompt`` (after middle truncation); '' if it could not be located
    query: str  # what the Cocktail search scores the chunks against
    query_source: str  # "input" | "instruction" | "code_tail"
    chat: bool
    truncated: bool
    raw_tokens: int  # tokens of the untruncated prompt
    tokenizer_kwargs: dict = field(default_factory=dict)


def _context_after_truncation(tok, prompt: str, prefix: str, suffix: str, context: str, ids, offsets,
                              half: int) -> str:
    """The part of the original context that survives the middle truncation, as it appears in ``prompt``."""
    if prompt.startswith(prefix) and prompt.endswith(suffix) and len(prompt) >= len(prefix) + len(suffix):
        return prompt[len(prefix):len(prompt) - len(suffix)]
    # the cut is outside the context (in the instruction or the question): locate the context tokens by offsets
    c0, c1 = len(prefix), len(prefix) + len(context)
    n = len(ids)

    def inside(t):
        a, b = offsets[t]
        return b > a and a >= c0 and b <= c1

    first = [t for t in range(half) if inside(t)]
    second = [t for t in range(n - half, n) if inside(t)]
    pieces = []
    if first and second and first[-1] == half - 1 and second[0] == n - half:
        pieces.append(tok.decode(ids[first[0]:first[-1] + 1]) + tok.decode(ids[second[0]:second[-1] + 1]))
    for sel in (first, second):
        if sel:
            pieces.append(tok.decode(ids[sel[0]:sel[-1] + 1]))
    for piece in sorted(pieces, key=len, reverse=True):
        for cand in (piece, piece.strip()):
            if cand and cand in prompt:
                return cand
    return ""


def build_prompt(tok, task: str, ex: dict, template: str, window: int, use_chat: bool = True) -> PromptInfo:
    """LongBench ``pred.py``: fill the template, middle-truncate the tokenized prompt to ``window`` tokens, apply
    the chat template except for the few-shot / code tasks."""
    context, inp = ex["context"], ex["input"]
    prompt = template.format(context=context, input=inp)
    marked = template.format(context=_SENTINEL, input=inp)
    if marked.count(_SENTINEL) != 1:
        raise ValueError(f"the {task} template must contain {{context}} exactly once")
    prefix, suffix = marked.split(_SENTINEL)
    enc = tok(prompt, truncation=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    raw_tokens = len(ids)
    truncated = raw_tokens > window
    if truncated:
        half = window // 2
        prompt = tok.decode(ids[:half], skip_special_tokens=True) + tok.decode(ids[-half:], skip_special_tokens=True)
        ctx = _context_after_truncation(tok, prompt, prefix, suffix, context, ids, offsets, half)
    else:
        ctx = context
    if inp.strip():
        query, source = inp, "input"
    elif task in CODE_TASKS:
        lines = [ln for ln in ctx.split("\n") if ln.strip()]
        query, source = "\n".join(lines[-5:]), "code_tail"
    else:
        query = " ".join(template.replace("{context}", " ").replace("{input}", " ").split())
        source = "instruction"
    chat = use_chat and task not in NO_CHAT_TASKS and getattr(tok, "chat_template", None) is not None
    if chat:
        final = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                        add_generation_prompt=True)
        kwargs = {"add_special_tokens": False}
    else:
        final, kwargs = prompt, {}
    if ctx and ctx not in final:
        ctx = ""
    return PromptInfo(final, ctx, query, source, chat, truncated, raw_tokens, kwargs)


def parse_task_ints(spec: str | None, name: str, tasks: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    if not spec:
        return out
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise UsageError(f"{name}: expected TASK=N items, got {item!r}")
        t, v = item.split("=", 1)
        t = t.strip()
        if t not in ENGLISH_TASKS:
            raise UsageError(f"{name}: unknown task {t!r}; known: {ENGLISH_TASKS}")
        try:
            out[t] = int(v)
        except ValueError as e:
            raise UsageError(f"{name}: {item!r}: N must be an integer") from e
        if out[t] < 1:
            raise UsageError(f"{name}: {item!r}: N must be >= 1")
    return out


# ---------------------------------------------------------------------------------------------- records
def parts_dir(out_dir: str, task: str, method: str) -> str:
    return os.path.join(out_dir, "parts", task, method)


def merged_path(out_dir: str, task: str, method: str) -> str:
    return os.path.join(out_dir, "predictions", task, f"{method}.jsonl")


def read_records(out_dir: str, task: str, method: str) -> dict[str, dict]:
    """Finished records of (task, method): the merged file plus any per-process part files (first one wins)."""
    recs: dict[str, dict] = {}
    files = [merged_path(out_dir, task, method)] + sorted(glob.glob(os.path.join(parts_dir(out_dir, task, method),
                                                                                 "*.jsonl")))
    for f in files:
        if not os.path.isfile(f):
            continue
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill: that example is redone
                recs.setdefault(r["_id"], r)
    return recs


def merge_records(out_dir: str, task: str, method: str, order: list[str]) -> dict[str, dict]:
    """Merge the part files into ``predictions/<task>/<method>.jsonl`` (ordered like the data), then remove them.
    Existing records are kept as they are."""
    recs = read_records(out_dir, task, method)
    if not recs:
        return recs
    pos = {x: i for i, x in enumerate(order)}
    rows = sorted(recs.values(), key=lambda r: (pos.get(r["_id"], len(pos)), r["_id"]))
    path = merged_path(out_dir, task, method)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    for p in glob.glob(os.path.join(parts_dir(out_dir, task, method), "*.jsonl")):
        os.remove(p)
    for d in (parts_dir(out_dir, task, method), os.path.dirname(parts_dir(out_dir, task, method)),
              os.path.join(out_dir, "parts")):
        try:
            os.rmdir(d)  # only when empty
        except OSError:
            pass
    return recs


# ---------------------------------------------------------------------------------------------- summary
def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(out_dir: str, tasks: list[str], methods: list[str], order: dict[str, list[str]],
              rows_by_task: dict[str, list[dict]]) -> dict:
    """Score every (task, method) over its finished examples (rescored from the predictions); write scores.json,
    summary.csv/.md and plots."""
    table = []
    per = {}
    ex_scores: dict[tuple[str, str], dict[str, float]] = {}
    for task in tasks:
        for method in methods:
            recs = merge_records(out_dir, task, method, order[task])
            wanted = set(order[task])
            recs = {k: v for k, v in recs.items() if k in wanted}
            if not recs:
                continue
            # rescored from the stored predictions (as the official eval.py does): a metric fixed after a run
            # reaches its finished examples too; the record's own "score" is what the metric gave when it was written
            by_id = {k: example_score(task, r["pred"], r["answers"], r.get("all_classes")) for k, r in recs.items()}
            ex_scores[(task, method)] = by_id
            scores = list(by_id.values())
            n = len(recs)
            row = {"task": task, "method": method, "score": round(100 * sum(scores) / n, 2),
                   "kv_ratio": sum(r["kv_ratio"] for r in recs.values()) / n,
                   "prefill_s": sum(r["prefill_s"] for r in recs.values()) / n,
                   # examples that stopped after the first token (from the shared prefill) have no decode step
                   "decode_ms_per_token": _mean([r["decode_ms_per_token"] for r in recs.values()]),
                   "n": n, "n_expected": len(order[task])}
            mix = {"fp16": 0, "int4": 0, "int2": 0}
            for r in recs.values():
                for k in mix:
                    mix[k] += (r.get("precision_counts") or {}).get(k, 0)
            row["chunks"] = mix
            table.append(row)
            per[(task, method)] = row
    averages = []
    for method in methods:
        rows = [r for r in table if r["method"] == method]
        if not rows:
            continue
        k = len(rows)
        averages.append({"task": "average", "method": method,
                         "score": round(sum(r["score"] for r in rows) / k, 2),
                         "kv_ratio": sum(r["kv_ratio"] for r in rows) / k,
                         "prefill_s": sum(r["prefill_s"] for r in rows) / k,
                         "decode_ms_per_token": _mean([r["decode_ms_per_token"] for r in rows]),
                         "n": sum(r["n"] for r in rows), "tasks": k})
    paired = []
    if "fp16" in methods:
        for method in methods:
            if method == "fp16":
                continue
            res = paired_difference({t: ex_scores[(t, "fp16")] for t in tasks if (t, "fp16") in ex_scores},
                                    {t: ex_scores[(t, method)] for t in tasks if (t, method) in ex_scores})
            if res is not None:
                paired.append({"method": method, "reference": "fp16", **res})
    write_json(os.path.join(out_dir, "scores.json"), {"per_task": table, "average": averages, "paired_vs_fp16": paired})
    cols = ["task", "method", "score", "kv_ratio", "prefill_s", "decode_ms_per_token", "n"]
    with open(os.path.join(out_dir, "summary.csv"), "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in table + averages:
            dec = r["decode_ms_per_token"]
            w.writerow([r["task"], r["method"], f"{r['score']:.2f}", f"{r['kv_ratio']:.4f}", f"{r['prefill_s']:.3f}",
                        "" if dec is None else f"{dec:.1f}", r["n"]])
    _write_markdown(out_dir, tasks, methods, per, averages, table, paired)
    _plots(out_dir, tasks, methods, per, averages)
    return {"per_task": table, "average": averages, "paired_vs_fp16": paired}


def paired_difference(ref: dict[str, dict[str, float]], other: dict[str, dict[str, float]], n_boot: int = 2000,
                      seed: int = 0) -> dict | None:
    """Paired comparison of two methods on the examples both finished: the LongBench average (mean over tasks of
    the task's mean score, x100) of ``other`` minus ``ref``, with a 95% bootstrap interval (examples resampled with
    replacement within each task, ``n_boot`` times), and how many examples scored higher / the same / lower.

    ``ref`` / ``other``: task -> {example id: score in [0, 1]}. None when no task has a common example."""
    import random

    diffs = {}
    for task in ref:
        common = sorted(set(ref[task]) & set(other.get(task, {})))
        if common:
            diffs[task] = [other[task][x] - ref[task][x] for x in common]
    if not diffs:
        return None

    def avg(per_task):
        return 100 * sum(sum(d) / len(d) for d in per_task.values()) / len(per_task)

    rng = random.Random(seed)
    boots = sorted(avg({t: rng.choices(d, k=len(d)) for t, d in diffs.items()}) for _ in range(n_boot))
    flat = [x for d in diffs.values() for x in d]
    return {"diff": round(avg(diffs), 2), "ci95": [round(boots[int(0.025 * (n_boot - 1))], 2),
                                                  round(boots[int(0.975 * (n_boot - 1))], 2)],
            "better": sum(x > 0 for x in flat), "same": sum(x == 0 for x in flat), "worse": sum(x < 0 for x in flat),
            "examples": len(flat), "tasks": len(diffs)}


def _write_markdown(out_dir, tasks, methods, per, averages, table, paired=()):
    present = [m for m in methods if any(r["method"] == m for r in table)]
    lines = ["# LongBench results", "",
             "Score (LongBench metric x100, see eval/README.md), per task and method; `n` examples per task.", "",
             "| task | n | " + " | ".join(present) + " |", "|---|---|" + "---|" * len(present)]
    for task in tasks:
        if not any((task, m) in per for m in present):
            continue
        ns = {per[(task, m)]["n"] for m in present if (task, m) in per}
        cells = [f"{per[(task, m)]['score']:.2f}" if (task, m) in per else "-" for m in present]
        lines.append(f"| {task} | {'/'.join(str(n) for n in sorted(ns))} | " + " | ".join(cells) + " |")
    avg = {a["method"]: a for a in averages}
    lines.append("| **average** | | " + " | ".join(f"**{avg[m]['score']:.2f}**" for m in present) + " |")
    lines += ["", "| method | avg score | kv_ratio | prefill_s | decode ms/token | examples | tasks |",
              "|---|---|---|---|---|---|---|"]
    for m in present:
        a = avg[m]
        dec = "-" if a["decode_ms_per_token"] is None else f"{a['decode_ms_per_token']:.0f}"
        lines.append(f"| {m} | {a['score']:.2f} | {a['kv_ratio']:.3f} | {a['prefill_s']:.2f} | {dec} | {a['n']} | "
                     f"{a['tasks']} |")
    if paired:
        lines += ["", "Paired with fp16 on the same examples: difference of the LongBench average (points), 95% "
                  "bootstrap interval (examples resampled within tasks), examples scoring higher / the same / lower.",
                  "", "| method | avg - fp16 | 95% interval | higher / same / lower |", "|---|---|---|---|"]
        for p in paired:
            lines.append(f"| {p['method']} | {p['diff']:+.2f} | [{p['ci95'][0]:+.2f}, {p['ci95'][1]:+.2f}] | "
                         f"{p['better']} / {p['same']} / {p['worse']} |")
    incomplete = [r for r in table if r["n"] < r["n_expected"]]
    if incomplete:
        lines += ["", "Incomplete (task, method) pairs (run still going or interrupted): " +
                  ", ".join(f"{r['task']}/{r['method']} {r['n']}/{r['n_expected']}" for r in incomplete)]
    lines += ["", "kv_ratio: KV bytes of the method / bytes of an FP16 DynamicCache holding the same tokens (prompt + "
              "generated), measured at the end of generation; full-precision parts count 2 bytes per element. "
              "prefill_s: shared full-precision prefill + the method's own setup (search, quantization). "
              "decode ms/token: wall time of the greedy decode divided by its steps (new tokens - 1: the first "
              "token comes from the shared prefill)."]
    with open(os.path.join(out_dir, "summary.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _plots(out_dir, tasks, methods, per, averages):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for a in averages:
        ax.scatter(a["kv_ratio"], a["score"], s=60, zorder=3)
        ax.annotate(a["method"], (a["kv_ratio"], a["score"]), textcoords="offset points", xytext=(5, 5))
    ax.set_xlabel("KV bytes / FP16 KV bytes (mean over tasks)")
    ax.set_ylabel("LongBench average score")
    ax.set_title("Score vs KV-cache size")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "score_vs_kv.png"), dpi=120)
    plt.close(fig)

    mix_methods = [m for m in methods if any((t, m) in per and sum(per[(t, m)]["chunks"].values()) > 0
                                             and per[(t, m)]["chunks"]["fp16"] + per[(t, m)]["chunks"]["int2"]
                                             + per[(t, m)]["chunks"]["int4"] > 0 for t in tasks)]
    mix_methods = [m for m in mix_methods if m in ("cocktail",)] or mix_methods[:1]
    if not mix_methods:
        return
    m = mix_methods[0]
    ts = [t for t in tasks if (t, m) in per]
    fr = {k: [] for k in ("fp16", "int4", "int2")}
    for t in ts:
        c = per[(t, m)]["chunks"]
        tot = max(1, sum(c.values()))
        for k in fr:
            fr[k].append(c[k] / tot)
    fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(ts) + 1.2), 4.5))
    bottom = [0.0] * len(ts)
    for k, color in (("fp16", "#2b8cbe"), ("int4", "#7bccc4"), ("int2", "#f0f9e8")):
        ax.bar(ts, fr[k], bottom=bottom, label=k.upper(), color=color, edgecolor="black", linewidth=0.5)
        bottom = [b + v for b, v in zip(bottom, fr[k])]
    ax.set_ylabel("fraction of context chunks")
    ax.set_title(f"Precision mix per task ({m})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "precision_mix.png"), dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out-dir", required=True, help="results folder (resumable)")
    p.add_argument("--model", default="smollm2", help="'smollm2' (offline GGUF wheel) or a Hub id / local folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device-map", default=None, help="e.g. 'auto' to spread a big model over the devices")
    p.add_argument("--data-dir", default=os.path.join(DATA_DIR, "longbench", "minilongbench"),
                   help="folder of <task>.jsonl files in the LongBench schema")
    p.add_argument("--hub", action="store_true", help="read the data from THUDM/LongBench on the Hub instead")
    p.add_argument("--config-dir", default=os.path.join(DATA_DIR, "longbench", "config"),
                   help="folder with dataset2prompt.json and dataset2maxlen.json")
    p.add_argument("--tasks", default=",".join(ENGLISH_TASKS), help="comma-separated LongBench tasks")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated methods (see eval/methods.py)")
    p.add_argument("--window", type=int, default=2048, help="max prompt tokens (middle truncation)")
    p.add_argument("--limit", type=int, default=None, help="max examples per task (the first ones of each file)")
    p.add_argument("--task-limits", default=None, help="per-task caps, e.g. 'multi_news=3,qmsum=3'")
    p.add_argument("--max-new-tokens-cap", default=None,
                   help="per-task caps on the new tokens below dataset2maxlen, e.g. 'gov_report=128'")
    p.add_argument("--no-chat", action="store_true", help="never apply the chat template")
    p.add_argument("--encoder", default=None, help="retrieval encoder (default: the offline all-MiniLM-L6-v2)")
    p.add_argument("--preset", default=None,
                   help="a cocktail_config.json folder or Hub id (e.g. model_cards/smollm2-135m-instruct): adds the "
                        "method 'preset' (its encoder is replaced by --encoder / the offline MiniLM)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (default: cores/processes)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.window < 64:
        raise UsageError(f"--window must be >= 64, got {args.window}")
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    args.task_list = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not args.task_list:
        raise UsageError("--tasks is empty")
    for t in args.task_list:
        try:
            metric_for(t)
        except ValueError as e:
            raise UsageError(str(e)) from e
    from eval.methods import parse_methods, register_preset

    if args.preset:
        register_preset(args.preset)
    args.method_list = parse_methods(args.methods)
    args.task_limit_map = parse_task_ints(args.task_limits, "--task-limits", args.task_list)
    args.new_cap_map = parse_task_ints(args.max_new_tokens_cap, "--max-new-tokens-cap", args.task_list)
    if not args.hub and not os.path.isdir(args.data_dir):
        raise UsageError(f"--data-dir {args.data_dir} does not exist (the offline data lives in ../shared/data; "
                         "or pass --hub when the Hugging Face Hub is reachable)")
    return args


def lock_out_dir(out_dir: str):
    """An exclusive lock on ``out_dir/.lock`` for this run (released when the returned file is closed or the process
    exits): a second run into the same folder would append to the same part files and merge them away under the
    first one. POSIX only; elsewhere nothing is locked."""
    try:
        import fcntl
    except ImportError:
        return None
    f = open(os.path.join(out_dir, ".lock"), "w")  # noqa: SIM115 (kept open: the lock lives as long as the file)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise UsageError(f"another run is using --out-dir {out_dir} (it holds {out_dir}/.lock); wait for it to "
                         "finish or use another --out-dir") from None
    return f


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    commit = git_commit(exclude=args.out_dir)  # the code that runs (read now: a commit made mid-run is not it)
    started_at = datetime.datetime.now().isoformat(timespec="seconds")
    from accelerate import PartialState

    import torch

    use_cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    state = PartialState(cpu=use_cpu, timeout=datetime.timedelta(hours=48))
    if (state.num_processes == 1 and os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true"
            and os.environ.get("MASTER_ADDR") and "WORLD_SIZE" not in os.environ):
        print("warning: `accelerate launch --cpu --num_processes N` started ONE process (accelerate starts several "
              "CPU processes only through MPI); running single-process. For N CPU processes use "
              "`accelerate launch --multi_gpu --num_processes N eval/longbench.py ...` (torchrun underneath; the "
              "processes use gloo on a CPU-only machine) or `torchrun --nproc_per_node N eval/longbench.py ...`.",
              file=sys.stderr)
    set_threads(state.num_processes, args.threads)
    from tqdm.auto import tqdm

    from eval.methods import branch, generate_from_branch, prefill
    from hf_cocktail import offline_encoder_path

    methods = args.method_list
    encoder = args.encoder or offline_encoder_path()
    d2p, d2m = load_config(args.config_dir)
    for t in args.task_list:
        if t not in d2p or t not in d2m:
            raise UsageError(f"task {t!r} has no prompt/maxlen in {args.config_dir}")
    rows_by_task, ids_by_task = {}, {}
    for t in args.task_list:
        rows = load_task_rows(t, args.data_dir, args.hub)
        cap = args.task_limit_map.get(t, args.limit)
        rows = rows[:cap] if cap else rows
        rows_by_task[t], ids_by_task[t] = rows, example_ids(rows)
    max_new = {t: min(d2m[t], args.new_cap_map.get(t, d2m[t])) for t in args.task_list}
    settings = {"model": args.model, "dtype": args.dtype, "window": args.window, "chat": not args.no_chat,
                "encoder": os.path.basename(os.path.normpath(encoder)), "max_new_tokens_cap": args.new_cap_map}
    os.makedirs(args.out_dir, exist_ok=True)
    if state.is_main_process:
        lock = lock_out_dir(args.out_dir)  # noqa: F841 (held until the process exits)
        check_settings(args.out_dir, settings, SETTINGS_KEYS)
        _update_run_info(args.out_dir, started_at, {"command": command_line(), "commit": commit,
                                                    "num_processes": state.num_processes, "status": "running"})
    state.wait_for_everyone()
    if not state.is_main_process:
        check_settings(args.out_dir, settings, SETTINGS_KEYS)

    # what is left to do: (task, example index) -> missing methods
    done = {(t, m.name): set(read_records(args.out_dir, t, m.name)) for t in args.task_list for m in methods}
    work = []
    for t in args.task_list:
        for i, x in enumerate(ids_by_task[t]):
            missing = [m for m in methods if x not in done[(t, m.name)]]
            if missing:
                work.append((t, i, missing))
    shard = work[state.process_index::state.num_processes]
    state.wait_for_everyone()  # every process has read the finished records before any writes new ones

    if shard:
        from eval.common import load_model_and_tokenizer

        model, tok = load_model_and_tokenizer(args.model, args.dtype, "cocktail", args.device_map)
        dev = model_input_device(model)
        eos = model.generation_config.eos_token_id
        eos = list(eos) if isinstance(eos, (list, tuple)) else [eos if eos is not None else tok.eos_token_id]
        newline_id = tok.encode("\n", add_special_tokens=False)[-1]
        _warm_up(model, tok, [m for m in methods if any(m in miss for _, _, miss in shard)], encoder, dev)
        bar = tqdm(shard, desc=f"longbench[{state.process_index}]", position=state.process_index,
                   disable=args.no_progress, dynamic_ncols=True)
        for t, i, missing in bar:
            ex, ex_id = rows_by_task[t][i], ids_by_task[t][i]
            bar.set_postfix_str(f"{t} {i + 1}/{len(rows_by_task[t])}")
            info = build_prompt(tok, t, ex, d2p[t], args.window, use_chat=not args.no_chat)
            input_ids = tok(info.prompt, return_tensors="pt", **info.tokenizer_kwargs)["input_ids"].to(dev)
            t0 = time.perf_counter()
            dyn, first_logits = prefill(model, input_ids)
            shared_prefill_s = time.perf_counter() - t0
            stop = eos + [newline_id] if t == "samsum" else eos
            for m in missing:
                br = branch(m, model, tok, dyn, input_ids, info.prompt, info.context, info.query, ex_id,
                            info.tokenizer_kwargs, encoder)
                t1 = time.perf_counter()
                new = generate_from_branch(model, br.cache, input_ids, first_logits, max_new[t], eos_token_id=stop,
                                           min_new_tokens=1 if t == "samsum" else 0)
                decode_s = time.perf_counter() - t1
                n_new = int(new.shape[1])
                pred = tok.decode(new[0], skip_special_tokens=True)
                seq = int(br.cache.get_seq_length())
                kv = cache_kv_bytes(br.cache)
                fp16 = fp16_kv_bytes(model.config, seq)
                rec = {"_id": ex_id, "task": t, "method": m.name, "pred": pred, "answers": ex["answers"],
                       "all_classes": ex.get("all_classes"),
                       "score": example_score(t, pred, ex["answers"], ex.get("all_classes")),
                       "length": ex.get("length"), "prompt_tokens": int(input_ids.shape[1]),
                       "raw_prompt_tokens": info.raw_tokens, "truncated": info.truncated, "chat": info.chat,
                       "context_found": bool(info.context), "query_source": info.query_source,
                       "new_tokens": n_new, "cache_tokens": seq, "kv_bytes": kv, "fp16_kv_bytes": fp16,
                       "kv_ratio": kv / fp16, "prefill_s": shared_prefill_s + br.setup_s,
                       "shared_prefill_s": shared_prefill_s, "setup_s": br.setup_s, "decode_s": decode_s,
                       # the first new token comes from the shared prefill: n_new - 1 decode steps
                       "decode_ms_per_token": 1000 * decode_s / (n_new - 1) if n_new > 1 else None,
                       "precision_counts": br.precision_counts, "process": state.process_index,
                       "written_at": datetime.datetime.now().isoformat(timespec="seconds")}
                pdir = parts_dir(args.out_dir, t, m.name)
                os.makedirs(pdir, exist_ok=True)
                append_jsonl(os.path.join(pdir, f"rank{state.process_index}.jsonl"), rec)
                del br
            del dyn
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        bar.close()
    state.wait_for_everyone()
    if state.is_main_process:
        summary = summarize(args.out_dir, args.task_list, [m.name for m in methods], ids_by_task, rows_by_task)
        _update_run_info(args.out_dir, started_at,
                         {"runtime_s": round(time.time() - t_start, 1), "examples_processed": len(work),
                          "finished_at": datetime.datetime.now().isoformat(timespec="seconds"),
                          "status": "finished"}, _run_config(args, methods, encoder, max_new))
        if not args.no_progress:
            print(open(os.path.join(args.out_dir, "summary.md"), encoding="utf-8").read())
        del summary
    state.wait_for_everyone()
    return 0


def _warm_up(model, tok, methods, encoder, dev) -> None:
    """Run every method once on a short prompt, untimed: first-call costs (encoder loading, optimum-quanto's
    extension) would otherwise land in the first example's timings."""
    from eval.methods import branch, generate_from_branch, prefill

    ctx = "The quick brown fox jumps over the lazy dog. " * 12
    prompt = ctx + "\nQuestion: what jumps?"
    ids = tok(prompt, return_tensors="pt")["input_ids"].to(dev)
    dyn, logits = prefill(model, ids)
    for m in methods:
        br = branch(m, model, tok, dyn, ids, prompt, ctx, "what jumps?", "warmup", {}, encoder)
        generate_from_branch(model, br.cache, ids, logits, 3)


def _update_run_info(out_dir: str, started_at: str, invocation: dict, config: dict | None = None) -> None:
    """Record this invocation in ``run_info.json`` (main process only): written when the run starts (``status``
    "running", so a killed run still leaves its command and commit) and updated when it finishes (runtime). Top
    level: ``command`` / ``commit`` of the first invocation, ``runtime_s`` of all finished ones together,
    ``config`` the union over invocations of the methods' configs."""
    path = os.path.join(out_dir, "run_info.json")
    old = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    invocations = [x for x in old.get("invocations", []) if x.get("started_at") != started_at]
    mine = next((x for x in old.get("invocations", []) if x.get("started_at") == started_at), {})
    invocations.append({**mine, **invocation, "started_at": started_at})
    info = {"command": invocations[0]["command"], "commit": invocations[0]["commit"],
            "runtime_s": round(sum(x.get("runtime_s") or 0 for x in invocations), 1),
            "unfinished_invocations": sum(1 for x in invocations if x.get("status") == "running"),
            "hardware": old.get("hardware") or hardware_info(),
            "config": old.get("config") or {},
            "invocations": invocations}
    if config:
        methods = {**info["config"].get("methods", {}), **config["methods"]}
        info["config"] = {**config, "methods": methods}
    write_json(path, info)


def _run_config(args, methods, encoder, max_new) -> dict:
    return {"methods": {m.name: m.config_dict(encoder) for m in methods},
            "args": {k: v for k, v in vars(args).items() if k != "method_list"}, "max_new_tokens": max_new}


if __name__ == "__main__":
    from eval.common import run_cli  # noqa: E402

    run_cli(main)
