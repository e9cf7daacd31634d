"""Centred keys (hf_cocktail.storage.key_centering, CocktailConfig(center_keys=True)): the mean, the store (what it
holds, its bytes, dequantization, appended tokens, row selection), attention unchanged (with soft-capping and sinks
too) and the error it removes from 8-bit zeros and the 8-bit full part."""

import pytest
import torch

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.decode import dispatch
from hf_cocktail.decode.split_attention import split_precision_attention_torch
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.storage.key_centering import centered, context_key_mean, logit_offsets, uncentered
from hf_cocktail.storage.rotation import Rotation
from hf_cocktail.storage.store import LayerStore

from .conftest import assert_fused_cpu_kernel_matches_reference, make_tiny_llama, make_tokenizer, random_text

B, H, T, D, C = 2, 2, 72, 32, 8


def _kv(offset=30.0, seed=0):
    """Keys with a large constant offset on channels 3 and 17 (as Gemma 3's), Gaussian values."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    k[..., [3, 17]] += offset
    return k, v


POSITIONS = [{"full": torch.arange(64, T), 4: torch.arange(0, 24), 2: torch.arange(24, 64)}] * B


def _store(mean=None, rotation=None, **kw):
    k, v = _kv()
    rot = None if rotation is None else Rotation.make(rotation, H, D, seed=1)
    return LayerStore.build(k, v, POSITIONS, C, 16, torch.float16, rotation=rot, key_mean=mean, **kw), (k, v)


def _mean():
    k, _ = _kv()
    return context_key_mean(k, [(0, 64)] * B, torch.float16)


def test_context_key_mean_is_each_sequences_context_mean():
    k, _ = _kv()
    mean = context_key_mean(k, [(0, 64), (10, 20)], torch.float32)
    assert mean.shape == (B, H, 1, D)
    torch.testing.assert_close(mean[0], k[0, :, :64].mean(1, keepdim=True))
    torch.testing.assert_close(mean[1], k[1, :, 10:20].mean(1, keepdim=True))
    assert context_key_mean(k, [(5, 5), (0, 1)], torch.float32)[0].abs().max() == 0  # no context: no shift
    with pytest.raises(ValueError, match=r"spans must give one \(start, end\) per sequence \(2\), got 1"):
        context_key_mean(k, [(0, 1)], torch.float32)


def test_centered_and_uncentered_invert_each_other():
    k, _ = _kv()
    m = _mean()
    torch.testing.assert_close(uncentered(centered(k, m), m), k, atol=1e-5, rtol=0)
    assert centered(k, None) is k and uncentered(k, None) is k


@pytest.mark.parametrize("rotation", [None, "hadamard"])
def test_a_centred_store_holds_keys_minus_the_mean_and_gives_them_back(rotation):
    m = _mean()
    store, (k, v) = _store(m, rotation)
    plain, _ = _store(None, rotation)
    assert store.full.keys.abs().max() < plain.full.keys.abs().max() / 3  # the offset is gone from what is stored
    keys, values = store.dequantized(POSITIONS, T, T)
    full = POSITIONS[0]["full"]
    torch.testing.assert_close(keys[:, :, full], k[:, :, full], atol=1e-4, rtol=0)  # the mean added back
    torch.testing.assert_close(values, plain.dequantized(POSITIONS, T, T)[1])
    assert store.nbytes() == plain.nbytes() + m.numel() * 2  # the means, fp16, counted


def test_appended_keys_and_selected_rows_keep_their_sequences_mean():
    m = _mean()
    m[1] += 5  # two different means
    store, _ = _store(m)
    new_k, new_v = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
    store.append(new_k, new_v)
    torch.testing.assert_close(store.full.keys[:, :, -1:], centered(new_k, m))
    picked = store.select([1, 1, 0])
    assert torch.equal(picked.key_mean, m[[1, 1, 0]])
    torch.testing.assert_close(picked.full.keys[0, :, -1:], centered(new_k, m)[1])


@pytest.mark.parametrize("rotation", [None, "hadamard"])
@pytest.mark.parametrize(
    "extras", [{}, {"softcap": 5.0}, {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}], ids=["plain", "softcap", "sinks"]
)
def test_attention_over_a_centred_store_is_unchanged(rotation, extras):
    """At 16 bits (nothing packed) a centred store's attention equals the plain one's; with soft-capping and sinks
    only because the shift is added back (without it they differ)."""
    k, v = _kv()
    full = [{"full": torch.arange(T)}] * B
    rot = None if rotation is None else Rotation.make(rotation, H, D, seed=1)
    mean = context_key_mean(k, [(0, 64)] * B, torch.float32)
    plain = LayerStore.build(k, v, full, C, 16, torch.float32, rotation=rot)
    store = LayerStore.build(k, v, full, C, 16, torch.float32, rotation=rot, key_mean=mean)
    q = torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(3))
    want = split_precision_attention_torch(q, plain, D**-0.5, **extras)
    got = split_precision_attention_torch(q, store, D**-0.5, **extras)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    for backend in ("torch", "cpu"):  # the dispatch routes these to the PyTorch path, so the same
        torch.testing.assert_close(dispatch.split_precision_attention(q, store, D**-0.5, backend, **extras), got)
    if extras:
        store.key_mean = None  # what the kernels would compute: the shift lost
        lost = split_precision_attention_torch(q, store, D**-0.5, **extras)
        assert (lost - want).abs().max() > 1e-3


def test_logit_offsets_follow_the_query_heads_kv_head():
    q, m = torch.randn(B, 4, 3, D), torch.randn(B, H, 1, D)
    off = logit_offsets(q, m, 0.5)
    assert off.shape == (B, 4, 3, 1)
    torch.testing.assert_close(off[1, 3, 2, 0], 0.5 * q[1, 3, 2] @ m[1, 1, 0])
    torch.testing.assert_close(off[0, 1, 0, 0], 0.5 * q[0, 1, 0] @ m[0, 0, 0])


def test_the_fused_cpu_kernel_reads_a_centred_store_as_the_reference():
    store, _ = _store(_mean(), "hadamard", scale_bits=8)
    q = torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(4))
    assert_fused_cpu_kernel_matches_reference(store, q, D**-0.5)


@pytest.mark.parametrize(
    "kw,where,offset",
    [({"scale_bits": 8}, 4, 300.0), ({"full_part_bits": 8}, "full", 30.0)],
    ids=["8-bit zeros", "8-bit full part"],
)
def test_centring_removes_the_offsets_error(kw, where, offset):
    """A large channel offset costs 8-bit zeros (their codes step through the block's channel minima) and the 8-bit
    full part (one scale per token) their precision; centred, the keys' error (in the INT4 chunks, in the full part)
    falls severalfold."""
    k, v = _kv(offset)
    pos = POSITIONS[0][where]

    def error(mean):
        store = LayerStore.build(k, v, POSITIONS, C, 16, torch.float16, key_mean=mean, **kw)
        keys, _ = store.dequantized(POSITIONS, T, T)
        return (keys - k)[:, :, pos].pow(2).mean().item()

    assert error(context_key_mean(k, [(0, 64)] * B, torch.float16)) < error(None) / 3


def test_a_cache_centres_by_config_and_generates():
    tok, model = make_tokenizer(), make_tiny_llama(layers=2, head_dim=32)
    ids = tok(random_text(300, seed=2), return_tensors="pt")
    outs, caches = {}, {}
    for center in (False, True):
        cfg = CocktailConfig.recommended(center_keys=center, residual_tokens=16)
        cache = caches[center] = CocktailCache(cfg)
        out = model.generate(**ids, **cache_kwargs(model, cache), max_new_tokens=4, do_sample=False)
        outs[center] = out
    layers = caches[True].layers
    assert all(layer.store.key_mean is not None for layer in layers)
    assert all(layer.store.key_mean is None for layer in caches[False].layers)
    extra = sum(layer.store.key_mean.numel() * 2 for layer in layers)  # fp16 means
    rep, base = caches[True].memory_report(), caches[False].memory_report()
    assert rep["scales_zeros_bytes"] == base["scales_zeros_bytes"] + extra
    assert outs[True].shape == outs[False].shape


def test_center_keys_must_be_a_bool():
    with pytest.raises(ValueError, match="center_keys must be True or False, got 1"):
        CocktailConfig(center_keys=1)
    assert CocktailConfig.recommended().center_keys and not CocktailConfig().center_keys
