"""``python -m hf_cocktail.calibrate``: a preset for your model, calibrated on your texts within a KV byte target.

    python -m hf_cocktail.calibrate --model Qwen/Qwen2.5-0.5B --texts docs/*.txt --target-bytes 0.25 --out my-preset
    python -m hf_cocktail.calibrate --model gemma-3-270m --texts a.jsonl --text-field context --out my-preset

``--model``: a Hub id or local folder (``--gguf-file`` for a GGUF file in it), or an offline model name
(``smollm2-135m-instruct``, ``gemma-3-270m``). ``--texts``: ``.txt`` files (one text each) and ``.jsonl`` files (one
text per line: a JSON string or an object with the field ``--text-field``). Writes ``--out``: the config, its card,
``calibration.json`` (every measurement) and ``card_meta.json``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import torch

from hf_cocktail.calibrate.preset import write_preset
from hf_cocktail.calibrate.run import ROTATIONS, SCORERS, calibrate_model
from hf_cocktail.calibrate.texts import read_texts
from hf_cocktail.offline_models import canonical_name, load_offline_model

BASE_MODELS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma-3-270m": "google/gemma-3-270m"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def rotation_list(text: str) -> tuple[str | None, ...]:
    """``--rotations``: comma-separated names, ``none`` for no rotation."""
    names = [r.strip() for r in text.split(",") if r.strip()]
    allowed = ["none" if r is None else r for r in ROTATIONS]
    if not names or any(r not in allowed for r in names):
        raise argparse.ArgumentTypeError(f"give a comma-separated list of {allowed}, got {text!r}")
    return tuple(None if r == "none" else r for r in names)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_cocktail.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hub id, local folder, or smollm2-135m-instruct / gemma-3-270m")
    p.add_argument("--gguf-file", default=None, help="a GGUF file inside --model's folder")
    p.add_argument("--texts", nargs="+", required=True, metavar="FILE", help=".txt (one text) / .jsonl (one per line)")
    p.add_argument("--text-field", default="text", help="the field of .jsonl objects holding the text")
    p.add_argument("--target-bytes", type=float, default=0.25, help="quantized layers' KV bytes / FP16's (0, 1]")
    p.add_argument("--out", required=True, help="the preset folder to write")
    p.add_argument("--calibration-texts", type=int, default=4, help="texts the layer sensitivity is measured on")
    p.add_argument("--validation-texts", type=int, default=4, help="held-out texts the candidates are measured on")
    p.add_argument("--window", type=int, default=2048, help="tokens per text used (context + question + continuation)")
    p.add_argument(
        "--bytes-window",
        type=int,
        default=8192,
        help="prompt tokens the byte target holds at: the first text that long (the longest when none is); "
        "at most --window: the held-out windows",
    )
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--continuation-tokens", type=int, default=32)
    p.add_argument(
        "--search",
        default="",
        help=f"comma-separated chunk-search scorers to try on top of the caps ({', '.join(SCORERS)}; default none)",
    )
    p.add_argument("--encoder", default=None, help="retrieval encoder (Hub id / folder): --search encoder, the config")
    p.add_argument(
        "--sensitivity-from",
        default=None,
        metavar="CALIBRATION_JSON",
        help="reuse the layer sensitivity of an earlier run on the same model and texts (another --target-bytes)",
    )
    p.add_argument(
        "--rotations",
        type=rotation_list,
        default="none,hadamard,hadamard_keys,hadamard_values",
        help="comma-separated storage rotations compared at the base widths (none, hadamard, hadamard_keys, "
        "hadamard_values; default all four)",
    )
    p.add_argument("--base-model", default=None, help="Hub id of the model, for the card (default: --model)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--no-progress", action="store_true")
    return p


def load_model(name: str, gguf_file: str | None, dtype: torch.dtype):
    """``(model, tokenizer)``: an offline model by name, else ``from_pretrained`` under ``"cocktail"`` attention."""
    if canonical_name(name) and not gguf_file:
        return load_offline_model(name, dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(name, **kw)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="cocktail", **kw).eval()
    return model, tok


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    scorers = tuple(s.strip() for s in args.search.split(",") if s.strip())
    texts = read_texts(args.texts, args.text_field)  # before the model loads: bad files fail fast
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, args.gguf_file, DTYPES[args.dtype])
    result = calibrate_model(
        model,
        tok,
        texts,
        args.target_bytes,
        calibration_texts=args.calibration_texts,
        validation_texts=args.validation_texts,
        window=args.window,
        question_tokens=args.question_tokens,
        continuation_tokens=args.continuation_tokens,
        search_scorers=scorers,
        encoder=args.encoder,
        progress=not args.no_progress,
        sensitivity_from=_read_json(args.sensitivity_from) if args.sensitivity_from else None,
        rotations=args.rotations,
        bytes_tokens=args.bytes_window,
    )
    base = args.base_model or BASE_MODELS.get(canonical_name(args.model) or "", args.model)
    command = "python -m hf_cocktail.calibrate " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    write_preset(args.out, result, base, command)
    chosen = result.measured(result.chosen)
    print(
        f"chose {result.chosen}: KLD {chosen['kld']:.4f} on {len(result.validation_windows)} held-out texts, "
        f"{chosen['bytes_ratio']:.3f}x the FP16 bytes (quantized layers) on a "
        f"{result.settings['bytes_window']['tokens']}-token prompt; wrote {args.out} in "
        f"{result.timings_s['total']:.0f} s"
    )
    return 0
