"""Needle in a haystack over the Paul Graham essays (``python -m eval.needle``, see eval/README.md)."""
