"""Decode speed measured in alternating rounds from one shared prefill, and the method variants of the speed scripts.

On a shared, loaded CPU a method timed for a minute after another is timed under other load. Here every method's
cache is built from the same full-precision prefill (``eval.methods.branching``) and the methods then take turns:
round ``r`` runs ``steps`` greedy decode steps of every method (a real ``model.generate`` continuing that method's
own cache), in forward order on even rounds and in reverse order on odd rounds, so slow and fast periods of the
machine hit all methods alike. The ratio of a method to the baseline is taken per round (same minute) and the
median over rounds is reported, with the median per-token times.

Method names are those of :mod:`eval.methods.registry`, plus ``NAME:torch`` / ``NAME:auto`` / ``NAME:cpu``: a
Cocktail-kind method with its ``backend`` forced (``cocktail:torch`` is paper Cocktail on the PyTorch
dequantize-then-attend path, ``cocktail`` uses ``backend="auto"``: the fused CPU kernel on CPU).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import Cache

from hf_cocktail.integration.compat import cache_kwargs

from ..cli import UsageError
from ..essays import essay_prefix
from ..methods.branching import GREEDY, branch, prefill_for
from ..methods.kinds import CocktailMethod, Method, Request, build_cache
from ..methods.registry import parse_methods
from ..models import model_input_device

QUESTION = "What is the main point of these essays?"
BACKEND_SUFFIXES = ("torch", "auto", "cpu")


def make_prompt(tok, context: str) -> tuple[str, dict]:
    """The benchmark prompt: ``context`` then the question, in the chat template when the tokenizer has one."""
    content = context + "\n\nQuestion: " + QUESTION
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        ), {"add_special_tokens": False}
    return content, {}


def bench_request(tok, context: str) -> Request:
    """The benchmark prompt over ``context`` as a :class:`Request` (the question is the search query)."""
    prompt, kw = make_prompt(tok, context)
    return Request(prompt, context, QUESTION, "bench", kw)


def resolve_method(name: str) -> Method:
    """A registry method or ``NAME:BACKEND`` (see the module docstring)."""
    base, _, backend = name.partition(":")
    method = parse_methods(base)[0]
    if not backend:
        return method
    if backend not in BACKEND_SUFFIXES:
        raise UsageError(f"method {name!r}: the backend suffix must be one of {BACKEND_SUFFIXES}")
    if not isinstance(method, CocktailMethod):
        raise UsageError(f"method {name!r}: a backend suffix applies to Cocktail methods only")
    return dataclasses.replace(
        method,
        name=name,
        description=f"{method.description} [backend={backend}]",
        overrides={**method.overrides, "backend": backend},
    )


def resolve_methods(spec: str) -> list[Method]:
    """``--methods``: comma-separated names (registry names, ``NAME:BACKEND``), each once."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise UsageError("--methods is empty")
    if len(set(names)) != len(names):
        raise UsageError(f"--methods lists a method twice: {names}")
    return [resolve_method(n) for n in names]


@dataclass
class SharedPrefill:
    """One full-precision prefill of the benchmark prompt over ``context_tokens`` tokens of the essays."""

    request: Request
    input_ids: torch.Tensor  # (1, L)
    dyn: Cache
    first_logits: torch.Tensor
    prefill_s: float
    queries: list[torch.Tensor] | None = None  # the tokens after the context, per layer, for salient methods

    @property
    def prompt_tokens(self) -> int:
        return int(self.input_ids.shape[1])


@torch.no_grad()
def shared_prefill(
    model, tok, context_tokens: int, essay_dir: str | None = None, methods: tuple | list = ()
) -> SharedPrefill:
    """Prefill the benchmark prompt over the first ``context_tokens`` tokens of the essays (batch 1), recording the
    attention queries after the context when one of ``methods`` reads them (``salient_tokens``)."""
    request = bench_request(tok, essay_prefix(tok, context_tokens, essay_dir))
    ids = tok(request.prompt, return_tensors="pt", **request.tokenizer_kwargs)["input_ids"]
    ids = ids.to(model_input_device(model))
    t0 = time.perf_counter()
    dyn, logits, queries = prefill_for(model, tok, ids, request, list(methods))
    return SharedPrefill(request, ids, dyn, logits, time.perf_counter() - t0, queries)


def cast_prefill(shared, dtype):
    """The shared prefill with its keys/values in ``dtype`` (a prefill run in another dtype, see --prefill-dtype)."""
    for layer in shared.dyn.layers:
        layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)
        layer.dtype = dtype
    if shared.queries is not None:
        shared.queries = [q.to(dtype) for q in shared.queries]
    return shared


@dataclass
class Runner:
    """One method's cache branched from the shared prefill, and its running sequences (the next decode steps
    continue them with ``model.generate``)."""

    method: Method
    cache: Cache
    ids: torch.Tensor  # prompt + tokens generated so far (B, L + n)
    setup_s: float
    round_s: list[float] = field(default_factory=list)

    @property
    def batch(self) -> int:
        return int(self.ids.shape[0])

    @torch.no_grad()
    def decode(self, model, steps: int, pad_token_id: int | None) -> float:
        """``steps`` greedy decode steps (``generate`` continuing the cache, no stop token); returns the seconds."""
        t0 = time.perf_counter()
        out = model.generate(
            input_ids=self.ids,
            attention_mask=torch.ones_like(self.ids),
            **cache_kwargs(model, self.cache),
            max_new_tokens=steps,
            min_new_tokens=steps,
            **GREEDY,
            pad_token_id=pad_token_id,
        )
        dt = time.perf_counter() - t0
        self.ids = out
        return dt


def branch_runner(
    method: Method, model, tok, shared: SharedPrefill, encoder: str | None = None, batch: int = 1
) -> Runner:
    """``method``'s cache holding the shared prefill, for ``batch`` copies of the prompt; each sequence is the prompt
    plus the first new token (the argmax of the shared logits), so every later ``generate`` step is a decode step
    over the method's cache.

    Batches: a Cocktail cache is searched and quantized once and its rows repeated (``batch_repeat_interleave``:
    the same layout as ``batch`` independent identical prompts, without ``batch`` searches); the other caches are
    filled from the prefill's keys/values repeated ``batch`` times. Decode cost does not depend on the tokens'
    values, so identical prompts time what different prompts of the same length would."""
    t0 = time.perf_counter()
    if batch == 1 or isinstance(method, CocktailMethod):
        cache = branch(
            method, model, tok, shared.dyn, shared.input_ids, shared.request, encoder, prefill_queries=shared.queries
        ).cache
        if batch > 1:
            cache.batch_repeat_interleave(batch)
    else:
        cache, _ = build_cache(method, model)
        method.load_prefill(
            cache,
            [
                (layer.keys.expand(batch, -1, -1, -1).contiguous(), layer.values.expand(batch, -1, -1, -1).contiguous())
                for layer in shared.dyn.layers
            ],
        )
    first = shared.first_logits.argmax(-1, keepdim=True).to(shared.input_ids.device)
    ids = torch.cat([shared.input_ids, first], dim=1).expand(batch, -1).contiguous()
    return Runner(method, cache, ids, time.perf_counter() - t0)


def alternating_rounds(
    runners: list[Runner], model, rounds: int, steps: int, pad_token_id: int | None, warmup: int = 0, desc="rounds"
) -> None:
    """``warmup`` untimed decode steps per runner, then ``rounds`` rounds of ``steps`` timed decode steps per runner,
    forward order on even rounds, reverse on odd ones."""
    for run in runners if warmup else ():
        run.decode(model, warmup, pad_token_id)
    with tqdm(total=rounds * len(runners), desc=desc, dynamic_ncols=True) as bar:
        for r in range(rounds):
            for run in runners if r % 2 == 0 else runners[::-1]:
                run.round_s.append(run.decode(model, steps, pad_token_id))
                bar.update(1)


def summarize_rounds(runners: list[Runner], steps: int, base: str = "fp16") -> list[dict]:
    """Per runner: median / min ms per token over rounds, and the median over rounds of the per-round ratio to the
    ``base`` runner (with its min and max)."""
    ref = next((r for r in runners if r.method.name == base), None)
    out = []
    for run in runners:
        ms = [1000 * s / steps for s in run.round_s]
        row = {
            "method": run.method.name,
            "rounds": len(ms),
            "steps_per_round": steps,
            "decode_ms_per_token": statistics.median(ms),
            "decode_ms_per_token_min": min(ms),
            "decode_ms_per_token_rounds": ms,
            "setup_s": run.setup_s,
        }
        if ref is not None:
            ratios = [a / b for a, b in zip(run.round_s, ref.round_s)]
            row.update(
                decode_ratio=statistics.median(ratios),
                decode_ratio_min=min(ratios),
                decode_ratio_max=max(ratios),
                decode_ratio_rounds=ratios,
            )
        out.append(row)
    return out
