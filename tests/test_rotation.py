"""Rotated storage (CocktailConfig(rotation=...)): orthonormal transforms, attention that never un-rotates the cache,
and the quantization error it saves."""

import pytest
import torch

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.decode.split_attention import split_precision_attention_torch
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.storage.rotation import ROTATIONS, Rotation, hadamard, orthonormal_matrices
from hf_cocktail.storage.store import LayerStore

from .conftest import FakeEncoder, make_prompt, make_tiny_llama

GEN = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)


@pytest.mark.parametrize("D", [8, 64, 128, 48, 96])  # 48 and 96: not powers of two -> random orthogonal fallback
def test_rotation_matrices_are_orthonormal_and_round_trip(D):
    mats = orthonormal_matrices(3, D, seed=7)
    eye = torch.eye(D).expand(3, D, D)
    torch.testing.assert_close(mats @ mats.transpose(-1, -2), eye, atol=1e-5, rtol=0)
    assert not torch.allclose(mats[0], mats[1])  # per-head signs / matrices differ
    torch.testing.assert_close(mats, orthonormal_matrices(3, D, seed=7), atol=0, rtol=0)  # reproducible
    rot = Rotation.make("hadamard", 3, D, seed=7)
    x = torch.randn(2, 3, 5, D)
    torch.testing.assert_close(rot.unrotate_keys(rot.rotate_keys(x)), x, atol=1e-5, rtol=0)
    q = torch.randn(2, 6, 1, D)  # GQA: 2 query heads per kv head; (qR)·(kR) = q·k
    scores = rot.rotate_query(q).reshape(2, 3, 2, D) @ rot.rotate_keys(x).transpose(-1, -2)
    torch.testing.assert_close(scores, q.reshape(2, 3, 2, D) @ x.transpose(-1, -2), atol=1e-4, rtol=1e-5)


def test_hadamard_is_sylvester():
    h = hadamard(4)
    assert h.tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(6)


def _outlier_kv(B, H, T, D, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g)
    x[..., 3] *= 12.0  # a channel outlier, as real keys have
    return x


@pytest.mark.parametrize("kind", [k for k in ROTATIONS if k])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_split_attention_over_rotated_store_equals_sdpa_over_dequantized_unrotated(kind, bits):
    B, H, T, D, C, G = 2, 2, 70, 32, 8, 16
    k, v = _outlier_kv(B, H, T, D, 0), _outlier_kv(B, H, T, D, 1)
    n_full = 6
    positions = [
        {
            "full": torch.arange(T - n_full, T),
            bits: torch.arange(0, T - n_full),
            (2 if bits == 4 else 4): torch.zeros(0, dtype=torch.long),
        }
        for _ in range(B)
    ]
    rot = Rotation.make(kind, H, D, seed=3)
    store = LayerStore.build(k, v, positions, C, G, torch.float32, rotation=rot)
    assert store.rotation is rot  # recorded with the data
    query = torch.randn(B, 2 * H, 1, D)
    out = split_precision_attention_torch(query, store, D**-0.5)
    keys, values = store.dequantized(positions, T, T)  # un-rotated, original order
    ref = torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=D**-0.5, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    # values are quantized per token: rotation spreads the outlier channel and the error drops (keys are quantized
    # per channel within a chunk, which a channel outlier does not hurt: their gain is measured on a real model)
    plain_k, plain_v = LayerStore.build(k, v, positions, C, G, torch.float32).dequantized(positions, T, T)
    err = lambda a, b: (a - b).pow(2).mean().item()
    if kind in ("hadamard", "hadamard_values"):
        assert err(values, v) < 0.6 * err(plain_v, v)
    else:
        torch.testing.assert_close(values, plain_v)


def test_rotated_store_keeps_rotation_through_append_and_select():
    B, H, T, D = 2, 1, 24, 16
    k, v = _outlier_kv(B, H, T, D, 0), _outlier_kv(B, H, T, D, 1)
    positions = [{"full": torch.arange(16, T), 4: torch.arange(0, 16), 2: torch.zeros(0, dtype=torch.long)}] * B
    store = LayerStore.build(k, v, positions, 8, 16, torch.float32, rotation=Rotation.make("hadamard", H, D, 0))
    new_k, new_v = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
    store.append(new_k, new_v)
    keys, values = store.dequantized(positions, T + 1, T)
    torch.testing.assert_close(keys[:, :, -1:], new_k, atol=1e-5, rtol=0)  # appended tokens are rotated back too
    torch.testing.assert_close(values[:, :, 16:], torch.cat([v[:, :, 16:], new_v], 2), atol=1e-5, rtol=0)
    assert store.select([1, 0]).rotation is store.rotation


@pytest.mark.parametrize("rotation, low_bits", [(k, 2) for k in ROTATIONS if k] + [("hadamard", 3)])
def test_generate_with_rotation_split_equals_dequantized_sdpa(tiny_tokenizer, rotation, low_bits):
    """attn 'cocktail' (rotated query, packed rotated segments, output rotated back) == attn 'sdpa' over the
    dequantized, un-rotated cache, for a search that picks FP16, INT4 and INT2 (or INT3) chunks."""
    prompt, ctx, q = make_prompt(120, needle_at=60)
    outs = {}
    for attn in ("cocktail", "sdpa"):
        model = make_tiny_llama(attn=attn, head_dim=32)
        cfg = CocktailConfig(chunk_size=8, group_size=16, alpha=0.3, beta=0.3, rotation=rotation, low_bits=low_bits)
        cache = CocktailCache(cfg, encoder=FakeEncoder())
        inputs = cache.prepare_inputs(tiny_tokenizer, prompt, contexts=ctx, queries=q)
        outs[attn] = model.generate(**inputs, **cache_kwargs(model, cache), **GEN)
        assert {16, 4, low_bits} == set(cache.precision_map()[0])
    assert torch.equal(outs["cocktail"].sequences, outs["sdpa"].sequences)
    torch.testing.assert_close(
        torch.stack(outs["cocktail"].logits), torch.stack(outs["sdpa"].logits), atol=1e-4, rtol=1e-4
    )


def test_rotation_config_is_validated():
    with pytest.raises(ValueError, match="rotation must be one of"):
        CocktailConfig(rotation="walsh")
    with pytest.raises(ValueError, match="rotation_seed must be an integer"):
        CocktailConfig(rotation="hadamard", rotation_seed=1.5)
    assert CocktailConfig.from_dict(CocktailConfig(rotation="hadamard").to_dict()).rotation == "hadamard"
