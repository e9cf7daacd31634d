"""Per-layer calibration of ``CocktailConfig.layer_bits`` (``python -m eval.layers``)."""
