"""An 8-bit full part whose keys have a basis of their own (``Int8FullPart.key_basis``): where the layer's keys are
stored unrotated beside rotated values, the part stores ``k·F`` (F the values' Hadamard rotation, held anyway) so
that one scale per token serves channels of very different sizes; reads in the layer's basis (PyTorch), the kernels
score it with ``q·F``.

Shapes: B sequences, H_kv key/value heads, T tokens, D head dim.
"""

from __future__ import annotations

import pytest
import torch

from hf_cocktail import CocktailConfig
from hf_cocktail.decode.split_attention import split_precision_attention_torch
from hf_cocktail.storage.full_part import Int8FullPart
from hf_cocktail.storage.rotation import Rotation, full_part_key_basis, shared_matrices
from hf_cocktail.storage.store import LayerStore

from .conftest import assert_fused_cpu_kernel_matches_reference, generate_greedy, make_tiny_llama


def _outlier_keys(H=2, T=50, D=64, seed=0) -> torch.Tensor:
    """``(H, T, D)`` keys with four channels 40x the others (Gemma 3's large key channels)."""
    k = torch.randn(H, T, D, generator=torch.Generator().manual_seed(seed))
    k[:, :, :4] *= 40
    return k


def test_keys_in_their_own_basis_read_back_in_the_layer_basis_and_lose_less():
    """``keys`` and ``tokens`` turn the codes back (``·Fᵀ``); with four large channels, the small channels' error is
    several times smaller than one scale per token gives them unrotated."""
    ks = [_outlier_keys()]
    plain = Int8FullPart.from_sequences(ks, ks, torch.float16)
    own = Int8FullPart.from_sequences(ks, ks, torch.float16, shared_matrices(2, 64, 0))
    assert plain.key_basis is None and own.key_basis is not None
    err = {name: (part.keys[0] - ks[0])[..., 4:].abs().mean().item() for name, part in (("plain", plain), ("own", own))}
    assert err["own"] < err["plain"] / 4, err
    torch.testing.assert_close(own.tokens(10, 5)[0], own.keys[:, :, 10:15])
    assert torch.equal(own.values, plain.values)  # values keep the layer's basis
    q = torch.randn(1, 4, 1, 64)
    torch.testing.assert_close(own.key_query(q), Rotation("hadamard", 0, own.key_basis, None).rotate_query(q))
    assert plain.key_query(q) is None


@pytest.mark.parametrize(
    "bits,kind,has_basis",
    [(8, None, False), (8, "hadamard_values", True), (8, "hadamard", False), (8, "hadamard_keys", False)]
    + [(16, "hadamard_values", False)],
)
def test_the_basis_is_the_values_matrices_beside_unrotated_keys(bits, kind, has_basis):
    """Only where the layer holds matrices anyway (its values') and its keys are unrotated: the basis costs no byte."""
    rotation = Rotation.make(kind, 2, 64, 3)
    basis = full_part_key_basis(bits, rotation)
    assert (basis is not None) == has_basis
    if has_basis:
        assert basis is shared_matrices(2, 64, 3) and rotation is not None and basis is rotation.values


def _store(kind, B=2, T=72, H=2, D=32):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    k[..., :3] *= 30
    positions = [
        {"full": torch.arange(60 + b, T), 4: torch.arange(0, 20 + b), 2: torch.arange(20 + b, 60 + b)} for b in range(B)
    ]
    rotation = Rotation.make(kind, H, D, seed=1)
    basis = shared_matrices(H, D, 1)  # the store takes a basis beside unrotated keys, whatever the values' rotation
    return LayerStore.build(
        k, v, positions, 8, 16, torch.float16, rotation=rotation, full_part_bits=8, full_key_basis=basis
    ), positions


@pytest.mark.parametrize("kind", [None, "hadamard_values"])
@pytest.mark.parametrize("L_q", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cpu_kernel_equals_the_reference(kind, L_q, dtype):
    store, _ = _store(kind)
    store.append(torch.randn(2, 2, L_q, 32), torch.randn(2, 2, L_q, 32))
    query = torch.randn(2, 4, L_q, 32, generator=torch.Generator().manual_seed(5)).to(dtype)
    assert_fused_cpu_kernel_matches_reference(store, query, 32**-0.5)


def test_the_cpu_kernel_reads_the_full_part_key_matrices():
    """Without the third rotation item the kernel scores rotated keys with an unrotated query: far off."""
    cpu_ops = pytest.importorskip("cpu_ops")
    if not cpu_ops.available():
        pytest.skip(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}")
    from cpu_ops.attention import split_precision_attention as fused
    from hf_cocktail.decode.dispatch import _kernel_segment

    store, _ = _store(None)
    full = store.full
    query = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(5))
    args = (query, *full.split_path_tensors(), full.start_tensor(), [_kernel_segment(s) for s in store.segments])
    kw = dict(full_scales=(full.scales.keys, full.scales.values))
    right = fused(*args, 32**-0.5, rotation=(None, None, full.key_basis), **kw)
    wrong = fused(*args, 32**-0.5, **kw)
    torch.testing.assert_close(right, split_precision_attention_torch(query, store, 32**-0.5), atol=1e-4, rtol=1e-4)
    assert (wrong - right).abs().max() > 0.05
    with pytest.raises(ValueError, match=r"rotation\[2\] must be of shape \(2, 32, 32\)"):
        fused(*args, 32**-0.5, rotation=(None, None, full.key_basis[:, :16]), **kw)
    with pytest.raises(ValueError, match="rotation must be a pair .* or a triple .*, got 4 items"):
        fused(*args, 32**-0.5, rotation=(None, None, None, None), **kw)


@pytest.mark.parametrize("rotation,has_basis", [(None, False), ("hadamard_values", True), ("hadamard", False)])
def test_a_cache_gives_its_8_bit_part_a_basis_where_the_layer_keys_are_unrotated(tiny_tokenizer, rotation, has_basis):
    """generate through a CocktailCache (generated tokens packed as they leave the residual window) gives the
    tokens and logits of the PyTorch backend; the part's basis is there exactly where the layer's keys are
    unrotated beside rotated values."""
    model = make_tiny_llama(head_dim=32)
    runs = {}
    for backend in ("cpu", "torch"):
        cfg = CocktailConfig(
            chunk_size=8, group_size=16, uniform_bits=4, rotation=rotation, full_part_bits=8, residual_tokens=8
        )
        cfg.backend = backend
        runs[backend] = generate_greedy(model, tiny_tokenizer, cfg)
    (fused, cache), (ref, _) = runs["cpu"], runs["torch"]
    assert all((layer.store.full.key_basis is not None) == has_basis for layer in cache.layers)
    assert all(layer.store.packed_appended > 0 for layer in cache.layers)
    assert torch.equal(fused.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(fused.logits), torch.stack(ref.logits), atol=1e-4, rtol=1e-4)
