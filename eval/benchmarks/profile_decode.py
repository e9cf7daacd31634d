"""Where a decode step's time goes, per method: ``torch.profiler`` over a few decode steps at a long context.

Every method's cache is branched from one shared full-precision prefill (``eval.benchmarks.rounds``), warmed up by
``--warmup`` decode steps, then ``--steps`` decode steps (one ``model.generate`` continuing the cache) run under the
profiler, ``--profile-rounds`` times in alternating order (the median per category is reported). The model's and the
caches' functions are wrapped in ``record_function`` labels (for the run only, ``eval/benchmarks/instrument.py``;
nothing in the library changes), and each label's *exclusive* time (its wall time minus that of the labels nested in
it) is one category:

* ``attention kernel``: the attention itself: SDPA (``DynamicCache``, ``QuantizedCache``), the fused ``cpu_ops``
  C++ kernel, or the PyTorch dequantize-then-attend path (``backend="torch"``);
* ``attention glue``: the ``"cocktail"`` attention function and the backend dispatch around the kernel (layer lookup,
  kernel arguments, the ``cpu_ops`` launcher's Python checks);
* ``rotation``: ``Rotation._apply`` (rotated storage: query in, output back, new keys/values);
* ``cache update``: ``Cache.update`` (DynamicCache's ``torch.cat`` of the whole cache, Cocktail's append into the
  full-precision buffers, QuantizedCache's residual and its dequantization of the whole cache);
* ``q/k/v/o + rope``, ``MLP``, ``norms + residual`` (exclusive time of the attention module, the MLP module and the
  decoder layer), ``embed, mask, lm_head`` (the model's forward outside its layers), ``generate loop`` (what
  ``generate`` does around the forwards: logits processing, stopping criteria, input preparation).

Each category's time is also split into time inside ATen operators (and the fused C++ kernel) and the rest
(Python and dispatch: the "Python overhead"). Times are per decode step (ms) and per layer per step (µs); the
profiler itself adds overhead (mostly to the Python share), so an unprofiled time per step measured in alternating
rounds is reported beside.

    python -m eval.benchmarks.profile_decode --context 8000 --dtypes float32,bfloat16 \\
        --methods fp16,cocktail,cocktail:torch --threads 2 --out eval/results/decode_profile/smollm2_8k.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ..cli import UsageError, parse_int_list, run_cli
from ..methods.registry import register_preset
from ..models import DTYPES, load_model_and_tokenizer, set_threads
from ..reporting import METHOD_COLUMNS, METHOD_RULE, method_cells
from ..run_info import command_line
from .harness import PRESET_HELP, note_start, write_run_json
from .instrument import patching
from .rounds import (
    alternating_rounds,
    branch_runner,
    cast_prefill,
    resolve_methods,
    shared_prefill,
    summarize_rounds,
)

MODULE = "eval.benchmarks.profile_decode"
P = "ck/"
CATEGORIES = {  # label -> category (table order)
    "attn_kernel": "attention kernel",
    "cpu_kernel": "attention kernel",
    "attn_glue": "attention glue",
    "launcher": "attention glue",
    "rotation": "rotation",
    "cache_update": "cache update",
    "self_attn": "q/k/v/o + rope",
    "mlp": "MLP",
    "decoder_layer": "norms + residual",
    "forward": "embed, mask, lm_head",
    "total": "generate loop",
}
ORDER = list(dict.fromkeys(CATEGORIES.values()))


def _labelled(label: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(P + label):
            return fn(*args, **kwargs)

    wrapper.__wrapped_by_profile_decode__ = True
    return wrapper


@contextlib.contextmanager
def instrumented():
    """Wrap the functions of interest in ``record_function`` labels for the duration of the block."""
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama import modeling_llama as ml

    import cpu_ops.attention as cpu_attention
    import hf_cocktail.integration.attention as hattn
    from hf_cocktail import CocktailCache
    from hf_cocktail.decode.split_attention import attend_in_store_basis
    from hf_cocktail.storage.rotation import Rotation

    class _Ext:  # the C++ extension module, its entry point labelled
        def __init__(self, ext):
            self._ext = ext
            self.split_attention = _labelled("cpu_kernel", ext.split_attention)

        def __getattr__(self, name):
            return getattr(self._ext, name)

    real_extension = cpu_attention.extension
    proxies: dict[int, _Ext] = {}

    def extension():
        real = real_extension()
        return proxies.setdefault(id(real), _Ext(real))

    label = lambda name: lambda fn: _labelled(name, fn)  # noqa: E731
    attn_fn = AttentionInterface._global_mapping[hattn.ATTN_NAME]
    with patching() as p:
        p.attribute(cpu_attention, "extension", extension)
        p.function(cpu_attention.split_precision_attention, label("launcher"))
        p.function(cpu_attention.split_precision_attention_prepared, label("launcher"))  # the dispatch's entry
        p.function(sdpa_attention_forward, label("attn_kernel"))
        p.function(attend_in_store_basis, label("attn_kernel"))
        p.method(Rotation, "_apply", label("rotation"))
        p.method(Cache, "update", label("cache_update"))
        p.method(CocktailCache, "update", label("cache_update"))
        p.method(ml.LlamaAttention, "forward", label("self_attn"))
        p.method(ml.LlamaMLP, "forward", label("mlp"))
        p.method(ml.LlamaDecoderLayer, "forward", label("decoder_layer"))
        p.method(ml.LlamaForCausalLM, "forward", label("forward"))
        AttentionInterface.register(hattn.ATTN_NAME, _labelled("attn_glue", attn_fn))
        try:
            yield
        finally:
            AttentionInterface.register(hattn.ATTN_NAME, attn_fn)


def _is_label(ev) -> bool:
    return ev.name.startswith(P)


def _dur(ev) -> float:
    return ev.time_range.end - ev.time_range.start


def _exclusive(ev) -> tuple[float, float]:
    """(wall, inside ATen ops) of a labelled event, excluding the labelled events nested in it."""
    wall, ops = _dur(ev), 0.0
    stack = list(ev.cpu_children)
    while stack:
        c = stack.pop()
        if _is_label(c):
            wall -= _dur(c)
        else:
            ops += _dur(c)  # an operator: its nested operators are inside it; it runs no labelled Python
    return wall, ops


def breakdown(prof, steps: int, num_layers: int) -> dict:
    """Per category: ms per decode step (wall and inside ATen ops), µs per layer per step."""
    wall: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = defaultdict(float)
    total = 0.0
    for ev in prof.events():
        if not _is_label(ev):
            continue
        label = ev.name[len(P) :]
        w, o = _exclusive(ev)
        if label == "cpu_kernel":
            o = w  # the fused C++ kernel: native code, not Python (the profiler sees no ATen operator in it)
        cat = CATEGORIES[label]
        wall[cat] += w
        ops[cat] += o
        if label == "total":
            total += _dur(ev)
    rows = {}
    for cat in ORDER:
        rows[cat] = {
            "ms_per_step": wall[cat] / 1000 / steps,
            "ops_ms_per_step": ops[cat] / 1000 / steps,
            "us_per_layer": wall[cat] / steps / num_layers,
        }
    return {
        "total_ms_per_step": total / 1000 / steps,
        "categories": rows,
        "python_ms_per_step": sum(max(0.0, wall[c] - ops[c]) for c in ORDER) / 1000 / steps,
    }


def median_breakdown(items: list[dict]) -> dict:
    """The per-category median over several profiled rounds of one method."""
    med = lambda xs: statistics.median(xs)  # noqa: E731
    return {
        "total_ms_per_step": med([b["total_ms_per_step"] for b in items]),
        "python_ms_per_step": med([b["python_ms_per_step"] for b in items]),
        "categories": {
            c: {k: med([b["categories"][c][k] for b in items]) for k in items[0]["categories"][c]} for c in ORDER
        },
    }


def profile_runner(runner, model, steps: int, pad_token_id) -> dict:
    with instrumented(), profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(P + "total"):
            runner.decode(model, steps, pad_token_id)
    return breakdown(prof, steps, model.config.num_hidden_layers)


def table(results: list[dict]) -> str:
    cats = ORDER
    head = (
        f"| dtype | {METHOD_COLUMNS} | unprofiled ms/step | ratio vs fp16 | profiled ms/step | "
        + " | ".join(cats)
        + " | Python/dispatch (not in ATen) |"
    )
    lines = [head, f"|---|{METHOD_RULE}|" + "---|" * (3 + len(cats) + 1)]
    for r in results:
        b = r["breakdown"]
        cells = [f"{b['categories'][c]['ms_per_step']:.1f}" for c in cats]
        lines.append(
            f"| {r['dtype']} | {method_cells(r['method'])} | {r['unprofiled_ms_per_step']:.1f} | "
            f"{r.get('unprofiled_ratio', float('nan')):.2f} | {b['total_ms_per_step']:.1f} | "
            + " | ".join(cells)
            + f" | {b['python_ms_per_step']:.1f} |"
        )
    per_layer = [
        "",
        "Per layer per step (µs; the same run, layer categories only):",
        "",
        f"| dtype | {METHOD_COLUMNS} | " + " | ".join(cats[:7]) + " |",
        f"|---|{METHOD_RULE}|" + "---|" * 7,
    ]
    for r in results:
        b = r["breakdown"]
        per_layer.append(
            f"| {r['dtype']} | {method_cells(r['method'])} | "
            + " | ".join(f"{b['categories'][c]['us_per_layer']:.0f}" for c in cats[:7])
            + " |"
        )
    return "\n".join(lines + per_layer)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog=f"python -m {MODULE}",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--context", default="8000", help="context lengths in tokens (comma-separated)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--methods", default="fp16,cocktail,cocktail:torch")
    p.add_argument("--preset", default=None, help=PRESET_HELP)
    p.add_argument("--steps", type=int, default=8, help="profiled decode steps per method")
    p.add_argument(
        "--profile-rounds",
        type=int,
        default=2,
        help="profiled rounds of --steps per method (alternating order); the median per category",
    )
    p.add_argument("--warmup", type=int, default=2, help="unprofiled decode steps per method first")
    p.add_argument("--rounds", type=int, default=3, help="unprofiled alternating rounds (of --steps) per method")
    p.add_argument(
        "--prefill-dtype",
        default=None,
        choices=list(DTYPES),
        help="run the shared prefill in this dtype and cast its keys/values to each --dtypes (bfloat16 "
        "prefill is very slow on some CPUs; decode time does not depend on the values)",
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--essay-dir", default=None)
    p.add_argument("--out", default=None, help="JSON results (and a .md table next to it)")
    args = p.parse_args(argv)
    note_start(args.out)
    args.context_list = parse_int_list(args.context, "--context")
    args.dtype_list = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtype_list if d not in DTYPES]
    if bad or not args.dtype_list:
        raise UsageError(f"--dtypes must be among {DTYPES}, got {args.dtypes!r}")
    if args.preset:
        register_preset(args.preset)
    args.method_list = resolve_methods(args.methods)
    if args.method_list[0].name != "fp16":
        args.method_list = resolve_methods("fp16") + [m for m in args.method_list if m.name != "fp16"]
    if min(args.steps, args.warmup, args.rounds, args.profile_rounds) < 1:
        raise UsageError("--steps, --warmup, --rounds and --profile-rounds must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    set_threads(1, args.threads)
    results = []
    prefill_model = None
    if args.prefill_dtype:
        prefill_model, _ = load_model_and_tokenizer(args.model, args.prefill_dtype, "cocktail")
    for dtype in args.dtype_list:
        model, tok = load_model_and_tokenizer(args.model, dtype, "cocktail")
        for ctx in args.context_list:
            if prefill_model is None or args.prefill_dtype == dtype:
                shared = shared_prefill(model, tok, ctx, args.essay_dir, args.method_list)
            else:
                shared = cast_prefill(
                    shared_prefill(prefill_model, tok, ctx, args.essay_dir, args.method_list), getattr(torch, dtype)
                )
            print(
                f"{dtype} context {ctx}: prompt {shared.prompt_tokens} tokens, prefill {shared.prefill_s:.1f} s",
                flush=True,
            )
            runners = [branch_runner(m, model, tok, shared) for m in args.method_list]
            prompt_tokens = shared.prompt_tokens
            del shared
            for r in runners:
                r.decode(model, args.warmup, tok.eos_token_id)
            alternating_rounds(runners, model, args.rounds, args.steps, tok.eos_token_id)
            timing = {s["method"]: s for s in summarize_rounds(runners, args.steps)}
            profiles: dict[str, list[dict]] = {r.method.name: [] for r in runners}
            for k in range(args.profile_rounds):  # alternating order, as the timing rounds
                for r in runners if k % 2 == 0 else runners[::-1]:
                    profiles[r.method.name].append(profile_runner(r, model, args.steps, tok.eos_token_id))
            for r in runners:
                t = timing[r.method.name]
                res = {
                    "dtype": dtype,
                    "context_tokens": ctx,
                    "prompt_tokens": prompt_tokens,
                    "prefill_dtype": args.prefill_dtype or dtype,
                    "method": r.method.name,
                    "unprofiled_ms_per_step": t["decode_ms_per_token"],
                    "unprofiled_ratio": t.get("decode_ratio"),
                    "unprofiled_rounds_ms": t["decode_ms_per_token_rounds"],
                    "breakdown": median_breakdown(profiles[r.method.name]),
                    "profile_rounds": profiles[r.method.name],
                }
                results.append(res)
                print(
                    f"  {r.method.name}: {res['unprofiled_ms_per_step']:.1f} ms/step unprofiled, "
                    f"{res['breakdown']['total_ms_per_step']:.1f} profiled",
                    flush=True,
                )
            del runners
        del model
    out = table(results)
    print(out)
    if args.out:
        write_run_json(args.out, MODULE, {"steps": args.steps, "results": results})
        with open(os.path.splitext(args.out)[0] + ".md", "w", encoding="utf-8") as f:
            f.write(f"# Decode-step profile\n\n`{command_line(MODULE)}`\n\n{out}\n")
    return 0


if __name__ == "__main__":
    run_cli(main)
