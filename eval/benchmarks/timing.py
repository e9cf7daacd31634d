"""One timed ``model.generate`` (time to the first token, time per later token) and the peak memory growth of each
phase: the CUDA allocator's peak on GPU, else the process RSS polled."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import torch

from hf_cocktail.integration.compat import cache_kwargs

from ..methods.branching import GREEDY


def mean_ms(fn, reps: int) -> float:
    """Milliseconds per call of ``fn``: one untimed call, then the mean of ``reps`` calls."""
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PeakMemory:
    """Peak memory growth over a block: CUDA allocated bytes on GPU, else the process RSS polled every ~2 ms (glibc's
    free memory is trimmed first so that the baseline is the memory really in use). ``mark()`` starts a second
    phase, whose peak is reported separately (e.g. decode after prefill)."""

    def __init__(self, device):
        self.cuda = getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available()
        self.peaks = [0, 0]
        self.phase = 0

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        self.base = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            r = self._rss() - self.base
            if r > self.peaks[self.phase]:
                self.peaks[self.phase] = r
            self._stop.wait(0.002)

    def mark(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peaks[0] = torch.cuda.max_memory_allocated() - self.base
            torch.cuda.reset_peak_memory_stats()
        else:
            r = self._rss() - self.base
            self.peaks[0] = max(self.peaks[0], r)
        self.phase = 1

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peaks[self.phase] = max(self.peaks[self.phase], torch.cuda.max_memory_allocated() - self.base)
        else:
            self._stop.set()
            self._thread.join()
            self.peaks[self.phase] = max(self.peaks[self.phase], self._rss() - self.base)
        return False

    @property
    def peak(self) -> int:
        return max(self.peaks)


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
                **GREEDY,
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
