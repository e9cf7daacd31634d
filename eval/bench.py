"""Shared measurement of ``eval/bench_memory.py`` and ``eval/bench_latency.py``: one plain ``model.generate`` per
(method, context length) on a Paul Graham haystack, timing prefill (to the first token) and decode separately and
tracking KV bytes and peak memory."""

from __future__ import annotations

import os
import time

from eval.common import (DATA_DIR, PeakMemory, UsageError, cache_kv_bytes, cuda_sync, fp16_kv_bytes,
                         model_input_device)

QUESTION = "What is the main point of these essays?"


def haystack_context(tok, n_tokens: int, essay_dir: str | None = None) -> str:
    essay_dir = essay_dir or os.path.join(DATA_DIR, "paul_graham_essays")
    if not os.path.isdir(essay_dir):
        raise UsageError(f"Paul Graham essays not found at {essay_dir} (--essay-dir)")
    text = "\n\n".join(open(os.path.join(essay_dir, f), encoding="utf-8").read().strip()
                       for f in sorted(os.listdir(essay_dir)) if f.endswith(".txt"))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise UsageError(f"the essays have {len(ids)} tokens, fewer than the context {n_tokens}")
    return tok.decode(ids[:n_tokens])


def make_prompt(tok, context: str):
    content = context + "\n\nQuestion: " + QUESTION
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True), {"add_special_tokens": False}
    return content, {}


class _FirstTokenTimer:
    """A generate streamer noting when the first new token arrives (put #2: the prompt comes first)."""

    def __init__(self, peak: PeakMemory | None = None):
        self.calls = 0
        self.t_first = None
        self.peak = peak

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            cuda_sync()
            self.t_first = time.perf_counter()
            if self.peak is not None:
                self.peak.mark()

    def end(self):
        pass


def measure(method, model, tok, context: str, new_tokens: int, encoder: str | None = None) -> dict:
    """Run ``generate`` with ``method``'s cache over ``context`` for exactly ``new_tokens`` tokens."""
    import torch
    from transformers import DynamicCache

    from eval.methods import plain_cache

    prompt, kw = make_prompt(tok, context)
    cache, inputs = plain_cache(method, model, tok, prompt, context, QUESTION, "bench", kw, encoder)
    if cache is None:
        cache = DynamicCache(config=model.config)
    dev = model_input_device(model)
    inputs = inputs.to(dev)
    L = int(inputs["input_ids"].shape[1])
    with PeakMemory(dev) as pm:
        timer = _FirstTokenTimer(pm)
        cuda_sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**inputs, past_key_values=cache, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None,
                                 top_k=None, streamer=timer, pad_token_id=tok.eos_token_id)
        cuda_sync()
        t1 = time.perf_counter()
    n = int(out.shape[1]) - L
    seq = int(cache.get_seq_length())
    res = {"method": method.name, "context_tokens": L, "new_tokens": n, "prefill_s": timer.t_first - t0,
           "decode_ms_per_token": 1000 * (t1 - timer.t_first) / max(1, n - 1),
           "kv_bytes": cache_kv_bytes(cache), "kv_bytes_in_memory": cache_kv_bytes(cache, deployed=False),
           "fp16_kv_bytes": fp16_kv_bytes(model.config, seq), "peak_prefill_bytes": pm.peaks[0],
           "peak_decode_bytes": pm.peaks[1]}
    res["kv_ratio"] = res["kv_bytes"] / res["fp16_kv_bytes"]
    if hasattr(cache, "memory_report"):
        res["chunks"] = cache.memory_report()["chunks"]
    del cache, out
    return res
