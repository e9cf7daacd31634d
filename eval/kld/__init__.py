"""KL divergence from FP16 per KV-cache method (``python -m eval.kld``): teacher-forced on FP16's greedy answer and
the last prompt tokens, over LongBench examples and needle prompts, one shared full-precision prefill per example."""
