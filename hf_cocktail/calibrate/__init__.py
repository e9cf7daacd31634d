"""Calibrate a Cocktail preset for any model on your own texts (``python -m hf_cocktail.calibrate``).

``calibrate(model, tokenizer, texts, target=0.25)`` returns the :class:`~hf_cocktail.CocktailConfig` with the lowest
KL divergence from FP16 on held-out texts whose quantized layers hold at most ``target`` times their FP16 KV bytes;
``calibrate_model`` returns every measurement too (:class:`CalibrationResult`); ``write_preset`` writes the folder.
"""

from .preset import write_preset
from .run import CalibrationResult, calibrate, calibrate_model

__all__ = ["CalibrationResult", "calibrate", "calibrate_model", "write_preset"]
