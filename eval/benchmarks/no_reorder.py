"""The "no reorder" ablation of Cocktail's decode attention.

Cocktail stores the chunks of one precision contiguously (a *segment*) so that decode attention runs one Q·K and one
P·V per precision. The ablation attends chunk by chunk in the original order instead (one dequantize + matmul per
chunk). Both are timed on the real layer-0 store of a Cocktail cache (PyTorch reference path, one decode query), and
their outputs are checked to agree.

It reads the cache's layer store (``cache.layers[0].store``: the full-precision part and the packed segments), the
object the library's attention functions take.
"""

from __future__ import annotations

import time

import torch

from hf_cocktail import CocktailCache
from hf_cocktail.decode.split_attention import split_precision_attention_torch
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.storage import quant

from ..essays import essay_prefix
from ..methods.registry import METHODS
from .harness import QUESTION, make_prompt


def _dequantized_chunk(seg, i: int, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of chunk ``i`` of a packed segment (sequence 0), dequantized."""
    a, e = i * chunk_size, min((i + 1) * chunk_size, seg.tok_off[1])
    k = quant.dequantize_keys(
        seg.k_codes[:, a:e], seg.k_scale[:, i : i + 1], seg.k_zero[:, i : i + 1], seg.bits, chunk_size
    )
    v = quant.dequantize_values(
        seg.v_codes[:, a:e], seg.v_scale[:, a:e], seg.v_zero[:, a:e], seg.value_bits, seg.group_size
    )
    return k, v


def per_chunk_attention(query, store, bits: list[int], chunk_size: int, scaling: float) -> torch.Tensor:
    """Decode attention without reordering: every packed context chunk dequantized and attended on its own, in the
    original order (sequence 0 only). Same maths as ``split_precision_attention_torch``: the full-precision part
    (prefix, FP16 chunks, suffix, generated tokens) is attended as one block, the ablation is about the packed
    chunks."""
    B, H_q, Lq, D = query.shape
    H_kv = store.full.shape[1]
    q = query[0].float().reshape(H_kv, (H_q // H_kv) * Lq, D) * scaling
    seg = {s.bits: s for s in store.segments}
    s0 = store.full.start[0]
    full_k, full_v = store.full.keys, store.full.values  # an 8-bit full part dequantizes once
    blocks = [(full_k[0, :, s0:].float(), full_v[0, :, s0:].float())]
    pos = dict.fromkeys((16, 4, 3, 2), 0)  # next chunk index within each precision
    for b in bits:  # original order
        i = pos[b]
        pos[b] += 1
        if b != 16:  # FP16 chunks live in the full part
            blocks.append(_dequantized_chunk(seg[b], i, chunk_size))
    scores = [q @ k.transpose(1, 2) for k, _ in blocks]
    p = torch.softmax(torch.cat(scores, -1), -1)
    o = torch.zeros(H_kv, q.shape[1], D)
    off = 0
    for s, (_, v) in zip(scores, blocks):
        T = s.shape[-1]
        o += p[..., off : off + T] @ v
        off += T
    return o.reshape(1, H_q, Lq, D)


def _time_ms(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1000 * (time.perf_counter() - t0) / repeats


def _cocktail_after_prefill(model, tok, context: str) -> tuple[CocktailCache, int]:
    prompt, kw = make_prompt(tok, context)
    cache = CocktailCache(METHODS["cocktail"].cocktail_config())
    inputs = cache.prepare_inputs(tok, prompt, contexts=context, queries=QUESTION, **kw)
    with torch.no_grad():
        model(**inputs, **cache_kwargs(model, cache), logits_to_keep=1)
    return cache, int(inputs["input_ids"].shape[1])


def no_reorder_ablation(model, tok, contexts: list[int], essay_dir=None, repeats: int = 20) -> list[dict]:
    out = []
    for c in contexts:
        cache, n_tokens = _cocktail_after_prefill(model, tok, essay_prefix(tok, c, essay_dir))
        store = cache.layers[0].store
        bits = cache.precision_map()[0]
        cfg = model.config
        H_q, D = cfg.num_attention_heads, getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
        q = torch.randn(1, H_q, 1, D, generator=torch.Generator().manual_seed(0))
        scaling = D**-0.5
        chunk = cache.config.chunk_size
        ref = split_precision_attention_torch(q, store, scaling)
        err = float((ref - per_chunk_attention(q, store, bits, chunk, scaling)).abs().max())
        if err > 1e-4:
            raise RuntimeError(f"no-reorder attention disagrees with the segment attention (max err {err})")
        segments_ms = _time_ms(lambda: split_precision_attention_torch(q, store, scaling), repeats)
        per_chunk_ms = _time_ms(lambda: per_chunk_attention(q, store, bits, chunk, scaling), repeats)
        out.append(
            {
                "context_tokens": n_tokens,
                "chunks": len(bits),
                "packed_chunks": sum(b != 16 for b in bits),
                "segments_ms": segments_ms,
                "per_chunk_ms": per_chunk_ms,
                "max_abs_diff": err,
            }
        )
        del cache
    return out
