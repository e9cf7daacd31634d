"""The evaluation of hf-cocktail: accuracy (LongBench, needle in a haystack) and speed/memory benchmarks, run as
``python -m eval.<script>`` from the repository root (layout: eval/README.md).

Dependencies point one way: ``paths``, ``cli``, ``records`` <- ``run_info``, ``models``, ``kv_bytes``, ``essays`` <-
``methods`` <- ``runner`` <- ``longbench``, ``needle`` <- ``kld`` (their prompts) <- ``ppl`` (``kld``'s runner);
``benchmarks`` use ``methods``, ``models``, ``kv_bytes``, ``essays``.
"""
