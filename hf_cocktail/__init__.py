"""hf-cocktail: chunk-adaptive mixed-precision KV cache (Cocktail) for Hugging Face transformers.

``import hf_cocktail`` registers ``attn_implementation="cocktail"``.
"""

from ._version import __version__
from .attention import ATTN_NAME
from .attention import register as _register
from .cache import CocktailCache
from .compat import cache_kwargs
from .config import CocktailConfig
from .layer import CocktailLayer
from .pipeline import register_pipeline as _register_pipeline
from .planning import PlanView
from .scoring import EncoderUnavailableError, offline_encoder_path

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
