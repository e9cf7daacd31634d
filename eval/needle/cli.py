"""Needle in a haystack over the Paul Graham essays, for several KV-cache methods side by side.

A needle sentence holding a random 7-digit passcode is inserted at a sentence boundary at a given depth (0 = start,
1 = end) of a haystack of ``length`` tokens cut from the essays; the model is asked for the passcode (chat template,
greedy, 16 new tokens). A case is correct when the passcode appears in the answer. Like LongBench, each case is
prefilled once at full precision and branched into every method's cache (``eval/methods/branching.py``).
``--variant`` runs RULER-style needles instead (``eval/needle/ruler.py``). Finished records are never recomputed.

Commands, outputs and how to read them: eval/README.md.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator

from tqdm.auto import tqdm

from hf_cocktail import CocktailCache, offline_encoder_path

from ..cli import UsageError
from ..essays import load_essays
from ..methods.kinds import Request
from ..methods.registry import add_method_args, methods_from_args
from ..models import load_model_and_tokenizer, resolve_model_path, set_threads
from ..paths import ESSAY_DIR
from ..records import check_settings, left_out_note, lock_out_dir, measure_pending, pending, read_done
from ..run_info import Invocation, run_config
from ..runner import CaseRunner, Outcome
from ..script_args import add_resume_args, check_script_args, needle_grid, script_parser
from . import ruler
from .cases import NEEDLE, QUESTION, case_key, make_case, passcode_request, span_chunk_bits
from .report import write_reports
from .ruler_report import write_reports as write_ruler_reports

MODULE = "eval.needle"
SETTINGS_KEYS = ("model", "dtype", "max_new_tokens", "encoder", "seed", "task")  # must match to resume
CLASSIC_DEPTHS = "0,0.25,0.5,0.75,1"
RULER_TASK = "ruler-niah"  # settings "task" of a RULER-style folder (None: the classic passcode needle)


def _parser() -> argparse.ArgumentParser:
    p = script_parser(MODULE, "Needle in a haystack (Paul Graham essays) per KV-cache method")
    add_resume_args(p, "case")
    p.add_argument("--essay-dir", default=ESSAY_DIR)
    p.add_argument(
        "--variant",
        default=None,
        help="RULER-style needles instead of the passcode needle: comma-separated from "
        f"{', '.join(ruler.VARIANTS)} (RULER's " + ", ".join(v.ruler_task for v in ruler.VARIANTS.values()) + ")",
    )
    p.add_argument(
        "--lengths",
        default="1000,2000,4000",
        help="haystack lengths in tokens, comma-separated; with --variant RULER's max_seq_length "
        f"(prompt + {ruler.TOKENS_TO_GENERATE} tokens to generate)",
    )
    p.add_argument(
        "--depths",
        default=None,
        help=f"needle depths in [0, 1], comma-separated (default {CLASSIC_DEPTHS}); not with --variant "
        "(each needle's depth is drawn from RULER's 40 depths)",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=1,
        help="cases per (length, depth), or per (variant, length): other haystack / needles",
    )
    add_method_args(p, "fp16,cocktail,int4,int2")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"default 16, with --variant {ruler.TOKENS_TO_GENERATE} (RULER's)",
    )
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    args.variant_list = ruler.parse_variants(args.variant) if args.variant is not None else []
    args.task = RULER_TASK if args.variant_list else None
    if args.variant_list:
        if args.depths is not None:
            raise UsageError(
                "--depths is for the passcode needle; with --variant each needle's depth is drawn from "
                "RULER's 40 depths (seeded by --seed)"
            )
    else:
        args.depths = CLASSIC_DEPTHS if args.depths is None else args.depths
    if args.max_new_tokens is None:
        args.max_new_tokens = ruler.TOKENS_TO_GENERATE if args.variant_list else 16
    args.length_list, args.depth_list = needle_grid(args.lengths, args.depths, ("--lengths", "--depths"))
    if args.variant_list:
        ruler.check_lengths(args.length_list)
    check_script_args(args, samples=1, max_new_tokens=1)
    return args


def check_resume_settings(args) -> None:
    """Refuse to resume into ``--out-dir`` with settings that change what a finished case means."""
    check_settings(args.out_dir, {k: getattr(args, k) for k in SETTINGS_KEYS}, SETTINGS_KEYS)


def case_record(case: dict, request: Request, out: Outcome, tok) -> dict:
    """The record of one method on one case."""
    L, d, s = case["length"], case["depth"], case["sample"]
    return {
        "case": case_key(L, d, s),
        "length": L,
        "depth": d,
        "sample": s,
        "method": out.method.name,
        "code": case["code"],
        "pred": out.text,
        "correct": int(case["code"] in out.text),
        "prompt_tokens": out.prompt_tokens,
        **out.fields(),
        "needle_chunk_bits": span_chunk_bits(tok, request, NEEDLE.format(code=case["code"]), out.branch.cache),
    }


def ruler_record(case: dict, request: Request, out: Outcome, tok) -> dict:
    """The record of one method on one RULER-style case; ``score`` is RULER's string_match_all."""
    cache = out.branch.cache
    asked = {
        ruler.NEEDLE.format(key=k, value=v)
        for k, vs in zip(case["keys"], case["values"])
        if k in case["queries"]
        for v in vs
    }
    needles = [
        {**n, "asked": n["text"] in asked, "chunk_bits": span_chunk_bits(tok, request, n["text"], cache)}
        for n in case["needles"]
    ]
    return {
        "case": ruler.case_key(case["variant"], case["length"], case["sample"]),
        "variant": case["variant"],
        "ruler_task": case["ruler_task"],
        "length": case["length"],
        "sample": case["sample"],
        "method": out.method.name,
        "queries": case["queries"],
        "expected": case["expected"],
        "pred": out.text,
        "score": ruler.string_match_all(out.text, case["expected"]),
        "needles": needles,
        "asked_needle_bits": (
            [n["chunk_bits"] for n in needles if n["asked"]] if isinstance(cache, CocktailCache) else None
        ),
        "prompt_tokens": out.prompt_tokens,
        "new_tokens": out.num_new,
        **out.fields(),
    }


def passcode_case(args, tok, essays: list[str], L: int, d: float, s: int) -> tuple[Request, Callable]:
    """The passcode case ``(L, d, s)``: its request and the function that makes a method's record of it."""
    case = make_case(tok, essays, L, d, s, args.seed)
    request = passcode_request(tok, case)
    return request, lambda out: case_record(case, request, out, tok)


def ruler_case(args, tok, essays: list[str], v: str, L: int, s: int) -> tuple[Request, Callable]:
    """The RULER-style case ``(v, L, s)``: its request and the function that makes a method's record of it."""
    case = ruler.make_case(tok, essays, v, L, s, args.seed)
    key = ruler.case_key(v, L, s)
    request = Request(case["prompt"], case["context"], case["question"], key, case["tokenizer_kwargs"])
    return request, lambda out: ruler_record(case, request, out, tok)


def run_cases(
    args, todo: list, essays: list[str], encoder: str, rec_path: str, done: dict, deadline: float | None = None
) -> int:
    """The cases of ``todo`` (RULER-style with ``--variant``, else passcode), until ``deadline`` (checked before
    each case); returns how many ran."""
    model, tok = load_model_and_tokenizer(args.model, args.dtype, "cocktail", args.device_map)
    runner = CaseRunner(model, tok, encoder)
    make, desc = (ruler_case, "ruler") if args.variant_list else (passcode_case, "needle")

    def measure(case: tuple, methods: list) -> Iterator[dict]:
        request, record_of = make(args, tok, essays, *case)
        return (record_of(out) for out in runner.run(request, methods, args.max_new_tokens))

    bar = tqdm(todo, desc=desc, disable=args.no_progress, dynamic_ncols=True)
    return measure_pending(bar, measure, rec_path, done, deadline=deadline)


def model_max_positions(name: str) -> int | None:
    """The model's window (``max_position_embeddings``), read from its config; None when it cannot be read."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(resolve_model_path(name))
    except (OSError, ValueError):
        return None
    return getattr(cfg.get_text_config(decoder=True), "max_position_embeddings", None)


def prompt_config(args) -> dict:
    """What ``run_info.json`` records of the prompts beside the methods and arguments."""
    if args.variant_list:
        return {
            "needle": ruler.NEEDLE,
            "template": ruler.TEMPLATE,
            "answer_prefix": ruler.ANSWER_PREFIX,
            "tokens_to_generate_in_length": ruler.TOKENS_TO_GENERATE,
            "variants": {v: vars(ruler.VARIANTS[v]) for v in args.variant_list},
        }
    return {"needle": NEEDLE, "question": QUESTION}


def main(argv=None) -> int:
    args = parse_args(argv)
    run = Invocation(args.out_dir, MODULE)
    methods = methods_from_args(args)
    essays = load_essays(args.essay_dir)
    set_threads(1, args.threads)
    encoder = args.encoder or offline_encoder_path()
    if args.variant_list:
        ruler.check_lengths(args.length_list, model_max_positions(args.model))
    check_resume_settings(args)
    lock = lock_out_dir(args.out_dir)  # noqa: F841 (held until the process exits)
    if not args.report_only:
        run.running()
    rec_path = os.path.join(args.out_dir, "records.jsonl")
    done = read_done(rec_path)
    if args.variant_list:
        # length by length, sample by sample: a run stopped early has whole lengths and every variant
        cases = [(v, L, s) for L in args.length_list for s in range(args.samples) for v in args.variant_list]
        key = ruler.case_key
    else:
        cases = [(L, d, s) for L in args.length_list for d in args.depth_list for s in range(args.samples)]
        key = case_key
    todo = pending(cases, methods, done, lambda c: key(*c))
    deadline = run.deadline(args.stop_after_minutes)
    ran = run_cases(args, todo, essays, encoder, rec_path, done, deadline) if todo and not args.report_only else 0
    keys = [key(*c) for c in cases]
    rows = [done[(k, m.name)] for k in keys for m in methods if (k, m.name) in done]
    if args.variant_list:
        print(
            write_ruler_reports(
                args.out_dir, rows, [m.name for m in methods], args.variant_list, args.length_list, args.samples
            )
        )
    else:
        print(
            write_reports(
                args.out_dir, rows, [m.name for m in methods], args.length_list, args.depth_list, args.samples
            )
        )
    if note := left_out_note(done, [m.name for m in methods]):
        print(note)
    if not args.report_only:
        run.finished("cases", ran, len(todo), run_config(args, methods, encoder, **prompt_config(args)))
    return 0
