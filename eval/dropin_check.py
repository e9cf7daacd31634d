"""The drop-in check of issue 44 on a tiny random Llama (head dim 64), from a fresh state, CPU, a minute or two:

1. plain ``generate`` (tokenizer output straight in, no ``prepare_inputs``) runs with ``CocktailConfig.recommended()``;
2. uniform 16-bit equals ``DynamicCache`` token for token (fp32, 512-token prompt, 64 new tokens);
3. bf16: a 512-token prompt + 1,536 generated tokens under ``recommended()`` ends at ``ratio_to_fp16`` <= 0.40, and
   a second turn on the same cache (512 new user tokens + 38 generated, ~550) keeps it <= 0.45.

    python -m eval.dropin_check                     # writes eval/results/dropin/{report.md,dropin.json,ratio.png}
    python -m eval.dropin_check --out-dir /tmp/x    # elsewhere; --prompt, --generated, --turn2-user,
                                                    # --turn2-generated change the sizes (the bars are for the defaults)

The ratio is read every 64 generated tokens (a logits processor calls ``memory_report()``) and drawn against the
tokens held. Exits 1 when a bar is missed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tqdm import tqdm
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, LogitsProcessor

import hf_cocktail  # noqa: F401  (registers attn_implementation="cocktail")
from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.integration.compat import cache_kwargs

from .paths import REPO_ROOT
from .records import write_json
from .reporting import pyplot, save_figure
from .run_info import git_commit, hardware_info, now

OUT_DIR = os.path.join(REPO_ROOT, "eval", "results", "dropin")
VOCAB = 512
SIZES = {"prompt": 512, "generated": 1536, "turn2_user": 512, "turn2_generated": 38}
BARS = {"turn1": 0.40, "turn2": 0.45}


def tiny_llama(dtype: torch.dtype) -> LlamaForCausalLM:
    """A random Llama with head dim 64 (4 query heads, 2 key/value heads, 2 layers), seeded."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
        attn_implementation="cocktail",
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def token_ids(n: int, seed: int) -> torch.Tensor:
    """``(1, n)`` random ids (what a tokenizer's output holds), BOS first when ``seed`` is 0."""
    ids = torch.randint(2, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))
    if seed == 0:
        ids[0, 0] = 1
    return ids


class RatioProbe(LogitsProcessor):
    """Reads the cache's ``ratio_to_fp16`` every ``every`` steps (and ticks a progress bar)."""

    def __init__(self, cache: CocktailCache, every: int, bar: tqdm, turn: str, points: list):
        self.cache, self.every, self.bar, self.turn, self.points, self.step = cache, every, bar, turn, points, 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.step += 1
        self.bar.update(1)
        if self.step % self.every == 0:
            rep = self.cache.memory_report()
            self.points.append(
                {"turn": self.turn, "tokens": self.cache.get_seq_length(), "ratio": rep["ratio_to_fp16"]}
            )
        return scores


def generate(model, ids: torch.Tensor, cache, new: int, processors=None, **kw):
    """Greedy ``generate`` of exactly ``new`` tokens continuing ``ids`` (1, L) with ``cache``."""
    kw.update(max_new_tokens=new, min_new_tokens=new, do_sample=False, logits_processor=processors or [])
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache), **kw)


def check_dynamic_equality(prompt: int) -> dict:
    """Uniform 16-bit against DynamicCache, fp32, plain generate: the tokens and the largest logit difference."""
    model = tiny_llama(torch.float32)
    ids = token_ids(prompt, 0)
    outs = {}
    for name, cache in (("cocktail16", CocktailCache(CocktailConfig(uniform_bits=16))), ("dynamic", DynamicCache())):
        outs[name] = generate(model, ids, cache, 64, output_logits=True, return_dict_in_generate=True)
    a, b = outs["cocktail16"], outs["dynamic"]
    diff = (torch.stack(a.logits) - torch.stack(b.logits)).abs().max().item()
    return {"tokens_equal": bool(torch.equal(a.sequences, b.sequences)), "max_logit_diff": diff, "new_tokens": 64}


def check_long_generation(sizes: dict) -> tuple[dict, list]:
    """bf16, recommended(): the prompt, the generated tokens, a second turn on the same cache."""
    model = tiny_llama(torch.bfloat16)
    cache = CocktailCache(CocktailConfig.recommended())
    points: list = []
    n1, n2 = sizes["generated"], sizes["turn2_generated"]
    with tqdm(total=n1 + n2, desc="generating", unit="tok") as bar:
        t0 = time.perf_counter()
        out = generate(model, token_ids(sizes["prompt"], 0), cache, n1, [RatioProbe(cache, 64, bar, "turn 1", points)])
        turn1 = {"tokens": cache.get_seq_length(), **_report(cache), "seconds": time.perf_counter() - t0}
        ids2 = torch.cat([out, token_ids(sizes["turn2_user"], 1)], dim=1)
        t0 = time.perf_counter()
        out2 = generate(model, ids2, cache, n2, [RatioProbe(cache, 8, bar, "turn 2", points)])
        turn2 = {"tokens": cache.get_seq_length(), **_report(cache), "seconds": time.perf_counter() - t0}
    plan = cache.plans[0]
    return {
        "prompt_context": [plan.ctx_start, plan.ctx_end],
        "turn1": turn1,
        "turn2": {**turn2, "turn_tokens": out2.shape[1] - out.shape[1]},
    }, points


def _report(cache: CocktailCache) -> dict:
    rep = cache.memory_report()
    layer = cache.layers[0].store
    return {
        "ratio_to_fp16": rep["ratio_to_fp16"],
        "packed_tokens_layer0": sum(seg.num_tokens for seg in layer.segments),
        "full_tokens_layer0": layer.full.shape[2] if hasattr(layer.full, "shape") else None,
        "value_group_sizes": rep["value_group_sizes"],
    }


def draw(points: list, path: str) -> None:
    fig, ax = pyplot().subplots(figsize=(6, 3.5))
    for turn, marker in (("turn 1", "o"), ("turn 2", "s")):
        xs = [p["tokens"] for p in points if p["turn"] == turn]
        ax.plot(xs, [p["ratio"] for p in points if p["turn"] == turn], marker=marker, ms=3, label=turn)
    for bar, style in ((BARS["turn1"], ":"), (BARS["turn2"], "--")):
        ax.axhline(bar, color="grey", ls=style, lw=0.8)
    ax.set_xlabel("tokens held")
    ax.set_ylabel("ratio_to_fp16")
    ax.set_title("recommended(), plain generate, tiny Llama (bf16, head dim 64)")
    ax.legend()
    save_figure(fig, path)


def report_md(result: dict) -> str:
    eq, long, sizes = result["dynamic_equality"], result["long_generation"], result["sizes"]
    t1, t2 = long["turn1"], long["turn2"]
    lines = [
        "# Drop-in check (issue 44)",
        "",
        f"`{result['command'].strip()}` at {result['commit']} ({result['date']}); tiny random Llama, head dim 64, CPU.",
        "",
        "| check | measured | bar | passed |",
        "| --- | --- | --- | --- |",
        f"| plain generate, recommended() | runs, prompt context {long['prompt_context']} | runs | yes |",
        f"| uniform 16-bit vs DynamicCache (fp32, 64 new tokens) | tokens equal: {eq['tokens_equal']}, max logit "
        f"difference {eq['max_logit_diff']:.2e} | equal | {_yes(eq['tokens_equal'])} |",
        f"| bf16, {sizes['prompt']}-token prompt + {sizes['generated']} generated | "
        f"ratio_to_fp16 {t1['ratio_to_fp16']:.3f} "
        f"({t1['tokens']} tokens; layer 0: {t1['packed_tokens_layer0']} packed) | <= {BARS['turn1']} | "
        f"{_yes(t1['ratio_to_fp16'] <= BARS['turn1'])} |",
        f"| second turn, {t2['turn_tokens']} tokens ({sizes['turn2_user']} user + {sizes['turn2_generated']} "
        "generated) | "
        f"ratio_to_fp16 {t2['ratio_to_fp16']:.3f} ({t2['tokens']} tokens; layer 0: {t2['packed_tokens_layer0']} "
        f"packed) | <= {BARS['turn2']} | {_yes(t2['ratio_to_fp16'] <= BARS['turn2'])} |",
        "",
        f"Value group sizes used: {t1['value_group_sizes']}. Generation took {t1['seconds']:.1f} s (turn 1) and "
        f"{t2['seconds']:.1f} s (turn 2) on {result['hardware'].get('cpu_model', 'this CPU')}.",
        "",
        "`ratio.png`: ratio_to_fp16 against the tokens held, read every 64 generated tokens (every 8 in turn 2).",
        "",
    ]
    return "\n".join(lines)


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=OUT_DIR)
    for name, n in SIZES.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=n)
    args = ap.parse_args(argv)
    sizes = {name: getattr(args, name) for name in SIZES}
    torch.set_num_threads(1)
    os.makedirs(args.out_dir, exist_ok=True)
    equality = check_dynamic_equality(sizes["prompt"])
    long, points = check_long_generation(sizes)
    result = {
        "command": "python -m eval.dropin_check " + " ".join(argv if argv is not None else sys.argv[1:]),
        "sizes": sizes,
        "date": now(),
        "commit": git_commit(),
        "hardware": hardware_info(),
        "dynamic_equality": equality,
        "long_generation": long,
        "ratio_points": points,
    }
    write_json(os.path.join(args.out_dir, "dropin.json"), result)
    draw(points, os.path.join(args.out_dir, "ratio.png"))
    with open(os.path.join(args.out_dir, "report.md"), "w") as f:
        f.write(report_md(result))
    print(report_md(result))
    t1, t2 = long["turn1"]["ratio_to_fp16"], long["turn2"]["ratio_to_fp16"]
    return 0 if equality["tokens_equal"] and t1 <= BARS["turn1"] and t2 <= BARS["turn2"] else 1


if __name__ == "__main__":
    sys.exit(main())
