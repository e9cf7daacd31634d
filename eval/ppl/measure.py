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

from ..kld.measure import REFERENCE, ForcedRunner
from ..methods.branching import branch, context_end
from ..methods.kinds import Method
from .windows import Window


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per position ``-log P(target)`` in nats (float64), ``logits (n, V)``, ``targets (n,)``."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    return -lp.gather(-1, targets.to(lp.device).view(-1, 1)).squeeze(-1)


class PplRunner(ForcedRunner):
    """Measures windows with one model."""

    @torch.no_grad()
    def _run(self, window: Window, methods: list[Method]) -> Iterator[dict]:
        model, tok, req = self.model, self.tok, window.request
        cont = torch.tensor([window.continuation], device=self.device)
        fed, targets = cont[:, :-1], cont[0, 1:]
        input_ids, dyn, _, queries, prefill_s = self.shared_prefill(req, methods, context_end(tok, req))
        ref = teacher_force(model, branch(REFERENCE, model, tok, dyn, input_ids, req).cache, fed, False)
        ref_nll = token_nll(ref, targets)
        base = {
            "window": window.key,
            "source": window.source,
            "offset": window.offset,
            "prompt_tokens": int(input_ids.shape[1]),
            "scored_tokens": int(targets.shape[0]),
            "shared_prefill_s": prefill_s,
        }
        for method in methods:
            t1 = time.perf_counter()
            logits, size = self.forced(method, dyn, input_ids, req, queries, fed)
            nll = token_nll(logits, targets)
            kl, agree = kl_and_top1(ref, logits)
            yield {
                **base,
                "method": method.name,
                "nll": float(nll.mean()),
                "nll_fp16": float(ref_nll.mean()),
                "kl": float(kl.mean()),
                "top1": float(agree.double().mean()),
                **size,
                "method_s": round(time.perf_counter() - t1, 3),
            }
        del dyn
