"""Planning: where each prompt's context lies, how it is cut into chunks, and which precision each chunk gets.

No transformers and no model here: plans are plain data built from a tokenizer's offsets and the chunk scores.
Shapes: L prompt tokens (after left padding), C chunk size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hf_cocktail.storage.quant import CHUNK_BITS

# token positions and prompt ids a cache holds for as long as it lives: 4 bytes each (prompts and vocabularies
# stay below 2**31), half of int64's, which cost Gemma 3 270M 0.005x of its quantized layers' FP16 bytes (issue 46)
INDEX_DTYPE = torch.int32


@dataclass
class SequencePlan:
    """What the search needs and decides for one sequence of the batch (positions in padded coordinates)."""

    pad: int  # left padding tokens
    ctx_start: int  # context token span [ctx_start, ctx_end)
    ctx_end: int
    chunk_texts: list[str]
    query: str | None
    scores: list[float] | None = None
    bits: list[int] | None = None  # one per chunk, original order
    positions: dict = field(default_factory=dict)  # part ("full", 4, 2) -> LongTensor of prompt positions
    origin: int = 0  # index of the prepared prompt this row comes from (beams / return sequences repeat it)
    query_span: tuple[int, int] = (0, 0)  # token span of the query inside the prompt (scorer="attention")
    attn_mass: torch.Tensor | None = None  # (ctx_end - ctx_start,) attention mass from the query tokens
    layer_mass: dict = field(default_factory=dict)  # salient_tokens: layer -> mass from the tokens after the context
    layer_salient: dict = field(default_factory=dict)  # salient_tokens: layer -> its salient positions (from the mass)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_texts)

    def chunk_range(self, i: int, chunk_size: int) -> tuple[int, int]:
        a = self.ctx_start + i * chunk_size
        return a, min(a + chunk_size, self.ctx_end)

    def chunk_sizes(self, chunk_size: int) -> list[int]:
        return [b - a for a, b in (self.chunk_range(i, chunk_size) for i in range(self.num_chunks))]

    def decided_bits(self) -> list[int]:
        """``bits``, once the search (or ``set_precisions``) decided them; a RuntimeError before."""
        if self.bits is None:
            raise RuntimeError("this sequence's chunk precisions are not decided yet: run the search or set_precisions")
        return self.bits

    def build_positions(self, prefill_len: int, chunk_size: int, packed_bits: Sequence[int] = (4, 2)) -> None:
        """Positions of each part (``"full"`` and each of ``packed_bits``) among the first ``prefill_len`` prompt
        tokens (later ones are appended as new tokens to the full-precision part)."""
        if prefill_len < self.ctx_end:
            raise RuntimeError(
                f"the prefill covers {prefill_len} tokens but the context ends at token "
                f"{self.ctx_end}: the whole context must be in the prefill"
            )
        parts: dict = {16: [], **{b: [] for b in packed_bits}}
        for i, bits in enumerate(self.bits or []):
            if bits not in parts:
                raise ValueError(f"chunk {i} has {bits} bits, not one of the store's precisions {(16, *packed_bits)}")
            parts[bits].extend(range(*self.chunk_range(i, chunk_size)))
        full = list(range(self.pad, self.ctx_start)) + parts[16] + list(range(self.ctx_end, prefill_len))
        self.positions = {
            "full": torch.tensor(full, dtype=INDEX_DTYPE),
            **{b: torch.tensor(parts[b], dtype=INDEX_DTYPE) for b in packed_bits},
        }

    def all_full_positions(self, prefill_len: int, packed_bits: Sequence[int] = (4, 2)) -> dict:
        """Positions for a layer kept entirely at full precision (``full_precision_layers``)."""
        empty = torch.zeros(0, dtype=INDEX_DTYPE)
        return {"full": torch.arange(self.pad, prefill_len, dtype=INDEX_DTYPE), **{b: empty for b in packed_bits}}


def token_span(offsets: torch.Tensor, mask: torch.Tensor, first: int, char_start: int, char_end: int) -> list[int]:
    """Tokens at or after ``first`` whose characters lie inside ``[char_start, char_end)``; ``offsets (L, 2)``."""
    a, b = offsets[first:, 0], offsets[first:, 1]
    inside = mask[first:].bool() & (b > a) & (a >= char_start) & (b <= char_end)
    return (inside.nonzero().flatten() + first).tolist()


def context_span(
    prompt: str,
    context: str | None,
    offsets: torch.Tensor,
    mask: torch.Tensor,
    pad: int,
    sink_tokens: int,
    recent_tokens: int,
    row: int,
) -> tuple[int, int]:
    """Token span ``[start, end)`` of ``context`` in ``prompt`` minus the protected tokens (the first
    ``sink_tokens`` of the prompt and the last ``recent_tokens`` of the context); ``(pad, pad)`` without a context."""
    if not context:
        return pad, pad
    c0 = prompt.find(context)
    n = _occurrences(prompt, context, c0)
    if n > 1:
        raise ValueError(
            f"contexts[{row}] appears {n} times in prompts[{row}]: the cache cannot tell which occurrence is the "
            "document to chunk; give a context that appears once (e.g. longer), or a prompt with one copy"
        )
    if c0 < 0:
        raise ValueError(
            f"contexts[{row}] was not found in prompts[{row}]: the context must appear verbatim "
            f"in its prompt (got a context of {len(context)} characters)"
        )
    inside = token_span(offsets, mask, pad, c0, c0 + len(context))
    if not inside:
        return pad, pad
    cs, ce = inside[0], inside[-1] + 1
    cs = min(max(cs, pad + sink_tokens), ce)
    if recent_tokens and ce - cs <= recent_tokens:
        raise ValueError(
            f"recent_tokens={recent_tokens} keeps the last {recent_tokens} context tokens at full precision but "
            f"contexts[{row}] has only {ce - cs} token(s) after the sink tokens: nothing would be quantized; lower "
            "recent_tokens (or use uniform_bits=16 for a cache at full precision)"
        )
    return cs, ce - recent_tokens


def prompt_context_span(pad: int, length: int, sink_tokens: int, residual_tokens: int) -> tuple[int, int]:
    """The context of a prompt given without ``prepare_inputs``: its real tokens ``[pad, length)`` after the first
    ``sink_tokens`` and before the last ``residual_tokens`` (chunked from its start; the last chunk may be partial),
    so that every row of a left-padded batch ends its context at the same token; ``(pad, pad)`` when none is left."""
    start, end = pad + sink_tokens, length - residual_tokens
    return (start, end) if end > start else (pad, pad)


def _occurrences(text: str, part: str, first: int) -> int:
    """How many times ``part`` occurs in ``text`` (overlaps counted), from its first occurrence ``first``."""
    n, i = 0, first
    while i >= 0:
        n += 1
        i = text.find(part, i + 1)
    return n


def query_span(
    prompt: str, text: str, offsets: torch.Tensor, mask: torch.Tensor, pad: int, after: int, name: str
) -> tuple[int, int]:
    """Token span of the last occurrence of ``text`` in ``prompt`` at or after token ``after``."""
    c0 = prompt.rfind(text) if text else -1
    toks = token_span(offsets, mask, max(pad, after), c0, c0 + len(text)) if c0 >= 0 else []
    if not toks:
        raise ValueError(
            f"{name} must appear verbatim in its prompt after the context for scorer='attention' "
            f"(its tokens are the ones whose attention scores the chunks); got {text!r}"
        )
    return toks[0], toks[-1] + 1


def chunk_texts(prompt: str, offsets: torch.Tensor, start: int, end: int, chunk_size: int) -> list[str]:
    """The text of each chunk of tokens ``[start, end)``: the prompt's own characters, cut with the tokenizer's
    ``offsets (L, 2)``, never a decode of token ids (a byte-level token slice can cut a character in two, and a
    normalizing tokenizer would give lowercased or ``[UNK]`` text).

    Chunk ``i`` ends where its last token ends; the characters between two chunks (spaces) open the next chunk, and
    a character whose bytes straddle a chunk edge goes to the chunk that ends with any of its bytes. So the texts,
    concatenated, are exactly ``prompt[offsets[start, 0]:offsets[end - 1, 1]]``.
    """
    if end <= start:
        return []
    cuts = [int(offsets[start, 0])]
    for a in range(start, end, chunk_size):
        cuts.append(max(cuts[-1], int(offsets[min(a + chunk_size, end) - 1, 1])))
    return [prompt[a:b] for a, b in zip(cuts, cuts[1:])]


def bits_cost(packed_bits_per_element: Callable[[int], float], full_bits: float = 16.0) -> dict[int, float]:
    """Storage bits per element of each chunk precision (the FP16 tier counted at ``full_bits``)."""
    return {16: float(full_bits), **{b: packed_bits_per_element(b) for b in (4, 3, 2)}}


def plan_bits_per_element(plan: SequencePlan, chunk_size: int, cost: dict[int, float]) -> float:
    """Average storage bits per context element of ``plan`` (0 without a context)."""
    sizes = plan.chunk_sizes(chunk_size)
    total = sum(sizes)
    return sum(cost[x] * n for x, n in zip(plan.bits or [], sizes)) / total if total else 0.0


def check_bits_rows(
    bits: Sequence[Sequence[int]], plans: Sequence[SequencePlan], allowed: Sequence[int] = (16, 4, 2)
) -> list[list[int]]:
    """Validate imposed precisions: one row per plan, one entry per chunk, each in ``allowed`` (the store's
    precisions, a subset of ``CHUNK_BITS``)."""
    if len(bits) != len(plans):
        raise ValueError(f"bits must have one list per sequence ({len(plans)}), got {len(bits)}")
    rows = []
    for b, (plan, row) in enumerate(zip(plans, bits)):
        row = [int(x) for x in row]
        if len(row) != plan.num_chunks:
            raise ValueError(f"bits[{b}] must have {plan.num_chunks} entries (one per chunk), got {len(row)}")
        bad = sorted({x for x in row if x not in allowed or x not in CHUNK_BITS})
        if bad:
            raise ValueError(f"bits[{b}] values must be one of {tuple(allowed)}, got {bad}")
        rows.append(row)
    return rows


def assign_precisions(scores: torch.Tensor, alpha: float, beta: float, low_bits: int = 2) -> list[int]:
    """The paper's thresholds: ``T_low = s_min + alpha*(s_max-s_min)``, ``T_high = s_max - beta*(s_max-s_min)``;
    ``s > T_high`` -> 16, ``T_low < s <= T_high`` -> 4, else ``low_bits`` (2 in the paper).

    When every score is equal the range is 0 and, as the formula says, every chunk gets ``low_bits``.
    """
    if scores.numel() == 0:
        return []
    s = scores if scores.is_floating_point() else scores.double()
    smin, smax = s.min(), s.max()
    t_low = smin + alpha * (smax - smin)
    t_high = smax - beta * (smax - smin)
    bits = torch.full_like(s, low_bits, dtype=torch.long)
    bits[(s > t_low) & (s <= t_high)] = 4
    bits[s > t_high] = 16
    return bits.tolist()


def assign_budget(
    scores: torch.Tensor,
    sizes: Sequence[int],
    target_bits: float,
    beta: float,
    bits_cost: dict[int, float],
    low_bits: int = 2,
) -> list[int]:
    """Budget mode: meet an average of ``target_bits`` per context element as closely as possible from below.

    Chunks with ``s > T_high`` (``T_high = s_max - beta*(s_max-s_min)``) get FP16 in rank order while affordable; then
    INT4 goes to the best-ranked remaining chunks while affordable, the rest stay at ``low_bits`` (INT2 or INT3);
    budget still left once every chunk is INT4 promotes the best-ranked INT4 chunks to FP16.

    Args:
        scores: ``(n,)`` chunk scores.
        sizes: tokens per chunk (the last chunk may be partial).
        bits_cost: storage bits per element of each precision, e.g. ``{16: 16, 4: 5, 3: 4, 2: 3}``.
    """
    n = scores.numel()
    if n == 0:
        return []
    s = scores if scores.is_floating_point() else scores.double()
    order = torch.argsort(s, descending=True, stable=True).tolist()
    t_high = s.max() - beta * (s.max() - s.min())
    low = low_bits
    bits = [low] * n
    left = target_bits * sum(sizes) - bits_cost[low] * sum(sizes) + 1e-9
    for i in order:
        if s[i] > t_high and (bits_cost[16] - bits_cost[low]) * sizes[i] <= left:
            bits[i] = 16
            left -= (bits_cost[16] - bits_cost[low]) * sizes[i]
    for i in order:
        if bits[i] == low and (bits_cost[4] - bits_cost[low]) * sizes[i] <= left:
            bits[i] = 4
            left -= (bits_cost[4] - bits_cost[low]) * sizes[i]
    for i in order:  # budget left once everything is INT4: promote the best-ranked chunks to FP16
        if bits[i] == 4 and (bits_cost[16] - bits_cost[4]) * sizes[i] <= left:
            bits[i] = 16
            left -= (bits_cost[16] - bits_cost[4]) * sizes[i]
    return bits


def promote_neighbors(bits: list[int], k: int) -> list[int]:
    """Chunks within ``k`` positions of an FP16 chunk become FP16 too."""
    if k <= 0:
        return list(bits)
    out = list(bits)
    for i, b in enumerate(bits):
        if b == 16:
            for j in range(max(0, i - k), min(len(bits), i + k + 1)):
                out[j] = 16
    return out


@dataclass(frozen=True)
class PlanView:
    """A read-only copy of one sequence's plan (``CocktailCache.plans``): where its context lies and, after the
    search, each chunk's score and precision."""

    pad: int
    ctx_start: int
    ctx_end: int
    chunk_texts: tuple[str, ...]
    query: str | None
    query_span: tuple[int, int]
    scores: tuple[float, ...] | None
    bits: tuple[int, ...] | None
    attn_mass: torch.Tensor | None  # scorer="attention": a copy of the per-context-token attention mass

    @classmethod
    def of(cls, plan: SequencePlan) -> PlanView:
        return cls(
            plan.pad,
            plan.ctx_start,
            plan.ctx_end,
            tuple(plan.chunk_texts),
            plan.query,
            plan.query_span,
            None if plan.scores is None else tuple(plan.scores),
            None if plan.bits is None else tuple(plan.bits),
            None if plan.attn_mass is None else plan.attn_mass.clone(),
        )

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_texts)

    def chunk_range(self, i: int, chunk_size: int) -> tuple[int, int]:
        """Token span ``[start, end)`` of chunk ``i``."""
        a = self.ctx_start + i * chunk_size
        return a, min(a + chunk_size, self.ctx_end)
