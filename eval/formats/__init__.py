"""A format study (issue 26), fake quantization only: how much KL divergence from FP16 the context keys/values of a
model's quantized layers cost in other storage formats than today's, at 2, 3 and 4 bits, against their honest bytes
per element. Formats: today's min-max codes, keys quantized before RoPE (KVQuant), dense-and-sparse outliers
(KVQuant) and both. ``python -m eval.formats --help``; results in ``eval/results/formats/``.
"""
