"""One timed ``model.generate``: time to the first token (prefill), time per later token (decode), peak memory of
each phase."""

from __future__ import annotations

import time

import torch

from hf_cocktail.integration.compat import cache_kwargs

from .peak_memory import PeakMemory, cuda_sync


class FirstTokenTimer:
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


def timed_generate(model, cache, inputs, new_tokens: int, pad_token_id: int | None) -> dict:
    """Greedy ``generate`` of exactly ``new_tokens`` tokens with ``cache``; returns the new-token count, prefill
    seconds, decode milliseconds per token and the peak memory growth of both phases."""
    L = int(inputs["input_ids"].shape[1])
    with PeakMemory(inputs["input_ids"].device) as pm:
        timer = FirstTokenTimer(pm)
        cuda_sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                **inputs,
                **cache_kwargs(model, cache),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                streamer=timer,
                pad_token_id=pad_token_id,
            )
        cuda_sync()
        t1 = time.perf_counter()
    n = int(out.shape[1]) - L
    return {
        "context_tokens": L,
        "new_tokens": n,
        "prefill_s": timer.t_first - t0,
        "decode_ms_per_token": 1000 * (t1 - timer.t_first) / max(1, n - 1),
        "peak_prefill_bytes": pm.peaks[0],
        "peak_decode_bytes": pm.peaks[1],
    }
