"""hf-cocktail: chunk-adaptive mixed-precision KV cache (Cocktail) for Hugging Face transformers.

``import hf_cocktail`` registers ``attn_implementation="cocktail"``.
"""

from hf_cocktail._version import __version__
from hf_cocktail.cache.cache import CocktailCache
from hf_cocktail.cache.layer import CocktailLayer
from hf_cocktail.integration.attention import ATTN_NAME
from hf_cocktail.integration.attention import register as _register
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.integration.pipeline import register_pipeline as _register_pipeline
from hf_cocktail.planning.plans import PlanView
from hf_cocktail.planning.scoring import EncoderUnavailableError, offline_encoder_path
from hf_cocktail.presets.config import CocktailConfig

_register()
_register_pipeline()  # pipeline("cocktail-text-generation", ...)

__all__ = [
    "ATTN_NAME",
    "CocktailCache",
    "CocktailConfig",
    "CocktailLayer",
    "EncoderUnavailableError",
    "PlanView",
    "__version__",
    "cache_kwargs",
    "offline_encoder_path",
]
