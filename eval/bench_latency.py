"""Time per output token (and prefill time) of each method vs a DynamicCache at several context lengths, measured
in one run, plus the "no reorder" ablation of Cocktail's decode attention.

* end to end: one ``model.generate`` of ``--new-tokens`` per (context, method); prefill = time to the first token,
  decode = the rest divided by the decode steps; ratios against ``fp16`` of the same run.
* no reorder (``--no-reorder``, on by default): Cocktail stores the chunks of one precision contiguously (a
  *segment*) so that decode attention runs one Q·K and one P·V per precision. The ablation attends chunk by chunk in
  the original order instead (one dequantize + matmul per chunk). Both are timed on the real layer-0 store of a
  Cocktail cache at each context (PyTorch reference path), and their outputs are checked to agree.

    python eval/bench_latency.py --quick
    python eval/bench_latency.py --contexts 1024,2048,4096,8192 --methods fp16,cocktail,int4,int2,kivi2
"""

from __future__ import annotations

import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eval.bench_memory import _ratio, parse_args, run, save  # noqa: E402


def latency_table(results) -> str:
    lines = ["| context | method | prefill s | prefill ratio | decode ms/token | decode ratio |",
             "|---|---|---|---|---|---|"]
    base = {r["context_tokens"]: r for r in results if r["method"] == "fp16"}
    for r in results:
        b = base.get(r["context_tokens"], r)
        lines.append(f"| {r['context_tokens']} | {r['method']} | {r['prefill_s']:.2f} | "
                     f"{_ratio(r['prefill_s'], b['prefill_s']):.2f} | {r['decode_ms_per_token']:.1f} | "
                     f"{_ratio(r['decode_ms_per_token'], b['decode_ms_per_token']):.2f} |")
    return "\n".join(lines)


def per_chunk_attention(query, store, bits, chunk_size: int, scaling: float):
    """Decode attention without reordering: every context chunk dequantized and attended on its own, in the
    original order (sequence 0 only). Same maths as ``split_precision_attention_torch``."""
    import torch

    from hf_cocktail import quant

    B, H_q, Lq, D = query.shape
    H_kv = store.full.keys.shape[1]
    n_rep = H_q // H_kv
    q = query[0].float().reshape(H_kv, n_rep * Lq, D) * scaling
    seg = {s.bits: s for s in store.segments}
    pos = {16: 0, 4: 0, 2: 0}  # next chunk index within each precision
    full = store.full
    s0 = full.start[0]
    blocks = []
    for b in bits:  # original order
        i = pos[b]
        pos[b] += 1
        if b == 16:
            blocks.append(("full16", i))
        else:
            blocks.append((b, i))
    fk, fv = full.keys[0, :, s0:].float(), full.values[0, :, s0:].float()

    def get(blk, which):
        b, i = blk
        if b == "full16":  # FP16 chunks live in the full part (after the prefix tokens); located by plan positions
            return None
        sg = seg[b]
        a, e = i * chunk_size, min((i + 1) * chunk_size, sg.tok_off[1])
        if which == "k":
            return quant.dequantize_keys(sg.k_codes[:, a:e], sg.k_scale[:, i:i + 1], sg.k_zero[:, i:i + 1], b,
                                         chunk_size)
        return quant.dequantize_values(sg.v_codes[:, a:e], sg.v_scale[:, a:e], sg.v_zero[:, a:e], b,
                                       sg.group_size)

    scores, vals = [], []
    # the full-precision part (prefix, FP16 chunks, suffix, generated) is attended as one block: the ablation is
    # about the packed chunks
    scores.append(q @ fk.transpose(1, 2))
    vals.append(fv)
    for blk in blocks:
        k = get(blk, "k")
        if k is None:
            continue
        scores.append(q @ k.transpose(1, 2))
        vals.append(get(blk, "v"))
    p = torch.softmax(torch.cat(scores, -1), -1)
    o = torch.zeros(H_kv, n_rep * Lq, D)
    off = 0
    for s, v in zip(scores, vals):
        T = s.shape[-1]
        o += p[..., off:off + T] @ v
        off += T
    return o.reshape(1, H_q, Lq, D)


def no_reorder_ablation(model, tok, contexts, essay_dir=None, repeats: int = 20) -> list[dict]:
    import torch

    from eval.bench import QUESTION, haystack_context, make_prompt
    from eval.methods import METHODS
    from hf_cocktail import CocktailCache
    from hf_cocktail.attention import split_precision_attention_torch

    out = []
    for c in contexts:
        ctx = haystack_context(tok, c, essay_dir)
        prompt, kw = make_prompt(tok, ctx)
        cache = CocktailCache(METHODS["cocktail"].cocktail_config())
        inputs = cache.prepare_inputs(tok, prompt, contexts=ctx, queries=QUESTION, **kw)
        with torch.no_grad():
            model(**inputs, past_key_values=cache, logits_to_keep=1)
        store = cache.layers[0].store
        bits = cache.precision_map()[0]
        cfg = model.config
        H_q, D = cfg.num_attention_heads, getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, H_q, 1, D, generator=g)
        scaling = D ** -0.5
        ref = split_precision_attention_torch(q, store, scaling)
        alt = per_chunk_attention(q, store, bits, cache.config.chunk_size, scaling)
        err = float((ref - alt).abs().max())
        if err > 1e-4:
            raise RuntimeError(f"no-reorder attention disagrees with the segment attention (max err {err})")
        times = {}
        for name, fn in (("segments", lambda: split_precision_attention_torch(q, store, scaling)),
                         ("per_chunk", lambda: per_chunk_attention(q, store, bits, cache.config.chunk_size,
                                                                   scaling))):
            fn()
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            times[name] = 1000 * (time.perf_counter() - t0) / repeats
        n_packed = sum(b != 16 for b in bits)
        out.append({"context_tokens": int(inputs["input_ids"].shape[1]), "chunks": len(bits),
                    "packed_chunks": n_packed, "segments_ms": times["segments"], "per_chunk_ms": times["per_chunk"],
                    "max_abs_diff": err})
        del cache
    return out


def main(argv=None) -> int:
    args = parse_args(argv, default_methods="fp16,cocktail,int4,int2,kivi2")
    results, model, tok = run(args)
    table = latency_table(results)
    print(table)
    abl = no_reorder_ablation(model, tok, args.context_list, args.essay_dir)
    lines = ["", "No reorder (one decode query, layer 0, PyTorch path): attention over segments vs chunk by chunk",
             "", "| context | chunks (packed) | segments ms | per-chunk ms | per-chunk / segments |",
             "|---|---|---|---|---|"]
    for a in abl:
        lines.append(f"| {a['context_tokens']} | {a['chunks']} ({a['packed_chunks']}) | {a['segments_ms']:.2f} | "
                     f"{a['per_chunk_ms']:.2f} | {_ratio(a['per_chunk_ms'], a['segments_ms']):.2f} |")
    abl_table = "\n".join(lines)
    print(abl_table)
    results_all = results + [dict(a, method="no_reorder_ablation") for a in abl]
    save(args, results_all, table + "\n" + abl_table, "Decode latency vs DynamicCache")
    return 0


if __name__ == "__main__":
    from eval.common import run_cli  # noqa: E402

    run_cli(main)
