"""End-to-end decode latency on a randomly initialised Llama-3-8B-shaped model: ``model.generate`` with each cache
(``DynamicCache``, Cocktail with the paper's typical precision mix, uniform INT4 / INT2, transformers'
``QuantizedCache`` with hqq when installed), time to the first token and time per later token.

Random weights make the decode time meaningful without weights to ship (the GPU machine reaches no Hub): the work
per token does not depend on the values. Prompts are random words of a synthetic word-level tokenizer; the Cocktail
cache gets the mix of ``bench_kernels`` (10% FP16 / 30% INT4 / 60% INT2 of the context chunks, random chunks) through
``set_precisions``, so no retrieval encoder is needed.

    python -m eval.benchmarks.bench_decode_random --out decode.csv             # GPU: Llama-3-8B shape, fp16
    python -m eval.benchmarks.bench_decode_random --smoke --out /tmp/decode.csv  # a tiny Llama on CPU
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

import hf_cocktail  # noqa: F401  (registers attn_implementation="cocktail")

from ..cli import parse_int_list
from ..methods.kinds import CocktailMethod, Method, Request
from ..methods.registry import METHODS
from ..reporting import write_dict_csv
from . import harness

LLAMA3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
}
TINY_LLAMA = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
}
PAPER_MIX = (0.1, 0.3, 0.6)  # FP16 / INT4 / INT2 shares of the context chunks
WORDS = 32000  # synthetic vocabulary (at most the model's vocab_size)
QUESTION = "w11 w12 w13 w14 w15 w16 w17 w18"
COLUMNS = [
    "context_tokens",
    "batch",
    "method",
    "prefill_s",
    "decode_ms_per_token",
    "decode_vs_fp16",
    "kv_bytes",
    "kv_ratio",
    "peak_decode_bytes",
    "note",
]


@dataclass(frozen=True)
class MixPlanMethod(CocktailMethod):
    """A CocktailCache whose context chunks get a fixed precision mix, at random chunks (seeded)."""

    mix: tuple = PAPER_MIX
    seed: int = 0

    def plan(self, cache, example_id) -> None:
        n = cache.plans[0].num_chunks
        n16, n4 = round(self.mix[0] * n), round(self.mix[1] * n)
        bits = [16] * n16 + [4] * n4 + [2] * (n - n16 - n4)
        random.Random(self.seed).shuffle(bits)
        cache.set_precisions([bits])


def methods() -> list[Method]:
    out = [
        METHODS["fp16"],
        MixPlanMethod("cocktail_mix", "Cocktail cache, 10/30/60% FP16/INT4/INT2 chunks"),
        METHODS["int4"],
        METHODS["int2"],
    ]
    return out + ([METHODS["hqq2"]] if importlib.util.find_spec("hqq") is not None else [])


def word_tokenizer(n_words: int) -> PreTrainedTokenizerFast:
    """A fast word-level tokenizer over ``w0 ... w{n-1}`` (offsets work, so CocktailCache can locate a context)."""
    vocab = {"<pad>": 0, "<unk>": 1}
    vocab.update({f"w{i}": i + 2 for i in range(n_words - 2)})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>", eos_token="<pad>")


def random_request(n_context: int, n_words: int, seed: int = 0) -> Request:
    rng = random.Random(seed)
    context = " ".join(f"w{rng.randrange(100, n_words - 2)}" for _ in range(n_context))
    return Request(f"w1 w2 w3 w4 {context} w5 w6 {QUESTION}", context, QUESTION, "decode")


def random_model(shape: dict, dtype: torch.dtype, device: str):
    """A Llama with random weights, built directly on ``device``."""
    config = LlamaConfig(**shape, attn_implementation="cocktail")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def measure(method: Method, model, tok, request: Request, new_tokens: int) -> dict:
    """One timed ``generate`` (batch 1) with ``method``'s cache: the CSV's columns."""
    r = harness.measure(method, model, tok, request, new_tokens, encoder="unused")
    r.update(batch=1, note="", kv_ratio=round(r["kv_ratio"], 4))
    r.update(prefill_s=round(r["prefill_s"], 4), decode_ms_per_token=round(r["decode_ms_per_token"], 3))
    return {c: r[c] for c in COLUMNS if c in r}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m eval.benchmarks.bench_decode_random", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", default="bench_decode_random.csv")
    p.add_argument("--smoke", action="store_true", help="a tiny Llama on CPU, short contexts (checks the script)")
    p.add_argument("--contexts", default=None, help="context tokens, comma-separated (default 4096,32768)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=240.0,
        help="measurements not started within this many seconds are skipped (listed in the CSV)",
    )
    args = p.parse_args(argv)
    args.context_list = parse_int_list(args.contexts or ("200" if args.smoke else "4096,32768"), "--contexts")
    if args.smoke:
        args.new_tokens = min(args.new_tokens, 4)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_decode_random needs a CUDA GPU (or --smoke)")
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.float16)
    model = random_model(TINY_LLAMA if args.smoke else LLAMA3_8B, dtype, device)
    n_words = min(WORDS, model.config.vocab_size)
    tok = word_tokenizer(n_words)
    print(
        f"model: random Llama {'(tiny, smoke)' if args.smoke else '3-8B shape'} on {device}, {dtype}, "
        f"built in {time.perf_counter() - t0:.1f} s"
    )
    rows: list[dict] = []
    for c in args.context_list:
        request = random_request(c - 16, n_words)  # the template and the question make up the rest
        fp16_ms = None
        for m in methods():
            if time.perf_counter() - t0 > args.time_budget_s:
                row = {"context_tokens": c, "batch": 1, "method": m.name, "note": "skipped: time budget"}
            else:
                row = measure(m, model, tok, request, args.new_tokens)
                fp16_ms = row["decode_ms_per_token"] if m.name == "fp16" else fp16_ms
                row["decode_vs_fp16"] = round(row["decode_ms_per_token"] / fp16_ms, 3) if fp16_ms else ""
            rows.append(row)
            print(row, flush=True)
            write_dict_csv(args.out, rows, COLUMNS)  # after every measurement: a timeout keeps what finished
            if device == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
