"""One prompt through every method: the shared full-precision prefill, FP16's greedy answer, and two teacher-forced
segments per method compared with FP16 at the same positions.

* ``answer``: the whole prompt is prefilled once at full precision (``DynamicCache``) and branched into every
  method's cache, exactly as ``eval.longbench`` does; FP16's greedy answer ``a[0..n-1]`` (at most
  ``max_answer_tokens``, stopped at EOS) is fed as ``a[0..n-2]`` in one forward (token by token where that is not
  equivalent, :func:`hf_cocktail.calibrate.divergence.needs_steps`). The logits at those ``n-1`` positions (predicting
  ``a[1..n-1]``) are compared with FP16's. ``a[0]`` itself comes from the prefill's logits, identical for every
  method (every cache attends at full precision during its own prefill), so it is not scored.
* ``tail``: the same prefill cut to the prompt minus its last ``k`` tokens is branched into every method (every
  cache is built from the same prefix, at full precision); the last ``k`` prompt tokens and then ``a[0..n-2]`` are fed
  through it. Its ``k + n - 1`` positions (predicting the prompt's last ``k - 1`` tokens, ``a[0]``, then
  ``a[1..n-1]``) also see the last prompt tokens' keys/values computed over the method's quantized context.
  ``k = min(tail_tokens, prompt tokens after the context)``: the prefix always covers the whole context, so the
  Cocktail kinds quantize the same chunks in both segments (for LongBench code tasks the prompt ends a few tokens
  after the code, and ``k`` is smaller).

FP16's logits are the teacher-forced logits of a fresh ``DynamicCache`` branch (the ``fp16`` method repeats the same
computation: its KL divergence is exactly 0).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from hf_cocktail.calibrate.divergence import kl_and_top1, teacher_force
from hf_cocktail.planning.scoring import get_encoder

from ..methods.branching import branch, context_end, filled_cache, generate_from_branch, prefill, prefill_for
from ..methods.kinds import CocktailMethod, DynamicMethod, Method, Request, is_sliding_layer, prefill_items
from ..models import eos_token_ids, model_input_device
from ..runner import kv_fields
from .cases import KldCase

REFERENCE = DynamicMethod("fp16_reference", "DynamicCache: the FP16 reference of the comparison")


def reference_answer(model, tok, dyn, first_logits, input_ids, request: Request, max_answer_tokens: int, eos):
    """FP16's greedy answer ``(1, n)`` continuing the shared prefill ``dyn``, and FP16's teacher-forced logits
    ``(n - 1, V)`` over ``answer[:, :-1]`` (each from a fresh ``DynamicCache`` branch)."""
    ref = branch(REFERENCE, model, tok, dyn, input_ids, request)
    answer = generate_from_branch(model, ref.cache, input_ids, first_logits, max_answer_tokens, eos_token_id=eos)
    del ref
    logits = teacher_force(model, branch(REFERENCE, model, tok, dyn, input_ids, request).cache, answer[:, :-1], False)
    return answer, logits


def encoder_keys(methods: list[Method], encoder: str | None) -> set[tuple]:
    """``(name, device, batch size)`` of the retrieval encoders the methods' searches call (Cocktail kinds scoring
    with the encoder; uniform precisions and BM25 call none)."""
    keys = set()
    for m in methods:
        if isinstance(m, CocktailMethod):
            cfg = m.cocktail_config(encoder)
            if cfg.uniform_bits is None and cfg.scorer == "encoder":
                keys.add((cfg.encoder, cfg.encoder_device, cfg.encoder_batch_size))
    return keys


@contextlib.contextmanager
def memoized_encoders(keys: set[tuple]):
    """While open, the process's shared retrieval encoders (``hf_cocktail.planning.scoring.get_encoder``, the objects
    ``CocktailCache`` uses) return the embeddings they already computed for the same list of texts instead of
    recomputing them: every Cocktail kind of one case, in both segments, embeds the same query and chunks. The
    scores are the very same tensors, so the plans are unchanged; the searches of one case cost one encoder call
    instead of ~20 (~2 s each on this CPU)."""
    patched = []
    try:
        for key in sorted(keys, key=str):
            enc = get_encoder(*key)
            original, memo = enc.encode, {}

            def encode(texts, original=original, memo=memo):
                k = tuple(texts)
                if k not in memo:
                    memo[k] = original(texts)
                return memo[k]

            enc.encode = encode  # an instance attribute: shadows the method until removed
            patched.append(enc)
        yield
    finally:
        for enc in patched:
            del enc.encode


def prefix_prefill(model, dyn, input_ids: torch.Tensor, n: int) -> list:
    """The full-precision prefill of the prompt's first ``n`` tokens, as :func:`prefill_items` hands it to
    ``load_prefill``: the shared prefill ``dyn`` cut to ``n`` tokens; for a model with sliding-window layers (whose
    window at ``n`` tokens the whole prompt's prefill no longer holds) a prefill of those ``n`` tokens of its own."""
    if n == input_ids.shape[1]:
        return prefill_items(dyn)
    if any(is_sliding_layer(layer) for layer in dyn.layers):
        return prefill_items(prefill(model, input_ids[:, :n])[0])
    return [(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in dyn.layers]


def _pos_list(x: torch.Tensor, digits: int = 6) -> list:
    return [float(f"{v:.{digits}g}") for v in x.tolist()]


def _segment(prefix: str, ref: torch.Tensor, logits: torch.Tensor) -> dict:
    if ref.shape[0] == 0:
        return {
            f"kl_{prefix}": None,
            f"top1_{prefix}": None,
            f"n_{prefix}": 0,
            f"kl_{prefix}_pos": [],
            f"top1_{prefix}_pos": [],
        }
    kl, agree = kl_and_top1(ref, logits)
    return {
        f"kl_{prefix}": float(kl.mean()),
        f"top1_{prefix}": float(agree.double().mean()),
        f"n_{prefix}": int(kl.shape[0]),
        f"kl_{prefix}_max": float(kl.max()),
        f"kl_{prefix}_pos": _pos_list(kl),
        f"top1_{prefix}_pos": [int(a) for a in agree.tolist()],
    }


class ForcedRunner:
    """What ``eval.kld`` and ``eval.ppl`` measure with: one model, a case's prompt prefilled once and each method's
    branch of it teacher-forced, the retrieval encoders memoized over a case's methods (:func:`memoized_encoders`).
    A subclass yields a case's records from ``_run``."""

    def __init__(self, model, tok, encoder: str | None = None):
        self.model, self.tok, self.encoder = model, tok, encoder
        self.device = model_input_device(model)

    def run(self, case, methods: list[Method]) -> Iterator[dict]:
        """Yield one record per method (see the module docstrings)."""
        with memoized_encoders(encoder_keys(methods, self.encoder)):
            yield from self._run(case, methods)

    def _run(self, case, methods: list[Method]) -> Iterator[dict]:
        raise NotImplementedError

    def shared_prefill(self, req: Request, methods: list[Method], ctx_end: int) -> tuple:
        """The prompt's ids ``(1, L)``, its full-precision prefill (:func:`prefill_for`: cache, last logits, queries)
        and the seconds that took."""
        input_ids = self.tok(req.prompt, return_tensors="pt", **req.tokenizer_kwargs)["input_ids"].to(self.device)
        t0 = time.perf_counter()
        dyn, first_logits, queries = prefill_for(self.model, self.tok, input_ids, req, methods, ctx_end)
        return input_ids, dyn, first_logits, queries, round(time.perf_counter() - t0, 3)

    def forced(self, method: Method, dyn, input_ids, req: Request, queries, fed: torch.Tensor) -> tuple:
        """``method``'s branch of the shared prefill ``dyn`` fed ``fed`` ``(1, n)``: its teacher-forced logits
        ``(n, V)`` and the cache's size after (:func:`eval.runner.kv_fields` and ``precision_counts``)."""
        br = branch(method, self.model, self.tok, dyn, input_ids, req, self.encoder, prefill_queries=queries)
        logits = teacher_force(self.model, br.cache, fed)
        return logits, {**kv_fields(br.cache, self.model.config), "precision_counts": br.precision_counts}


class KldRunner(ForcedRunner):
    """Measures cases with one model."""

    def __init__(self, model, tok, encoder: str | None = None, max_answer_tokens: int = 32, tail_tokens: int = 16):
        super().__init__(model, tok, encoder)
        self.max_answer_tokens, self.tail_tokens = max_answer_tokens, tail_tokens
        self.eos = eos_token_ids(model, tok)

    @torch.no_grad()
    def _run(self, case: KldCase, methods: list[Method]) -> Iterator[dict]:
        model, tok, req = self.model, self.tok, case.request
        ctx_end = context_end(tok, req)
        input_ids, dyn, first_logits, queries, prefill_s = self.shared_prefill(req, methods, ctx_end)
        L = input_ids.shape[1]
        answer, ref_answer = reference_answer(
            model, tok, dyn, first_logits, input_ids, req, self.max_answer_tokens, self.eos
        )
        k = max(0, min(self.tail_tokens, L - ctx_end, L - 1))
        prefix_pairs = prefix_prefill(model, dyn, input_ids, L - k)
        answer_in = answer[:, :-1]
        tail_in = torch.cat([input_ids[:, L - k :], answer_in], dim=1)
        ref_tail = teacher_force(
            model, filled_cache(REFERENCE, model, tok, prefix_pairs, input_ids, req), tail_in, False
        )
        base = {
            "case": case.key,
            "source": case.source,
            "stratum": case.stratum,
            **case.meta,
            "prompt_tokens": L,
            "tail_tokens": k,
            "answer_tokens": int(answer.shape[1]),
            "answer_ids": answer[0].tolist(),
            "answer": tok.decode(answer[0], skip_special_tokens=True),
            # the teacher-forced FP16 logits predict FP16's own greedy answer (the alignment check on real data)
            "ref_top1_is_answer": float((ref_answer.argmax(-1) == answer[0, 1:].to(ref_answer.device)).double().mean())
            if answer_in.shape[1]
            else None,
            "shared_prefill_s": prefill_s,
        }
        for method in methods:
            t1 = time.perf_counter()
            logits_a, size = self.forced(method, dyn, input_ids, req, queries, answer_in)
            prefix_queries = None if queries is None else [q[:, :, : q.shape[2] - k] for q in queries]
            cache = filled_cache(method, model, tok, prefix_pairs, input_ids, req, self.encoder, prefix_queries)
            logits_t = teacher_force(model, cache, tail_in)
            del cache
            yield {
                **base,
                "method": method.name,
                **_segment("answer", ref_answer, logits_a),
                **_segment("tail", ref_tail, logits_t),
                **size,
                "method_s": round(time.perf_counter() - t1, 3),
            }
        del dyn
