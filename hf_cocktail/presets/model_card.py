"""Model cards for hf-cocktail configs: results tables and the generated ``README.md`` of a config repo.

Works on any config object with the :class:`~hf_cocktail.CocktailConfig` fields and ``to_json_string()``.
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Iterable
from typing import Any

from hf_cocktail.presets.hub import CONFIG_NAME, README_NAME

CARD_TAGS = ("kv-cache", "quantization", "cocktail", "long-context")
RESULT_COLUMNS = ("task", "method", "score", "kv_ratio", "prefill_s", "decode_ms_per_token", "n")
SETTINGS_SOURCES = ("paper", "local")
PAPER_SETTINGS = {
    "chunk_size": 32,
    "alpha": 0.6,
    "beta": 0.1,
    "encoder": "facebook/contriever",
    "group_size": 32,
    "uniform_bits": None,
}
PAPER = "Cocktail: Chunk-Adaptive Mixed-Precision Quantization for Long-Context LLM Inference"


# ---------------------------------------------------------------------------------------------------- results
def read_results(path: str | os.PathLike) -> list[dict[str, str]]:
    """Rows of an evaluation ``summary.csv`` (columns :data:`RESULT_COLUMNS`; ``task == "average"`` rows hold the
    per-method averages)."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in RESULT_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(
                f"{os.fspath(path)} lacks the columns {missing}; expected columns {list(RESULT_COLUMNS)}, "
                f"got {reader.fieldnames}"
            )
        return list(reader)


def _num(v: Any) -> str:
    """A CSV cell for a table: integers as written, other numbers to 4 significant digits."""
    s = str(v).strip()
    if re.fullmatch(r"[+-]?\d+", s):
        return s
    try:
        return f"{float(s):.4g}"
    except ValueError:
        return s


def _table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> str:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_num(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def results_markdown(rows: list[dict[str, str]]) -> str:
    """Markdown tables of ``summary.csv`` rows: per-method averages first, then every task."""
    cols = RESULT_COLUMNS[1:]
    avg = [r for r in rows if r["task"] == "average"]
    per_task = [r for r in rows if r["task"] != "average"]
    parts = []
    if avg:
        parts.append("Average over tasks, per method:\n\n" + _table(cols, ([r[c] for c in cols] for r in avg)))
    if per_task:
        parts.append("Per task:\n\n" + _table(RESULT_COLUMNS, ([r[c] for c in RESULT_COLUMNS] for r in per_task)))
    return "\n\n".join(parts) if parts else "The results file holds no rows."


# ---------------------------------------------------------------------------------------------------- card
def _yaml_scalar(v: str) -> str:
    return v if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]*", v) else json.dumps(v)


def _usage(config: Any, base_model: str | None, name_or_path: str) -> str:
    model_id = base_model or "<your causal LM>"
    return f'''```python
import torch
import hf_cocktail  # registers attn_implementation="cocktail"
from hf_cocktail import CocktailCache, CocktailConfig, cache_kwargs
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{model_id}")
model = AutoModelForCausalLM.from_pretrained(
    "{model_id}", dtype=torch.float16, device_map="auto", attn_implementation="cocktail")
cache = CocktailCache(CocktailConfig.from_pretrained("{name_or_path}"))

doc, question = open("document.txt").read(), "What does the document say about X?"
prompt = f"{{doc}}\\n\\nAnswer the question using the document above.\\nQuestion: {{question}}\\nAnswer:"
# the document must appear verbatim in the prompt (a chat template around it is fine)
inputs = cache.prepare_inputs(tokenizer, prompt, contexts=doc, queries=question, device=model.device)
out = model.generate(**inputs, **cache_kwargs(model, cache), max_new_tokens=64)
print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
```'''


def _cache_kind(config: Any) -> str:
    if config.uniform_bits is not None:
        return "a chunk-quantized KV cache"
    return f"a chunk-adaptive mixed-precision FP16/INT4/INT{getattr(config, 'low_bits', 2)} KV cache"


def _method(config: Any) -> str:
    if config.uniform_bits is not None:
        return (
            f"This config runs no chunk search: every context chunk of {config.chunk_size} tokens is stored at "
            f"{config.uniform_bits} bits.{_storage(config)}"
        )
    low = f"INT{getattr(config, 'low_bits', 2)}"
    if getattr(config, "target_bits", None) is None:
        rule = (
            f"with scores in [s_min, s_max], chunks with s <= s_min + {config.alpha} * (s_max - s_min) are stored "
            f"in {low}, chunks with s > s_max - {config.beta} * (s_max - s_min) in FP16 and the rest in INT4."
        )
    else:
        rule = (
            f"a budget of {config.target_bits} bits per context element (scales included) is spent in rank order: "
            f"FP16 for chunks with s > s_max - {config.beta} * (s_max - s_min), then INT4, the rest {low}."
        )
    return (
        f"The context is cut into chunks of {config.chunk_size} tokens. At prefill each chunk is scored against "
        f"the query with the retrieval encoder `{config.encoder}`; {rule}{_storage(config)}"
    )


ROTATED = {
    "hadamard_keys": "Keys (not values) are",
    "hadamard_values": "Values (not keys) are",
    "auto": "Values, and the keys of the layers where the prompt's queries see less error so, are",
}


def _storage(config: Any) -> str:
    """How the packed chunks are stored: groups, rotation, the values' code width, the scales' bits."""
    stored = (
        f" Values are quantized per token in groups of {config.group_size} channels, keys per channel within each "
        "chunk."
    )
    rotation = getattr(config, "rotation", None)
    if rotation:
        what = ROTATED.get(rotation, "Keys and values are")
        stored += f" {what} stored rotated (`{rotation}`, an orthonormal per-head transform)."
    value_bits = getattr(config, "value_bits", None)
    if value_bits is not None:
        stored += f" Values get at most {value_bits} bits (`value_bits={value_bits}`; keys keep their chunk's bits)."
    if getattr(config, "scale_bits", 16) == 8:
        stored += " Scales and zeros are stored as 8-bit codes on three numbers per chunk and head (`scale_bits=8`)."
    layer_bits = getattr(config, "layer_bits", None)
    if layer_bits:
        caps = ", ".join(f"{k}/{v}" for k, v in layer_bits)
        stored += (
            f" Each of the {len(layer_bits)} layers caps its packed keys / values at its own code widths "
            f"(`layer_bits`, layer 0 first): {caps}."
        )
    salient = getattr(config, "salient_tokens", 0.0)
    if salient:
        stored += (
            f" Per layer, the {salient * 100:g}% of the packed context tokens the question attends to most stay out "
            f'of the packed chunks (`salient_tokens={salient:g}`; needs `attn_implementation="cocktail"`).'
        )
    if getattr(config, "full_part_bits", 16) == 8:
        stored += (
            " The tokens outside the packed chunks (template, question, FP16 chunks, salient tokens, generated "
            "tokens) are stored as 8-bit codes with one scale per token and head (`full_part_bits=8`)"
        )
        if getattr(config, "rotation", None) not in ("hadamard", "hadamard_keys"):
            stored += ", keys in a Hadamard basis where the layer's keys are unrotated"
        sinks = getattr(config, "sink_tokens", 0)
        stored += f"; the first {sinks} tokens (attention sinks) stay at full precision." if sinks else "."
    return stored


def make_model_card(
    config: Any,
    base_model: str | None = None,
    results: str | os.PathLike | list[dict[str, str]] | None = None,
    hardware: str | dict | None = None,
    commit: str | None = None,
    notes: str | list[str] | None = None,
    *,
    name_or_path: str = "path/or/repo-id",
    license: str = "apache-2.0",
    settings_source: str = "local",
    command: str | None = None,
    runtime_s: float | None = None,
    results_name: str | None = None,
    measurements: str | None = None,
) -> str:
    """The ``README.md`` model card of a Cocktail config.

    Args:
        config: the :class:`CocktailConfig`; its exact JSON goes into the card.
        base_model: Hub id of the model the config is meant for (front matter ``base_model``), or None.
        results: evaluation rows (a ``summary.csv`` path or its rows, see :func:`read_results`); None: the card
            states that nothing was measured.
        hardware, commit, command, runtime_s: provenance of ``results`` (as in the evaluation's ``run_info.json``).
        notes: extra markdown paragraphs.
        name_or_path: what the usage snippet passes to ``CocktailConfig.from_pretrained`` (folder or repo id).
        license: license of this config repo (the base model keeps its own).
        settings_source: ``"paper"`` (settings copied from the Cocktail paper, not measured here) or ``"local"``.
        results_name: the results file, named in the card when it does not exist (e.g. ``eval/results/summary.csv``).
        measurements: markdown of what was measured for this config other than an evaluation's ``summary.csv``
            (e.g. ``python -m hf_cocktail.calibrate``'s held-out table), placed first under Results.
    """
    if settings_source not in SETTINGS_SOURCES:
        raise ValueError(f"settings_source must be one of {SETTINGS_SOURCES}, got {settings_source!r}")
    if settings_source == "paper":
        differ = {k: getattr(config, k) for k, v in PAPER_SETTINGS.items() if getattr(config, k) != v}
        if differ:
            raise ValueError(
                f"settings_source='paper' but the config differs from the paper's settings "
                f"{PAPER_SETTINGS}: {differ}; use settings_source='local'"
            )
    if results is not None and not isinstance(results, list):
        results = read_results(results)
    front = ["---", "library_name: hf-cocktail"]
    if base_model:
        front.append(f"base_model: {_yaml_scalar(base_model)}")
    front += [f"license: {_yaml_scalar(license)}", "tags:", *[f"- {t}" for t in CARD_TAGS], "---"]
    title = f"Cocktail KV-cache config for {base_model}" if base_model else "Cocktail KV-cache config"
    out = [
        "\n".join(front),
        f"# {title}",
        "This repository holds a hf-cocktail configuration (`cocktail_config.json`), not "
        f"model weights: {_cache_kind(config)} for Hugging Face transformers, after *{PAPER}*. " + _method(config),
    ]
    if settings_source == "paper":
        paper = ", ".join(f"{k}={v!r}" for k, v in PAPER_SETTINGS.items())
        if results is None:
            out.append(
                f"> **These are the Cocktail paper's settings ({paper}), NOT measured here.** hf-cocktail has "
                "not evaluated this configuration on this model; no accuracy, memory or speed figure in this "
                "card comes from a run."
            )
        else:
            out.append(
                f"> These are the Cocktail paper's settings ({paper}); the results below were measured with "
                "hf-cocktail (see provenance), they are not the paper's numbers."
            )
    out += [
        "## Usage",
        _usage(config, base_model, name_or_path),
        "## Configuration",
        f"`{CONFIG_NAME}`:",
        "```json\n" + config.to_json_string().rstrip("\n") + "\n```",
        "## Results",
    ]
    if measurements:
        out.append(measurements)
    if results is not None:
        out.append(results_markdown(results))
    elif not measurements:
        missing = f" (`{results_name}` does not exist yet)" if results_name else ""
        out.append(
            f"No evaluation results yet: not measured here{missing}."
            if settings_source == "local"
            else "Not measured here."
        )
    prov = []
    if results is not None or measurements or hardware or commit:
        hw = ", ".join(f"{k}: {v}" for k, v in hardware.items()) if isinstance(hardware, dict) else hardware
        prov = [f"- Hardware: {hw or 'not recorded'}", f"- Commit: `{commit}`" if commit else "- Commit: not recorded"]
        if command:
            prov.append(f"- Command: `{command}`")
        if runtime_s is not None:
            prov.append(f"- Runtime: {float(runtime_s):.0f} s")
    out += ["## Hardware and provenance", "\n".join(prov) if prov else "Not applicable: nothing was run."]
    paras = [notes] if isinstance(notes, str) else list(notes or [])
    paras.append(
        f"The base model is not included here; its own license applies. This configuration is released under {license}."
    )
    out += ["## Notes", *paras]
    return "\n\n".join(out) + "\n"


def write_card(
    config: Any,
    folder: str | os.PathLike,
    model_card: bool | str,
    name_or_path: str,
    card_kwargs: dict[str, Any],
) -> None:
    """Write ``folder/README.md`` for ``save_pretrained``: ``model_card`` True (a generated card, unless the folder
    has one), False (none) or the card text."""
    if not isinstance(model_card, (bool, str)):
        raise TypeError(f"model_card must be True, False or the card text (str), got {type(model_card).__name__}")
    if card_kwargs and model_card is not True:
        raise TypeError(f"card options {sorted(card_kwargs)} only apply with model_card=True (a generated card)")
    path = os.path.join(folder, README_NAME)
    if model_card is False or (model_card is True and os.path.exists(path)):
        return
    if model_card is True:
        model_card = make_model_card(config, **({"name_or_path": name_or_path} | card_kwargs))
    with open(path, "w", encoding="utf-8") as f:
        f.write(model_card)
