"""What the fused CPU kernel's 16-bit P.V (its AVX-512 VNNI build, ``isa="auto"`` on such a CPU) does to a real
model's next-token distributions, beside what the preset's quantization itself does.

Per essay (the first ``--words`` words as the document, a fixed question, completion prompt as in the README): FP16's
greedy answer (``DynamicCache``, ``--tokens`` new tokens) is fed teacher-forced through the preset's Cocktail cache
twice, once with the fused kernel's VNNI build and once with its fp32 AVX2 build (``cpu_ops`` isa ``"avx2"``), and
the mean over answer positions of three KL divergences is printed: KL(avx2 || vnni) (the 16-bit rounding alone),
KL(fp16 || avx2) and KL(fp16 || vnni) (the quantization), with the share of positions whose argmax agrees.

    PYTHONPATH=. python -m eval.benchmarks.kernel_isa_fidelity --essays 6 --threads 1
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import torch
from tqdm import tqdm

import cpu_ops
import cpu_ops.attention as cpu_attention
from hf_cocktail import CocktailCache, CocktailConfig, offline_encoder_path
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.offline_models import load_offline_model

from ..paths import ESSAY_DIR, REPO_ROOT

QUESTION = "What is the main point of the essay?"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--preset", default=os.path.join(REPO_ROOT, "model_cards", "smollm2-135m-instruct"))
    p.add_argument("--essays", type=int, default=6, help="the first N essays of --essay-dir")
    p.add_argument("--words", type=int, default=1500, help="words of each essay in the document")
    p.add_argument("--tokens", type=int, default=24, help="FP16's greedy answer length")
    p.add_argument("--essay-dir", default=ESSAY_DIR)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


@torch.no_grad()
def teacher_forced(model, inputs, answer, cache, isa: str) -> torch.Tensor:
    """``(len(answer), V)`` log-probabilities of the prompt's next token and of each answer token's successor, the
    fused kernel's ``auto`` isa standing for ``isa`` meanwhile."""
    saved = cpu_attention._ISA_CODES["auto"]
    cpu_attention._ISA_CODES["auto"] = cpu_attention._ISA_CODES[isa]
    try:
        out = [model(**inputs, **cache_kwargs(model, cache)).logits[0, -1]]
        for t in answer[:-1]:
            out.append(model(input_ids=t.view(1, 1), **cache_kwargs(model, cache)).logits[0, -1])
    finally:
        cpu_attention._ISA_CODES["auto"] = saved
    return torch.stack(out).double().log_softmax(-1)


def mean_kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """Mean over positions of KL(p || q), both log-probabilities ``(n, V)``."""
    return (p.exp() * (p - q)).sum(-1).mean().item()


def one_essay(model, tok, config, path: str, words: int, tokens: int) -> dict:
    doc = " ".join(open(path, encoding="utf-8").read().split()[:words])
    prompt = f"{doc}\n\nAnswer the question using the document above.\nQuestion: {QUESTION}\nAnswer:"
    plain = {k: v for k, v in tok(prompt, return_tensors="pt").items() if k in ("input_ids", "attention_mask")}
    g = model.generate(
        **plain, max_new_tokens=tokens, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    answer = g.sequences[0, plain["input_ids"].shape[1] :]
    fp16 = torch.stack(g.logits)[:, 0].double().log_softmax(-1)
    runs = {}
    for isa in ("auto", "avx2"):
        cache = CocktailCache(config)
        inputs = cache.prepare_inputs(tok, prompt, contexts=doc, queries=QUESTION)
        runs[isa] = teacher_forced(model, inputs, answer, cache, isa)
    return {
        "essay": os.path.basename(path),
        "positions": len(answer),
        "kl_avx2_vnni": mean_kl(runs["avx2"], runs["auto"]),
        "kl_fp16_avx2": mean_kl(fp16, runs["avx2"]),
        "kl_fp16_vnni": mean_kl(fp16, runs["auto"]),
        "top1_agree": (runs["auto"].argmax(-1) == runs["avx2"].argmax(-1)).double().mean().item(),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    essays = sorted(glob.glob(os.path.join(args.essay_dir, "*.txt")))[: args.essays]
    if not essays:
        print(f"no essays in {args.essay_dir} (the evaluation data, ../shared/data): nothing measured", file=sys.stderr)
        return 2
    if cpu_ops.kernel_target() != "avx512vnni":
        print(f"this CPU runs the {cpu_ops.kernel_target()} build: no 16-bit P.V to compare", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    model, tok = load_offline_model(args.model)
    config = CocktailConfig.from_pretrained(args.preset, encoder=offline_encoder_path())
    rows = [one_essay(model, tok, config, p, args.words, args.tokens) for p in tqdm(essays, desc="essays")]
    print("| essay | positions | KL(avx2 ‖ vnni) | KL(fp16 ‖ avx2) | KL(fp16 ‖ vnni) | top-1 vnni = avx2 |")
    print("|---|---|---|---|---|---|")
    for r in rows + [
        {"essay": "**mean**", **{k: sum(x[k] for x in rows) / len(rows) for k in rows[0] if k != "essay"}}
    ]:
        print(
            f"| {r['essay']} | {r['positions']:.0f} | {r['kl_avx2_vnni']:.2e} | {r['kl_fp16_avx2']:.2e} | "
            f"{r['kl_fp16_vnni']:.2e} | {r['top1_agree']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
