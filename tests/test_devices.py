"""Multi-device placement: every tensor of a layer lives on that layer's device; kernels launch there."""

import pytest
import torch
from transformers import DynamicCache

from hf_cocktail import CocktailCache
from hf_cocktail.integration.compat import cache_kwargs

from .conftest import FakeEncoder, make_prompt, make_tiny_llama
from .test_core_cache import GEN, cfg, logits


def _layer_devices(cache):
    out = []
    for layer in cache.layers:
        st = layer.store
        tensors = [st.full.keys, st.full.values] + [t for seg in st.segments for t in seg.tensors()]
        out.append({t.device for t in tensors})
    return out


def test_store_tensors_live_on_the_key_device(tiny_llama, tiny_tokenizer):
    prompt, ctx, q = make_prompt(40)
    cache = CocktailCache(cfg(alpha=0.3, beta=0.2), encoder=FakeEncoder())
    tiny_llama.generate(
        **cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q),
        **cache_kwargs(tiny_llama, cache),
        max_new_tokens=2,
    )
    assert _layer_devices(cache) == [{torch.device("cpu")}] * 2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "auto"])  # auto: Triton on the GPU layer, torch on the CPU one
def test_layers_split_between_cpu_and_gpu(tiny_tokenizer, backend):
    model = make_tiny_llama(layers=2, head_dim=64)
    device_map = {
        "model.embed_tokens": 0,
        "model.layers.0": "cpu",
        "model.layers.1": 0,
        "model.norm": 0,
        "model.rotary_emb": 0,
        "lm_head": 0,
    }
    from accelerate import dispatch_model

    model = dispatch_model(model, device_map=device_map)
    prompt, ctx, q = make_prompt(80)
    cache = CocktailCache(cfg(uniform_bits=16, backend=backend, group_size=32), encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q, device="cuda:0")
    out = model.generate(**inputs, **cache_kwargs(model, cache), **GEN)
    assert _layer_devices(cache) == [{torch.device("cpu")}, {torch.device("cuda", 0)}]
    ref = model.generate(
        **tiny_tokenizer(prompt, return_tensors="pt").to("cuda:0"), **cache_kwargs(model, DynamicCache()), **GEN
    )
    torch.testing.assert_close(logits(out), logits(ref), rtol=1e-4, atol=1e-4)
