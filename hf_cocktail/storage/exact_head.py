"""The exact head of an 8-bit full part: its first tokens of every sequence (the prompt's attention sinks, the first
``CocktailConfig.sink_tokens``) kept at the model's precision beside their 8-bit codes, which readers then ignore.

Most of a query's attention can rest on those few tokens, so an error in their keys moves every other token's weight.
Measured on Gemma 3 270M (2K tokens, every global-layer key at 8 bits per token, centred and rotated, values
exact): KL divergence from FP16 4.4e-5 with the first 4 tokens 8-bit too, 1.2e-5 with them exact (the lab log,
issue 46). They cost ``4 * D * 2 * 2`` bytes per sequence and head.

Shapes: B sequences, H_kv key/value heads, S head tokens (the same for every sequence), R tokens of the part
(right-aligned: sequence ``b`` owns ``[start[b], R)``, its head ``[start[b], start[b] + S)``), D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExactHead:
    """``keys``, ``values``: ``(B, H_kv, S, D)`` at the model's precision, keys in the layer's basis (not the 8-bit
    part's own key basis)."""

    keys: torch.Tensor
    values: torch.Tensor

    @classmethod
    def from_sequences(cls, ks: list[torch.Tensor], vs: list[torch.Tensor], count: int) -> ExactHead | None:
        """The first ``count`` tokens of each ``ks[b]``, ``vs[b]`` ``(H_kv, R_b, D)`` (fewer where a sequence has
        fewer: every sequence keeps the same number); None when that is 0."""
        n = min([count, *(k.shape[1] for k in ks)])
        if n <= 0:
            return None
        return cls(torch.stack([k[:, :n] for k in ks]), torch.stack([v[:, :n] for v in vs]))

    @property
    def count(self) -> int:
        return self.keys.shape[2]

    def overlay(self, x: torch.Tensor, which: str, start: list[int], at: int = 0) -> torch.Tensor:
        """``x (B, H_kv, n, D)``, the part's tokens ``[at, at + n)``, with the head's rows in place of their codes'
        (``which``: ``"k"`` or ``"v"``); ``x`` itself where no head token lies in that range."""
        head = self.keys if which == "k" else self.values
        n, S = x.shape[2], self.count
        out = x
        for b, s in enumerate(start):
            lo, hi = max(s, at), min(s + S, at + n)
            if lo < hi:
                if out is x:
                    out = x.clone()
                out[b, :, lo - at : hi - at] = head[b, :, lo - s : hi - s].to(x.dtype)
        return out

    def truncated(self, room: int) -> ExactHead | None:
        """The head after the part lost its last tokens, leaving ``room`` tokens after the latest start (``R -
        max(start)``): at most that many head tokens stay; None when none does."""
        if room >= self.count:
            return self
        return None if room <= 0 else ExactHead(self.keys[:, :, :room], self.values[:, :, :room])

    def select(self, indices: list[int]) -> ExactHead:
        idx = torch.tensor(indices, dtype=torch.long, device=self.keys.device)
        return ExactHead(self.keys.index_select(0, idx), self.values.index_select(0, idx))

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def deployed_bytes(self) -> int:
        """Bytes in an FP16 deployment: 2 per key/value element whatever the dtype here."""
        return 2 * (self.keys.numel() + self.values.numel())
