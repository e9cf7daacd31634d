"""One rank of tests/test_tensor_parallel.py (run by ``torchrun --nproc_per_node 2``): loads the saved tiny Llama with
``tp_plan="auto"`` (gloo, CPU), generates greedily with each setting and writes its tokens to ``<out>/rank<r>.json``.

Usage: ``torchrun --nproc_per_node 2 tests/tensor_parallel_worker.py MODEL_DIR OUT_DIR``
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.integration.compat import cache_kwargs

PROMPT_IDS = [[2] + [3 + (i * 37) % 180 for i in range(95)]]  # 96 tokens of the tiny vocabulary
NEW_TOKENS = 12


def settings() -> dict[str, CocktailConfig]:
    """The settings checked: uniform 16-bit and recommended() (chunks of 8, a residual window of 16 tokens)."""
    return {
        "uniform16": CocktailConfig(uniform_bits=16, backend="torch"),
        "recommended": CocktailConfig.recommended(chunk_size=8, residual_tokens=16, backend="torch"),
    }


def greedy(model, config: CocktailConfig) -> tuple[list[int], int, int]:
    """The greedy tokens after ``PROMPT_IDS`` (plain generate, no prepare_inputs), the key/value heads the cache
    held (a rank of a 2-way split holds half the model's) and the tokens its first layer packed."""
    ids = torch.tensor(PROMPT_IDS)
    cache = CocktailCache(config)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        **cache_kwargs(model, cache),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
    )
    store = cache.layers[0].store
    return out[0, ids.shape[1] :].tolist(), store.full.shape[1], sum(seg.num_tokens for seg in store.segments)


def main(model_dir: str, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM, DistributedConfig

    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        distributed_config=DistributedConfig(tp_plan="auto"),
        dtype=torch.float32,
        attn_implementation="cocktail",
    ).eval()
    runs = {name: greedy(model, config) for name, config in settings().items()}
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"world_size": dist.get_world_size(), "runs": runs}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
