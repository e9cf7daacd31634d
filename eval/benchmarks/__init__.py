"""Speed and memory benchmarks (separate from the accuracy evaluation): KV bytes and peak memory, decode latency, the
fused kernel on a GPU and end-to-end decode on a random Llama-3-8B-shaped model.

``OMP_WAIT_POLICY`` defaults to ``PASSIVE`` here (set before torch loads OpenMP; an explicit value in the environment
wins): on a CPU shared with other jobs, OpenMP threads that spin while waiting for a descheduled sibling made a
2-thread decode step up to 4x slower (measured: SmolLM2, 555-token prompt, 2 threads, load ~7 on 2 cores: 1118 vs
250 ms/token for ``DynamicCache``, prefill 19.1 vs 4.8 s). It applies to every method alike."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
