"""Speed and memory benchmarks (separate from the accuracy evaluation): KV bytes and peak memory, decode latency, the
no-reorder ablation, the fused kernel on a GPU and end-to-end decode on a random Llama-3-8B-shaped model."""
