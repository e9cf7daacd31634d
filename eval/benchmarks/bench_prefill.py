"""Prefill overhead of a Cocktail cache vs a DynamicCache: search + quantization as a fraction of prefill time.

Per context length, ``--rounds`` alternating rounds (forward order on even rounds, reverse on odd ones); in each
round every method runs the whole prefill of the benchmark prompt (Paul Graham essays + a question, chat template):

* ``fp16``: ``tokenizer(prompt)`` + one forward into a ``DynamicCache``;
* a Cocktail method: ``cache.prepare_inputs(...)`` (tokenization with offsets, context location, chunk texts) + one
  forward into the ``CocktailCache`` (the search and every layer's quantization happen inside it; where a layer
  defers its store to the first decode step, ``rotation="auto"`` or attention scores, that build is timed too).

Both forwards compute the last token's logits only (``logits_to_keep=1``, as ``generate`` does). The overhead of a
method = its prefill time / fp16's prefill time in the same round - 1 (median over rounds). Its parts are timed by
wrapping the library's functions for the run (nothing in the library changes; each part's time excludes the parts
nested in it):

* ``tokenize``: the tokenizer call (with offsets for Cocktail);
* ``context location``: ``planning.context_span``; ``chunk texts``: ``planning.chunk_texts``;
* ``encoder``: ``scoring.score_chunks`` (embedding the query and every chunk, cosine similarity);
* ``search``: the rest of ``run_search`` (thresholds / budget);
* ``positions``: ``SequencePlan.build_positions``;
* ``quantization``: ``quantize_pack_keys`` / ``quantize_pack_values`` (the fused ``cpu_ops`` ones on CPU, the
  PyTorch reference ``hf_cocktail.storage.quant`` with ``backend="torch"``) and their 8-bit-parameter versions
  (``storage.params8``), wherever they are called (the rotation choice's estimates too);
* ``store build``: the rest of ``LayerStore.build`` (gathering each part's tokens, the full-precision part);
* ``rotation``: ``Rotation._apply`` (rotated storage); ``rotation choice``: the rest of ``rotation="auto"``'s
  ``key_rotation.layer_rotation``;
* ``model``: the rest of the forward (the model's own prefill compute).

    python -m eval.benchmarks.bench_prefill --contexts 4000,8000 --methods fp16,cocktail,recommended --rounds 3 \\
        --threads 2 --out eval/results/prefill/4k_8k.json
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
from transformers import DynamicCache

from hf_cocktail.integration.compat import cache_kwargs

from ..cli import UsageError, parse_int_list, run_cli
from ..essays import essay_prefix
from ..methods.kinds import CocktailMethod, Request
from ..models import load_model_and_tokenizer, model_input_device, set_threads
from ..reporting import METHOD_COLUMNS, METHOD_RULE, method_cells
from .harness import common_args, fp16_first, new_parser, write_outputs
from .rounds import bench_request

MODULE = "eval.benchmarks.bench_prefill"
PARTS = (
    "tokenize",
    "context location",
    "chunk texts",
    "encoder",
    "search",
    "positions",
    "quantization",
    "store build",
    "rotation",
    "rotation choice",
    "model",
)
OVERHEAD_PARTS = PARTS[1:-1]  # what a DynamicCache prefill does not do (tokenization is compared separately)


PACKAGES = ("hf_cocktail", "cpu_ops")


class Patcher:
    """Temporary wrappers around library functions: a function is replaced wherever a loaded module of
    ``packages`` holds it (``from .x import f`` copies the name into the importing module), so the wrapping survives
    the library moving code between its modules; methods are replaced on their class. Nothing in the library is
    edited; :meth:`restore` puts everything back."""

    def __init__(self, packages: tuple[str, ...] = PACKAGES):
        self.packages = packages
        self._saved: list[tuple[object, str, object]] = []

    def function(self, func: Callable, wrap: Callable[[Callable], Callable]) -> int:
        """Replace ``func`` by ``wrap(func)`` in every loaded module of the packages; returns how many names."""
        new = wrap(func)
        n = 0
        for name, mod in list(sys.modules.items()):
            if mod is None or name.split(".")[0] not in self.packages:
                continue
            for attr, val in list(vars(mod).items()):
                if val is func:
                    setattr(mod, attr, new)
                    self._saved.append((mod, attr, val))
                    n += 1
        return n

    def method(self, cls: type, name: str, wrap: Callable[[Callable], Callable]) -> None:
        """Replace ``cls.name`` (a plain, static or class method defined on ``cls``) by its wrapped version."""
        old = cls.__dict__[name]
        if isinstance(old, staticmethod):
            new = staticmethod(wrap(old.__func__))
        elif isinstance(old, classmethod):
            new = classmethod(wrap(old.__func__))
        else:
            new = wrap(old)
        setattr(cls, name, new)
        self._saved.append((cls, name, old))

    def restore(self) -> None:
        for owner, name, old in reversed(self._saved):
            setattr(owner, name, old)
        self._saved.clear()


@contextlib.contextmanager
def patching(packages: tuple[str, ...] = PACKAGES) -> Iterator[Patcher]:
    p = Patcher(packages)
    try:
        yield p
    finally:
        p.restore()


class Timers:
    """Exclusive wall time per part: a part's time excludes the parts nested in it."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [part, start, nested]

    @contextlib.contextmanager
    def part(self, name: str):
        frame = [name, time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            dt = time.perf_counter() - frame[1]
            self._stack.pop()
            self.totals[name] += dt - frame[2]
            if self._stack:
                self._stack[-1][2] += dt

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self.part(name):
                return fn(*args, **kwargs)

        return wrapper

    def reset(self) -> None:
        self.totals = defaultdict(float)


@contextlib.contextmanager
def instrumented(timers: Timers):
    """Wrap the library's prefill-side functions in ``timers`` parts for the duration of the block."""
    import cpu_ops
    from hf_cocktail import CocktailCache
    from hf_cocktail.cache import inputs
    from hf_cocktail.planning import key_rotation, scoring
    from hf_cocktail.planning import plans as planning
    from hf_cocktail.storage import params8, quant, store
    from hf_cocktail.storage.rotation import Rotation

    with patching() as p:

        def wrap(part):
            return lambda fn: timers.wrap(part, fn)

        p.function(inputs._tokenize, wrap("tokenize"))
        p.function(planning.context_span, wrap("context location"))
        p.function(planning.chunk_texts, wrap("chunk texts"))
        p.function(scoring.score_chunks, wrap("encoder"))
        p.method(CocktailCache, "run_search", wrap("search"))
        p.method(planning.SequencePlan, "build_positions", wrap("positions"))
        p.function(quant.quantize_pack_keys, wrap("quantization"))
        p.function(quant.quantize_pack_values, wrap("quantization"))
        p.function(cpu_ops.quantize_pack_keys, wrap("quantization"))  # the fused CPU quantizers (backend "cpu")
        p.function(cpu_ops.quantize_pack_values, wrap("quantization"))
        p.function(params8.quantize_pack_keys8, wrap("quantization"))
        p.function(params8.quantize_pack_values8, wrap("quantization"))
        p.method(store.LayerStore, "build", wrap("store build"))
        p.method(Rotation, "_apply", wrap("rotation"))
        p.function(key_rotation.layer_rotation, wrap("rotation choice"))
        yield


@torch.no_grad()
def one_prefill(method, model, tok, request: Request, timers: Timers, encoder=None) -> float:
    """One whole prefill of ``request`` with ``method``'s cache (tokenization included); returns its wall seconds."""
    timers.reset()
    t0 = time.perf_counter()
    with timers.part("model"):
        if isinstance(method, CocktailMethod):
            cache = method.new_cache(model, encoder)
            inputs = cache.prepare_inputs(
                tok, request.prompt, contexts=request.context, queries=request.query, **request.tokenizer_kwargs
            )
            method.plan(cache, "bench")
        else:
            cache = DynamicCache(config=model.config)
            with timers.part("tokenize"):
                inputs = tok(request.prompt, return_tensors="pt", **request.tokenizer_kwargs)
        inputs = inputs.to(model_input_device(model))
        model(**inputs, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        if isinstance(method, CocktailMethod):
            cache.nbytes()  # builds a store the prefill deferred (rotation="auto"), as the first decode step would
    return time.perf_counter() - t0


def summarize(rows: list[dict], methods: list[str]) -> list[dict]:
    """Per (context, method): median prefill seconds, median per-round ratio to fp16, median parts."""
    out = []
    for ctx in sorted({r["context"] for r in rows}):
        base = {r["round"]: r["seconds"] for r in rows if r["context"] == ctx and r["method"] == "fp16"}
        for m in methods:
            mine = [r for r in rows if r["context"] == ctx and r["method"] == m]
            ratios = [r["seconds"] / base[r["round"]] for r in mine]
            parts = {p: statistics.median(r["parts"].get(p, 0.0) for r in mine) for p in PARTS}
            overhead_s = [sum(r["parts"].get(p, 0.0) for p in OVERHEAD_PARTS) for r in mine]
            out.append(
                {
                    "context": ctx,
                    "prompt_tokens": mine[0]["prompt_tokens"],
                    "method": m,
                    "prefill_s": statistics.median(r["seconds"] for r in mine),
                    "ratio_vs_fp16": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    "parts_s": parts,
                    "search_quant_s": statistics.median(overhead_s),
                    "search_quant_fraction": statistics.median(o / r["seconds"] for o, r in zip(overhead_s, mine)),
                    "rounds": len(mine),
                }
            )
    return out


def table(summary: list[dict]) -> str:
    head = (
        f"| context | {METHOD_COLUMNS} | prefill s | ratio vs fp16 (range) | overhead parts s (share of its prefill) | "
        + " | ".join(PARTS)
        + " |"
    )
    lines = [head, f"|---|{METHOD_RULE}|" + "---|" * (3 + len(PARTS))]
    for s in summary:
        p = s["parts_s"]
        lines.append(
            f"| {s['prompt_tokens']} | {method_cells(s['method'])} | {s['prefill_s']:.2f} | {s['ratio_vs_fp16']:.3f} "
            f"({s['ratio_min']:.3f}-{s['ratio_max']:.3f}) | {s['search_quant_s']:.2f} "
            f"({100 * s['search_quant_fraction']:.1f}%) | " + " | ".join(f"{p[k]:.3f}" for k in PARTS) + " |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    p = new_parser(MODULE, __doc__)
    p.add_argument("--contexts", default="4000,8000")
    p.add_argument("--methods", default="fp16,cocktail,recommended")
    p.add_argument("--rounds", type=int, default=3)
    common_args(p, threads=2)
    args = p.parse_args(argv)
    args.context_list = parse_int_list(args.contexts, "--contexts")
    args.method_list = fp16_first(args.methods)
    if args.rounds < 1:
        raise UsageError("--rounds must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    set_threads(1, args.threads)
    model, tok = load_model_and_tokenizer(args.model, args.dtype, "cocktail")
    timers = Timers()
    rows = []
    with instrumented(timers):
        warm = bench_request(tok, essay_prefix(tok, 256, args.essay_dir))  # first calls (encoder loading) untimed
        for m in args.method_list:
            one_prefill(m, model, tok, warm, timers)
        for ctx in args.context_list:
            request = bench_request(tok, essay_prefix(tok, ctx, args.essay_dir))
            n = len(tok(request.prompt, **request.tokenizer_kwargs)["input_ids"])
            for r in range(args.rounds):
                for m in args.method_list if r % 2 == 0 else args.method_list[::-1]:
                    s = one_prefill(m, model, tok, request, timers)
                    rows.append(
                        {
                            "context": ctx,
                            "prompt_tokens": n,
                            "method": m.name,
                            "round": r,
                            "seconds": s,
                            "parts": dict(timers.totals),
                        }
                    )
                    print(
                        f"context {ctx} round {r} {m.name}: {s:.2f} s "
                        + ", ".join(f"{k} {v:.3f}" for k, v in timers.totals.items() if k != "model"),
                        flush=True,
                    )
    summary = summarize(rows, [m.name for m in args.method_list])
    out = table(summary)
    print(out)
    if args.out:
        write_outputs(args.out, MODULE, {"summary": summary, "rounds": rows}, "Prefill overhead vs DynamicCache", out)
    return 0


if __name__ == "__main__":
    run_cli(main)
