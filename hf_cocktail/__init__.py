"""hf-cocktail: chunk-adaptive mixed-precision KV cache (Cocktail) for Hugging Face transformers.

``import hf_cocktail`` registers ``attn_implementation="cocktail"``.
"""

from .attention import ATTN_NAME, register as _register
from .cache import CocktailCache, CocktailLayer
from .config import CocktailConfig
from .search import EncoderUnavailableError, offline_encoder_path

_register()

__all__ = ["ATTN_NAME", "CocktailCache", "CocktailConfig", "CocktailLayer", "EncoderUnavailableError",
           "offline_encoder_path"]
__version__ = "0.1.0"
