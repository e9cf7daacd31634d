"""LongBench v1 evaluation of KV-cache methods side by side (``python -m eval.longbench``, see eval/README.md)."""
