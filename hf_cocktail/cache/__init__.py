"""The cache: `CocktailCache`, its layers, lifecycles (beams, crop, copies, requery, load_prefill), input preparation,
the prefill watch, the per-layer-type layout, memory reports."""
