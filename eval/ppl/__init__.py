"""Perplexity of real text continued over each method's quantized context (``python -m eval.ppl``)."""
