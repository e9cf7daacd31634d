"""One window through every method: the prompt is prefilled once at full precision and branched into each method's
cache (as ``eval.kld`` does); the continuation is teacher-forced through the cache, and each position's
distribution is scored against the true next token (negative log-likelihood) and against FP16's distribution at the
same position (KL(P_fp16 || P_method), top-1 agreement).

The first continuation token is predicted by the shared full-precision prefill (every cache attends at full
precision during its own prefill), the same for every method, so it is not scored: positions 1..n-1 are, each
predicted after the whole prompt sits in the method's cache."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from hf_cocktail.calibrate.divergence import kl_and_top1, teacher_force

from ..kld.measure import REFERENCE, encoder_keys, memoized_encoders
from ..methods.branching import branch, context_end, prefill_for
from ..methods.kinds import Method
from ..models import model_input_device
from ..runner import kv_fields
from .windows import Window


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per position ``-log P(target)`` in nats (float64), ``logits (n, V)``, ``targets (n,)``."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    return -lp.gather(-1, targets.to(lp.device).view(-1, 1)).squeeze(-1)


class PplRunner:
    """Measures windows with one model."""

    def __init__(self, model, tok, encoder: str | None = None):
        self.model, self.tok, self.encoder = model, tok, encoder
        self.device = model_input_device(model)

    def run(self, window: Window, methods: list[Method]) -> Iterator[dict]:
        """Yield one record per method (see the module docstring)."""
        with memoized_encoders(encoder_keys(methods, self.encoder)):
            yield from self._run(window, methods)

    @torch.no_grad()
    def _run(self, window: Window, methods: list[Method]) -> Iterator[dict]:
        model, tok, req = self.model, self.tok, window.request
        input_ids = tok(req.prompt, return_tensors="pt", **req.tokenizer_kwargs)["input_ids"].to(self.device)
        cont = torch.tensor([window.continuation], device=self.device)
        fed, targets = cont[:, :-1], cont[0, 1:]
        t0 = time.perf_counter()
        dyn, _, queries = prefill_for(model, tok, input_ids, req, methods, context_end(tok, req))
        prefill_s = time.perf_counter() - t0
        ref = teacher_force(model, branch(REFERENCE, model, tok, dyn, input_ids, req).cache, fed, False)
        ref_nll = token_nll(ref, targets)
        base = {
            "window": window.key,
            "source": window.source,
            "offset": window.offset,
            "prompt_tokens": int(input_ids.shape[1]),
            "scored_tokens": int(targets.shape[0]),
            "shared_prefill_s": round(prefill_s, 3),
        }
        for method in methods:
            t1 = time.perf_counter()
            br = branch(method, model, tok, dyn, input_ids, req, self.encoder, prefill_queries=queries)
            logits = teacher_force(model, br.cache, fed)
            nll = token_nll(logits, targets)
            kl, agree = kl_and_top1(ref, logits)
            yield {
                **base,
                "method": method.name,
                "nll": float(nll.mean()),
                "nll_fp16": float(ref_nll.mean()),
                "kl": float(kl.mean()),
                "top1": float(agree.double().mean()),
                **kv_fields(br.cache, model.config),
                "precision_counts": br.precision_counts,
                "method_s": round(time.perf_counter() - t1, 3),
            }
            del br
        del dyn
