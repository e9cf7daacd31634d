"""Calibrate a Cocktail preset for any model on your own texts (``python -m hf_cocktail.calibrate``).

``calibrate(model, tokenizer, texts, target=0.25)`` returns the :class:`~hf_cocktail.CocktailConfig` with the lowest
KL divergence from FP16 on held-out texts whose quantized layers hold at most ``target`` times their FP16 KV bytes and
whose KL on recall probes made from the same texts (key-value needles in the context, one asked) is at most uniform
INT4's; ``calibrate_model`` returns every measurement too (:class:`CalibrationResult`); ``write_preset`` writes the
folder.

Cost, counted in forward passes (defaults: 4 calibration and 4 held-out texts of 2048 tokens, L Cocktail layers): 12
prefills of ~2048 tokens (the held-out texts' recall probes too); 4 x (4 + 1 + 4 L) forwards of 32 tokens over a
2048-token cache for the sensitivity (the rotation check: the base widths under each of the four storage rotations; the
base, then 2 key and 2 value widths per layer); ~30 cache fills (quantization only, no forward) to fit the caps' budgets
to the target; 8 x (6 + 2) forwards of 32 tokens (the probes' ~10) to validate the candidates on the held-out texts and
their probes (when a rotated storage has the lowest base KL, the caps are fitted and validated unrotated too: twice the
fills, 8 x (12 + 2) forwards; with ``--search``: ~7 fills and 8 forwards more per scorer and low width). Measured on the
2-core CPU of the project (fp32, 1 thread, shared with other jobs at load 8-11): SmolLM2-135M (L = 30) 1473 s and 1897 s
(the sensitivity 913 s and 1252 s of it); Gemma 3 270M (L = 3) 943 s and 1257 s (dominated by the prefills, the
262K-token vocabulary and a first-use kernel build), with the four rotations compared 162-320 s (2026-12-03, load 2-4);
with the recall probes, 4 calibration and 8 held-out essays, both models at once on the 2 cores: SmolLM2 481 s, Gemma 3
329 s (2026-12-04); the same with centred keys and the refined 8-bit codes (``storage.params8.refine_codes``): SmolLM2
930 s, Gemma 3 537 s (2026-12-07, ``eval/results/presets_020/``). For an 8B model (L = 32) on one H100-class GPU the
same count is ~620 forwards of 32 tokens, each bound by reading the 16 GB of weights (~10 ms), and 12 prefills of ~0.1
s: about 10 s of GPU time plus loading the model; an estimate from the count, not measured.
"""

from hf_cocktail.calibrate.preset import write_preset
from hf_cocktail.calibrate.run import CalibrationResult, calibrate, calibrate_model

__all__ = ["CalibrationResult", "calibrate", "calibrate_model", "write_preset"]
