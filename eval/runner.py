"""The evaluation of one case, shared by LongBench and the needle test: the prompt is prefilled once at full
precision, that prefill is branched into every method's cache, each cache generates greedily, and the outcome (text,
KV bytes, timings) is measured. The scripts turn outcomes into their own records."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .kv_bytes import cache_kv_bytes, fp16_kv_bytes, global_kv_ratio
from .methods.branching import Branch, branch, generate_from_branch, prefill_for
from .methods.kinds import Method, Request
from .models import eos_token_ids, model_input_device

WARM_UP_CONTEXT = "The quick brown fox jumps over the lazy dog. " * 12


def kv_fields(cache: Cache, config) -> dict:
    """The size of a filled cache, as every record holds it: ``cache_tokens``, ``kv_bytes`` (an FP16 deployment,
    :mod:`eval.kv_bytes`), ``fp16_kv_bytes`` (the model's own FP16 ``DynamicCache`` of the same tokens; sliding
    layers: their window), ``kv_ratio`` and ``kv_ratio_global`` (the full-attention layers alone)."""
    seq = int(cache.get_seq_length())
    kv, fp16 = cache_kv_bytes(cache), fp16_kv_bytes(config, seq)
    ratios = {"kv_ratio": kv / fp16, "kv_ratio_global": global_kv_ratio(cache, config, seq)}
    return {"cache_tokens": seq, "kv_bytes": kv, "fp16_kv_bytes": fp16, **ratios}


@dataclass
class Outcome:
    """One method's result on one case; ``branch.cache`` stays usable while the caller handles it."""

    method: Method
    new_tokens: torch.Tensor  # (1, n)
    text: str  # decoded with skip_special_tokens
    prompt_tokens: int
    kv: dict  # kv_fields of the cache after generation
    shared_prefill_s: float
    decode_s: float
    branch: Branch

    @property
    def num_new(self) -> int:
        return int(self.new_tokens.shape[1])

    @property
    def kv_ratio(self) -> float:
        return self.kv["kv_ratio"]

    def fields(self) -> dict:
        """What every record of a generated case holds: the sizes, the times and the chunks' precision counts."""
        times = {"prefill_s": self.prefill_s, "decode_s": self.decode_s}
        return {**self.kv, **times, "precision_counts": self.branch.precision_counts}

    @property
    def prefill_s(self) -> float:
        """The shared full-precision prefill + the method's own setup (search, quantization)."""
        return self.shared_prefill_s + self.branch.setup_s

    @property
    def decode_ms_per_token(self) -> float | None:
        """Decode wall time per decode step; the first new token comes from the shared prefill (no step)."""
        return 1000 * self.decode_s / (self.num_new - 1) if self.num_new > 1 else None


class CaseRunner:
    """Runs cases through several methods with one model."""

    def __init__(self, model, tokenizer, encoder: str | None = None):
        self.model, self.tokenizer, self.encoder = model, tokenizer, encoder
        self.device = model_input_device(model)
        self.eos = eos_token_ids(model, tokenizer)

    def run(
        self,
        request: Request,
        methods: list[Method],
        max_new_tokens: int,
        stop_ids: list[int] | None = None,
        min_new_tokens: int = 0,
    ) -> Iterator[Outcome]:
        """Prefill ``request`` once and yield each method's outcome (greedy, at most ``max_new_tokens``; stops at
        ``stop_ids``, default the model's EOS tokens)."""
        stop = self.eos if stop_ids is None else stop_ids
        input_ids = self.tokenizer(request.prompt, return_tensors="pt", **request.tokenizer_kwargs)["input_ids"].to(
            self.device
        )
        t0 = time.perf_counter()
        dyn, first_logits, queries = prefill_for(self.model, self.tokenizer, input_ids, request, methods)
        shared_prefill_s = time.perf_counter() - t0
        for method in methods:
            br = branch(method, self.model, self.tokenizer, dyn, input_ids, request, self.encoder, queries)
            t1 = time.perf_counter()
            new = generate_from_branch(
                self.model,
                br.cache,
                input_ids,
                first_logits,
                max_new_tokens,
                eos_token_id=stop,
                min_new_tokens=min_new_tokens,
            )
            decode_s = time.perf_counter() - t1
            yield self._outcome(method, br, new, input_ids, shared_prefill_s, decode_s)
            del br
        del dyn
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _outcome(self, method, br, new, input_ids, shared_prefill_s, decode_s) -> Outcome:
        text = self.tokenizer.decode(new[0], skip_special_tokens=True)
        kv = kv_fields(br.cache, self.model.config)
        return Outcome(method, new, text, int(input_ids.shape[1]), kv, shared_prefill_s, decode_s, br)

    def warm_up(self, methods: list[Method]) -> None:
        """Run every method once on a short prompt, untimed: first-call costs (encoder loading, optimum-quanto's
        extension) would otherwise land in the first case's timings."""
        request = Request(WARM_UP_CONTEXT + "\nQuestion: what jumps?", WARM_UP_CONTEXT, "what jumps?", "warmup")
        for _ in self.run(request, methods, 3, stop_ids=[]):
            pass
