"""The transformers integration: `attn_implementation="cocktail"`, the pipeline, version compat."""
