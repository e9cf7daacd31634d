"""The fused 8-bit full-part writer (``cpu_ops.append_tokens8``): bit for bit the PyTorch reference
(``quant.quantize_tokens8`` + the part's append), its argument checks, and a decode that uses it (attached by the
dispatch on the fused CPU backend) equal to the same decode with the reference writer."""

import os

import pytest
import torch

import cpu_ops
from hf_cocktail import CocktailConfig
from hf_cocktail.cache import layer as layer_module
from hf_cocktail.storage import quant
from hf_cocktail.storage.full_part import Int8FullPart
from hf_cocktail.storage.rotation import Rotation
from hf_cocktail.storage.store import LayerStore

from .conftest import generate_greedy, make_tiny_llama

if not cpu_ops.available():
    if os.environ.get("HF_COCKTAIL_REQUIRE_CPU_OPS") == "1":  # CI: a build failure must fail, not skip
        raise RuntimeError(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}")
    pytest.skip(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}", allow_module_level=True)

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def _tokens(dtype, seed=0, shape=(2, 3, 5, 64)):
    """Heads at very different magnitudes, a zero token, exact halves (round half to even) and a clipped extreme."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.tensor([1e-3, 1.0, 50.0]).view(1, 3, 1, 1)
    x[0, 0, 1] = 0
    x[1, 1, 2, :4] = torch.tensor([63.5, -31.75, 0.25, 0.5])
    return x.to(dtype)


@pytest.mark.parametrize("x_dtype", FLOATS)
@pytest.mark.parametrize("scale_dtype", FLOATS)
def test_the_writer_writes_the_reference_codes_and_scales(x_dtype, scale_dtype):
    k, v = _tokens(x_dtype, 0), _tokens(x_dtype, 1)
    codes = torch.zeros(2, 2, 3, 9, 64, dtype=torch.int8)
    scales = torch.zeros(2, 2, 3, 9, 1, dtype=scale_dtype)
    views = cpu_ops.append_tokens8(k, v, (codes[0], codes[1]), (scales[0], scales[1]), 3)
    for i, x in enumerate((k, v)):
        ref_codes, ref_scales = quant.quantize_tokens8(x, scale_dtype, check=False)
        assert torch.equal(codes[i, :, :, 3:8], ref_codes) and torch.equal(scales[i, :, :, 3:8], ref_scales)
    # the returned views: the buffers' first pos + L tokens, sharing their memory
    for view, buf in zip(views, (codes[0], codes[1], scales[0], scales[1])):
        assert view.shape == (*buf.shape[:2], 8, buf.shape[3]) and view.data_ptr() == buf.data_ptr()
        assert view.stride() == buf.stride() and torch.equal(view, buf[:, :, :8])
    assert not codes[:, :, :, :3].any() and not codes[:, :, :, 8:].any()  # nothing outside [pos, pos + L)


def test_scales_beyond_the_dtype_and_non_finite_tokens_behave_as_the_unchecked_reference():
    x = torch.tensor([1e7, 1.0, 0.0, -2.0, float("nan"), 1.0, float("inf"), 3.0]).view(1, 1, 2, 4)
    codes, scales = torch.zeros(1, 1, 2, 4, dtype=torch.int8), torch.zeros(1, 1, 2, 1, dtype=torch.float16)
    cpu_ops.append_tokens8(x, x, (codes, codes.clone()), (scales, scales.clone()), 0)
    ref_codes, ref_scales = quant.quantize_tokens8(x, torch.float16, check=False)
    assert scales[0, 0, 0].isinf() and scales[0, 0, 1].isnan() and ref_scales[0, 0, 1].isnan()
    assert torch.equal(codes[0, 0, 0], ref_codes[0, 0, 0])  # an overflowing scale: every code 0, as there
    # a NaN scale dequantizes the token to NaN whatever its codes: the attention output shows it
    assert quant.dequantize_tokens8(codes, scales, torch.float32)[0, 0, 1].isnan().all()


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "pos": -1}, "pos must be >= 0"),
        (lambda a: {**a, "pos": 7}, r"has room for 9 tokens, tokens \[7, 12\)"),
        (lambda a: {**a, "v": a["v"][:, :2]}, "v must match k"),
        (lambda a: {**a, "k": a["k"].transpose(2, 3)}, "k must be a .* contiguous last dim"),
        (
            lambda a: {**a, "codes": (a["codes"][0].to(torch.uint8), a["codes"][1])},
            r"codes\[0\] \(the key codes\) must be int8",
        ),
        (
            lambda a: {**a, "codes": (a["codes"][0], a["codes"][1][:1])},
            r"codes\[1\] \(the value codes\) must be a CPU tensor of shape",
        ),
        (
            lambda a: {**a, "scales": (a["scales"][0], a["scales"][1].float())},
            r"scales\[0\] and scales\[1\] .* must have one dtype",
        ),
        (
            lambda a: {**a, "scales": (a["scales"][0][..., :0], a["scales"][1])},
            r"scales\[0\] \(the key scales\) must be a CPU tensor",
        ),
        (lambda a: {**a, "rotation": "hadamard"}, "rotation must be None or a pair"),
        (
            lambda a: {**a, "rotation": (torch.zeros(3, 64, 32), None)},
            r"rotation\[0\] \(the key matrices\) must be a float32 CPU tensor \(H_kv, D, D\)",
        ),
        (
            lambda a: {**a, "rotation": (None, torch.zeros(3, 64, 64, dtype=torch.float64))},
            r"rotation\[1\] \(the value matrices\) must be a float32",
        ),
        (
            lambda a: {**a, "rotation": (torch.zeros(2, 64, 64), None)},
            r"rotation\[0\] .* H_kv dividing the tokens' heads 3",
        ),
    ],
)
def test_bad_arguments_are_refused_naming_them(change, match):
    k = _tokens(torch.float32)
    args = {
        "k": k,
        "v": k.clone(),
        "codes": tuple(torch.zeros(2, 3, 9, 64, dtype=torch.int8) for _ in range(2)),
        "scales": tuple(torch.zeros(2, 3, 9, 1, dtype=torch.float16) for _ in range(2)),
        "pos": 0,
    }
    with pytest.raises(ValueError, match=match):
        cpu_ops.append_tokens8(**change(args))


@pytest.mark.parametrize("x_dtype", FLOATS)
@pytest.mark.parametrize("kind", ["hadamard", "hadamard_keys", "hadamard_values"])
def test_the_writer_rotates_as_rotate_pair_bit_for_bit(x_dtype, kind):
    """rotation=: the codes and scales of quantize_tokens8 over Rotation.rotate_pair's tokens, exactly; and the
    dequantized tokens within half a step (plus the fp32 rotation's rounding) of an fp64 rotation."""
    k, v = _tokens(x_dtype, 0), _tokens(x_dtype, 1)
    rot = Rotation.make(kind, 3, 64, seed=5)
    codes = torch.zeros(2, 2, 3, 9, 64, dtype=torch.int8)
    scales = torch.zeros(2, 2, 3, 9, 1, dtype=torch.float16)
    cpu_ops.append_tokens8(k, v, (codes[0], codes[1]), (scales[0], scales[1]), 2, rotation=(rot.keys, rot.values))
    for i, (x, m) in enumerate(zip(rot.rotate_pair(k, v), (rot.keys, rot.values))):
        ref_codes, ref_scales = quant.quantize_tokens8(x, torch.float16, check=False)
        assert torch.equal(codes[i, :, :, 2:7], ref_codes) and torch.equal(scales[i, :, :, 2:7], ref_scales)
        raw = (k, v)[i].double()
        exact = raw if m is None else raw @ m.double()  # (B, H_kv, L, D) @ (H_kv, D, D)
        got = quant.dequantize_tokens8(codes[i, :, :, 2:7], scales[i, :, :, 2:7], torch.float64)
        step = scales[i, :, :, 2:7].double()
        tol = 0.5 * step * (1 + 1e-3) + exact.abs().amax(-1, keepdim=True) * 2 * torch.finfo(x_dtype).eps
        assert ((got - exact).abs() <= tol).all()


def test_the_store_appends_through_the_rotating_writer_as_the_reference_does():
    """LayerStore.append with the fused writer passes its rotation to it (one call per append); the codes and scales
    are those of the reference store (PyTorch rotation and quantization) across many appends."""
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(1, 3, 40, 64, generator=g), torch.randn(1, 3, 40, 64, generator=g)
    positions = [{"full": torch.arange(40), 4: torch.arange(0)}]
    stores = [
        LayerStore.build(
            k, v, positions, 8, 32, torch.float16, rotation=Rotation.make("hadamard", 3, 64, 0), full_part_bits=8
        )
        for _ in range(2)
    ]
    calls = []

    def writer(*args):
        calls.append(args[5])
        return cpu_ops.append_tokens8(*args)

    stores[1].full.write8 = writer
    for step in range(20):
        n = 1 if step % 5 else 2
        kn, vn = torch.randn(1, 3, n, 64, generator=g), torch.randn(1, 3, n, 64, generator=g)
        for s in stores:
            s.append(kn, vn)
    rot = stores[1].rotation
    assert len(calls) == 20 and all(c[0] is rot.keys and c[1] is rot.values for c in calls)
    ref, fused = stores[0].full, stores[1].full
    for name in ("keys", "values"):
        assert torch.equal(getattr(fused.codes, name), getattr(ref.codes, name))
        assert torch.equal(getattr(fused.scales, name), getattr(ref.scales, name))


def test_the_part_appends_the_same_with_the_writer_across_growth_and_crops():
    """Many single-token and multi-token appends (the buffers grow several times) and a crop in between."""
    ks = [torch.randn(3, 20, 64), torch.randn(3, 11, 64)]
    parts = [Int8FullPart.from_sequences(ks, ks, torch.float16) for _ in range(2)]
    parts[1].write8 = cpu_ops.append_tokens8
    g = torch.Generator().manual_seed(3)
    for step in range(40):
        n = 1 if step % 7 else 3
        k, v = torch.randn(2, 3, n, 64, generator=g), torch.randn(2, 3, n, 64, generator=g)
        for p in parts:
            p.append(k, v)
            if step == 20:
                p.truncate(2)
    ref, fused = parts
    assert fused.codes._buffers[0].shape == ref.codes._buffers[0].shape  # the same growth rule
    for name in ("keys", "values"):
        assert torch.equal(getattr(fused.codes, name), getattr(ref.codes, name))
        assert torch.equal(getattr(fused.scales, name), getattr(ref.scales, name))


PRESET_LIKE = dict(  # the SmolLM2 preset's formats: rotated, 8-bit scales, per-layer widths, salient tokens
    chunk_size=8,
    group_size=16,
    uniform_bits=4,
    low_bits=2,
    rotation="hadamard",
    full_part_bits=8,
    scale_bits=8,
    layer_bits=[[4, 3], [3, 2]],
    salient_tokens=0.05,
    sink_tokens=2,
)


def generate_with_and_without_writer(tiny_tokenizer, monkeypatch, cfg: CocktailConfig):
    """``{"fused": (output, cache), "reference": (output, cache)}``: greedy ``generate`` with the fused writer the
    dispatch attaches, then with none (monkeypatched away: the PyTorch rotation, quantization and copies)."""
    model = make_tiny_llama(head_dim=32)
    runs = {}
    for writer in ("fused", "reference"):
        if writer == "reference":
            monkeypatch.setattr(layer_module, "attach_fused_writer", lambda store, backend: None)
        runs[writer] = generate_greedy(model, tiny_tokenizer, cfg)
    return runs


@pytest.mark.parametrize(
    "fields",
    [dict(chunk_size=8, group_size=16, uniform_bits=4, rotation="hadamard", full_part_bits=8), PRESET_LIKE],
    ids=["uniform_rotated", "preset_like"],
)
def test_decode_on_the_cpu_backend_uses_the_writer_and_equals_the_reference_writer(tiny_tokenizer, monkeypatch, fields):
    """generate with the writer the dispatch attaches (it rotates the new tokens itself), then with none
    (monkeypatched away: PyTorch rotation and quantization): the same tokens, bit for bit the same logits and the
    same stored codes."""
    cfg = CocktailConfig(**fields)
    runs = generate_with_and_without_writer(tiny_tokenizer, monkeypatch, cfg)
    (fused, fused_cache), (ref, ref_cache) = runs["fused"], runs["reference"]
    assert all(layer.store.full.write8 is cpu_ops.append_tokens8 for layer in fused_cache.layers)
    assert all(layer.store.full.write8 is None for layer in ref_cache.layers)
    assert torch.equal(fused.sequences, ref.sequences)
    assert torch.equal(torch.stack(fused.logits), torch.stack(ref.logits))
    for a, b in zip(fused_cache.layers, ref_cache.layers):
        assert torch.equal(a.store.full.codes.keys, b.store.full.codes.keys)
        assert torch.equal(a.store.full.scales.values, b.store.full.scales.values)


def test_keys_whose_last_dim_is_strided_are_appended_as_the_reference_does():
    ks = [torch.randn(3, 6, 64)]
    parts = [Int8FullPart.from_sequences(ks, ks, torch.float16) for _ in range(2)]
    parts[1].write8 = cpu_ops.append_tokens8
    k = torch.randn(1, 3, 64, 2).transpose(2, 3)  # (1, 3, 2, 64) with a last-dim stride of 2
    assert k.stride(-1) != 1
    for p in parts:
        p.append(k, k)
    assert torch.equal(parts[0].codes.keys, parts[1].codes.keys)
    assert torch.equal(parts[0].scales.values, parts[1].scales.values)
