"""Peak memory growth over a block of code: the CUDA allocator's peak on GPU, else the process RSS polled."""

from __future__ import annotations

import ctypes
import os
import threading

import torch


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
