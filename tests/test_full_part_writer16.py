"""The fused full-part writer at the model's precision (``cpu_ops.append_tokens``): bit for bit
``Rotation.rotate_pair`` followed by ``FullPart.append``'s copies, its argument checks, and a decode that uses it
(attached by the dispatch on the fused CPU backend) equal to the same decode with the reference path."""

import os

import pytest
import torch

import cpu_ops
from hf_cocktail import CocktailConfig
from hf_cocktail.storage.full_part import FullPart
from hf_cocktail.storage.rotation import Rotation
from hf_cocktail.storage.store import LayerStore

from .test_full_part_writer import generate_with_and_without_writer

if not cpu_ops.available():
    if os.environ.get("HF_COCKTAIL_REQUIRE_CPU_OPS") == "1":  # CI: a build failure must fail, not skip
        raise RuntimeError(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}")
    pytest.skip(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}", allow_module_level=True)

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def _tokens(dtype, seed=0, shape=(2, 3, 5, 64)):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * torch.tensor([1e-3, 1.0, 50.0]).view(1, 3, 1, 1)).to(dtype)


@pytest.mark.parametrize("x_dtype", FLOATS)
@pytest.mark.parametrize("kind", [None, "hadamard", "hadamard_keys", "hadamard_values"])
@pytest.mark.parametrize("L", [1, 2, 5])
def test_the_writer_writes_rotate_pairs_tokens_bit_for_bit(x_dtype, kind, L):
    k, v = _tokens(x_dtype, 0, (2, 3, L, 64)), _tokens(x_dtype, 1, (2, 3, L, 64))
    rot = Rotation.make(kind, 3, 64, seed=5)
    bufs = torch.full((2, 2, 3, 9, 64), 7.0, dtype=x_dtype)
    views = cpu_ops.append_tokens(k, v, (bufs[0], bufs[1]), 3, None if rot is None else (rot.keys, rot.values))
    ref = (k, v) if rot is None else rot.rotate_pair(k, v)
    for i in range(2):
        assert torch.equal(bufs[i, :, :, 3 : 3 + L], ref[i])
        assert (bufs[i, :, :, :3] == 7).all() and (bufs[i, :, :, 3 + L :] == 7).all()  # nothing outside [pos, pos + L)
        view = views[i]  # the buffer's first pos + L tokens, sharing its memory
        assert view.shape == (2, 3, 3 + L, 64) and view.data_ptr() == bufs[i].data_ptr()
        assert view.stride() == bufs[i].stride()


def test_the_writer_casts_to_the_buffers_dtype_as_copy_does():
    k, v = _tokens(torch.float32, 0), _tokens(torch.float32, 1)
    rot = Rotation.make("hadamard", 3, 64, seed=1)
    bufs = torch.zeros(2, 2, 3, 6, 64, dtype=torch.bfloat16)
    cpu_ops.append_tokens(k, v, (bufs[0], bufs[1]), 1, (rot.keys, rot.values))
    for i, x in enumerate(rot.rotate_pair(k, v)):
        assert torch.equal(bufs[i, :, :, 1:6], x.to(torch.bfloat16))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "pos": -1}, "append_tokens: pos must be >= 0"),
        (lambda a: {**a, "pos": 7}, r"has room for 9 tokens, tokens \[7, 12\)"),
        (lambda a: {**a, "v": a["v"][:, :2]}, "append_tokens: v must match k"),
        (lambda a: {**a, "k": a["k"].transpose(2, 3)}, "append_tokens: k must be a .* contiguous last dim"),
        (
            lambda a: {**a, "buffers": (a["buffers"][0].to(torch.int8), a["buffers"][1])},
            r"buffers\[0\] \(the key buffer\) must be a float tensor",
        ),
        (
            lambda a: {**a, "buffers": (a["buffers"][0], a["buffers"][1][:1])},
            r"buffers\[1\] \(the value buffer\) must be a CPU tensor of shape",
        ),
        (lambda a: {**a, "rotation": "hadamard"}, "rotation must be None or a pair"),
        (
            lambda a: {**a, "rotation": (torch.zeros(3, 64, 32), None)},
            r"append_tokens: rotation\[0\] \(the key matrices\) must be a float32 CPU tensor \(H_kv, D, D\)",
        ),
        (
            lambda a: {**a, "rotation": (torch.zeros(2, 64, 64), None)},
            r"rotation\[0\] .* H_kv dividing the tokens' heads 3",
        ),
    ],
)
def test_bad_arguments_are_refused_naming_them(change, match):
    k = _tokens(torch.float32)
    args = {"k": k, "v": k.clone(), "buffers": tuple(torch.zeros(2, 3, 9, 64) for _ in range(2)), "pos": 0}
    with pytest.raises(ValueError, match=match):
        cpu_ops.append_tokens(**change(args))


def test_a_rotation_without_the_writer_is_refused():
    part = FullPart.from_sequences([torch.randn(3, 4, 64)], [torch.randn(3, 4, 64)])
    with pytest.raises(ValueError, match="rotation= needs the fused writer"):
        part.append(torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64), (None, None))


@pytest.mark.parametrize("kind", [None, "hadamard", "hadamard_keys"])
def test_the_store_appends_through_the_writer_as_the_reference_does_across_growth_and_crops(kind):
    """LayerStore.append with the writer set passes its rotation to it (one call per append); many single- and
    multi-token appends (the buffers grow several times) and a crop in between give the reference store's part."""
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 3, 40, 64, generator=g), torch.randn(2, 3, 40, 64, generator=g)
    positions = [{"full": torch.arange(40), 4: torch.arange(0)}, {"full": torch.arange(9, 40), 4: torch.arange(0)}]
    rot = Rotation.make(kind, 3, 64, 0)
    stores = [LayerStore.build(k, v, positions, 8, 32, torch.float16, rotation=rot) for _ in range(2)]
    calls = []

    def writer(*args):
        calls.append(args[4])
        return cpu_ops.append_tokens(*args)

    stores[1].full.write = writer
    for step in range(30):
        n = 1 if step % 7 else 3
        kn, vn = torch.randn(2, 3, n, 64, generator=g), torch.randn(2, 3, n, 64, generator=g)
        for s in stores:
            s.append(kn, vn)
            if step == 15:
                s.full.truncate(2)
    assert len(calls) == 30
    if rot is None:
        assert all(c is None for c in calls)
    else:
        assert all(c[0] is rot.keys and c[1] is rot.values for c in calls)
    ref, fused = stores[0].full, stores[1].full
    assert fused._buffers[0].shape == ref._buffers[0].shape  # the same growth rule
    assert torch.equal(fused.keys, ref.keys) and torch.equal(fused.values, ref.values)
    assert fused.select([1, 0]).write is writer  # a reordered batch keeps its writer


def test_keys_whose_last_dim_is_strided_are_appended_as_the_reference_does():
    ks = [torch.randn(3, 6, 64)]
    parts = [FullPart.from_sequences(ks, ks) for _ in range(2)]
    parts[1].write = cpu_ops.append_tokens
    k = torch.randn(1, 3, 64, 2).transpose(2, 3)  # (1, 3, 2, 64) with a last-dim stride of 2
    assert k.stride(-1) != 1
    for p in parts:
        p.append(k, k)
    assert torch.equal(parts[0].keys, parts[1].keys) and torch.equal(parts[0].values, parts[1].values)


@pytest.mark.parametrize(
    "fields",
    [
        dict(chunk_size=8, rotation="hadamard", uniform_bits=4, value_bits=3, group_size=32),  # recommended()'s
        dict(chunk_size=8, group_size=16),  # the paper's: unrotated
    ],
    ids=["recommended_like", "paper"],
)
def test_decode_on_the_cpu_backend_uses_the_writer_and_equals_the_reference_path(tiny_tokenizer, monkeypatch, fields):
    """generate with the writer the dispatch attaches, then with none (monkeypatched away: PyTorch rotation and
    copies): the same tokens, bit for bit the same logits and the same stored full part."""
    cfg = CocktailConfig(**fields)
    runs = generate_with_and_without_writer(tiny_tokenizer, monkeypatch, cfg)
    (fused, fused_cache), (ref, ref_cache) = runs["fused"], runs["reference"]
    assert all(layer.store.full.write is cpu_ops.append_tokens for layer in fused_cache.layers)
    assert all(layer.store.full.write is None for layer in ref_cache.layers)
    assert torch.equal(fused.sequences, ref.sequences)
    assert torch.equal(torch.stack(fused.logits), torch.stack(ref.logits))
    for a, b in zip(fused_cache.layers, ref_cache.layers):
        assert torch.equal(a.store.full.keys, b.store.full.keys)
        assert torch.equal(a.store.full.values, b.store.full.values)
