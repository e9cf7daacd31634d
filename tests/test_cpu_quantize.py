"""cpu_ops' fused quantizers against the PyTorch reference ``hf_cocktail.storage.quant`` (the spec of the storage
format): codes, scales and zeros must be equal (torch.equal), the errors the same, and the dispatcher must route CPU
prefills with backend "auto" / "cpu" to them (the stores then equal the "torch" backend's)."""

from __future__ import annotations

import os

import pytest
import torch

import cpu_ops
from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.decode.dispatch import quantizers
from hf_cocktail.storage import quant

from .conftest import FakeEncoder, make_prompt, make_tiny_llama, prefill_all_but_last

if not cpu_ops.available():  # compiles on first use (about a minute), then loads the cached build
    if os.environ.get("HF_COCKTAIL_REQUIRE_CPU_OPS") == "1":  # CI: a build failure must fail, not skip
        raise RuntimeError(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}")
    pytest.skip(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}", allow_module_level=True)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPES = (None, torch.float16, torch.bfloat16, torch.float32)


def _data(H, N, D, dtype, seed=0, magnitude=1.0):
    """Random states with outlier channels, a few huge single entries, a constant channel and a constant token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(H, N, D, generator=g) * (1 + 15 * (torch.rand(1, 1, D, generator=g) < 0.1))
    if N:
        x[0, N // 2, D // 3] = 40.0
        x[-1, (N - 1) // 3, -1] = -25.0
        x[:, :, 1] = 0.75  # keys: every chunk of channel 1 is constant (scale 0)
        x[:, -1, :] = -1.5  # values: the last token's groups are constant
    return (x * magnitude).to(dtype)


def _both(name: str, *args):
    """(reference outputs or its ValueError message, fused outputs or its ValueError message)."""
    out = []
    for mod in (quant, cpu_ops):
        try:
            out.append(getattr(mod, name)(*args))
        except ValueError as e:
            out.append(str(e))
    return out


def assert_same(name: str, *args):
    ref, fused = _both(name, *args)
    if isinstance(ref, str) or isinstance(fused, str):
        assert fused == ref
        return
    for what, r, f in zip(("codes", "scale", "zero"), ref, fused):
        assert f.dtype == r.dtype and f.shape == r.shape, (what, f.dtype, f.shape, r.dtype, r.shape)
        assert torch.equal(f, r), what


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_keys_equal_the_reference(bits, dtype, scale_dtype):
    x = _data(2, 75, 64, dtype)  # 75 = 2 chunks of 32 + a partial chunk of 11
    for C in (32, 7, 1, 75, 200):
        assert_same("quantize_pack_keys", x, bits, C, scale_dtype)


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_values_equal_the_reference(bits, dtype, scale_dtype):
    x = _data(2, 29, 64, dtype, seed=1)
    for G in (16, 32, 64, 4):  # 4: not a multiple of the 8-lane min / max
        assert_same("quantize_pack_values", x, bits, G, scale_dtype)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("D, C, G", [(8, 3, 8), (12, 5, 6), (128, 16, 128), (40, 32, 8)])
def test_other_head_dims(bits, D, C, G):
    x = _data(3, 41, D, torch.float32, seed=D)
    assert_same("quantize_pack_keys", x, bits, C, torch.float16)
    assert_same("quantize_pack_values", x, bits, G, torch.float16)


@pytest.mark.parametrize("magnitude", [1e-3, 1e-30, 1e-38, 1e-41, 1e4])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_extreme_magnitudes(magnitude, scale_dtype):
    """Scales that round to 0 (codes 0), subnormal scales whose inverse overflows (0 * inf: code 0 as in torch's
    clamp + uint8 conversion), and ranges at the edge of float16."""
    x = _data(2, 40, 16, torch.float32, seed=3, magnitude=magnitude)
    for bits in (2, 3, 4):
        assert_same("quantize_pack_keys", x, bits, 8, scale_dtype)
        assert_same("quantize_pack_values", x, bits, 8, scale_dtype)


def test_constant_groups_get_scale_zero_and_code_zero():
    x = torch.full((2, 20, 16), 3.0)
    codes, scale, zero = cpu_ops.quantize_pack_keys(x, 4, 8, torch.float16)
    assert torch.equal(scale, torch.zeros_like(scale)) and torch.equal(zero, torch.full_like(zero, 3.0))
    assert torch.equal(codes, torch.zeros_like(codes))
    assert_same("quantize_pack_values", x, 2, 8, torch.bfloat16)


def test_non_contiguous_input():
    x = _data(40, 3, 32, torch.float32).transpose(0, 1)  # (3, 40, 32), not contiguous
    assert_same("quantize_pack_keys", x, 4, 16, torch.float16)
    assert_same("quantize_pack_values", x, 2, 16, torch.float16)


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_counts(threads):
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = _data(3, 1500, 64, torch.float32, seed=5)
        assert_same("quantize_pack_keys", x, 2, 32, torch.float16)
        assert_same("quantize_pack_values", x, 4, 32, torch.float16)
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_tokens(dtype):
    x = torch.zeros(3, 0, 64, dtype=dtype)
    for bits in (2, 3, 4):
        assert_same("quantize_pack_keys", x, bits, 32, torch.float16)
        assert_same("quantize_pack_values", x, bits, 32, None)
    codes, scale, zero = cpu_ops.quantize_pack_keys(x, 2, 32)
    assert codes.shape == (3, 0, 16) and scale.shape == zero.shape == (3, 0, 64) and scale.dtype == dtype


@pytest.mark.parametrize("name", ["quantize_pack_keys", "quantize_pack_values"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_inputs_raise_like_the_reference(name, bad):
    x = _data(2, 40, 32, torch.float32)
    x[1, 37, 5] = bad
    ref, fused = _both(name, x, 4, 16, torch.float16)
    assert isinstance(ref, str) and "contain NaN or inf" in ref and fused == ref


@pytest.mark.parametrize("name", ["quantize_pack_keys", "quantize_pack_values"])
def test_non_finite_wins_over_overflow(name):
    """As in the reference, which checks the inputs before any scale: a NaN anywhere is the error reported."""
    x = _data(2, 40, 32, torch.float32) * 1e6  # scales overflow float16 everywhere
    x[1, 37, 5] = float("nan")
    ref, fused = _both(name, x, 2, 16, torch.float16)
    assert isinstance(ref, str) and "contain NaN or inf" in ref and fused == ref


@pytest.mark.parametrize("name", ["quantize_pack_keys", "quantize_pack_values"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_overflow_raises_like_the_reference(name, dtype):
    x = _data(2, 40, 32, torch.float32)
    x[0, 3, 4] = 2e5  # zero (the min) fine, the scale of that group overflows float16
    x[1, 20, 8] = -7e4  # the zero overflows float16
    ref, fused = _both(name, x.to(dtype), 2, 16, torch.float16)
    assert isinstance(ref, str) and "overflow scale_dtype=torch.float16" in ref and fused == ref
    x[1, 20, 8], x[0, 3, 4] = 0.0, 2e6  # only a scale overflows: (2e6 - min) / 15 > 65504
    ref, fused = _both(name, x.to(dtype), 4, 16, torch.float16)
    assert isinstance(ref, str) and "overflow" in ref and fused == ref
    # float32 inputs whose range overflows float32 itself (max - min = inf): the float32 scale overflows too
    y = torch.zeros(1, 4, 8)
    y[0, 0, 0], y[0, 1, 0] = 3e38, -3e38  # a key chunk's channel
    y[0, 2, 0], y[0, 2, 1] = 3e38, -3e38  # a value group
    ref, fused = _both(name, y, 4, 8, torch.float32)
    assert isinstance(ref, str) and "overflow scale_dtype=torch.float32" in ref and fused == ref


@pytest.mark.parametrize(
    "name, args, match",
    [
        ("quantize_pack_keys", (torch.zeros(2, 4, 64), 5, 8), r"bits must be one of \(2, 3, 4\), got 5"),
        ("quantize_pack_values", (torch.zeros(2, 4, 63), 2, 8), r"head dim D=63 must be a multiple of 4"),
        ("quantize_pack_keys", (torch.zeros(2, 4, 12), 3, 8), r"head dim D=12 must be a multiple of 8"),
        ("quantize_pack_values", (torch.zeros(2, 4, 64), 4, 48), r"group_size=48 must divide the head dim D=64"),
    ],
)
def test_invalid_arguments_raise_like_the_reference(name, args, match):
    ref, fused = _both(name, *args)
    assert isinstance(ref, str) and fused == ref
    with pytest.raises(ValueError, match=match):
        getattr(cpu_ops, name)(*args)


@pytest.mark.parametrize(
    "name, args, match",
    [
        ("quantize_pack_keys", (torch.zeros(2, 4, 64, dtype=torch.float64), 4, 8), r"keys must be of dtype"),
        ("quantize_pack_keys", (torch.zeros(4, 64), 4, 8), r"keys must be of shape \(H_kv, N, D\)"),
        ("quantize_pack_keys", (torch.zeros(2, 4, 64), 4, 0), r"chunk_size must be an int >= 1, got 0"),
        ("quantize_pack_values", ([[0.0]], 4, 8), r"values must be a torch.Tensor, got list"),
        ("quantize_pack_values", (torch.zeros(2, 4, 64), 4, 8, torch.int8), r"scale_dtype must be torch.float32"),
    ],
)
def test_launcher_checks(name, args, match):
    with pytest.raises(ValueError, match=match):
        getattr(cpu_ops, name)(*args)


# ----------------------------------------------------------------------------- dispatch and a whole prefill
def test_auto_on_cpu_picks_the_fused_quantizers(monkeypatch):
    """backend "auto" (and "cpu") on CPU tensors quantize with cpu_ops, every bit width; "torch" with the reference."""
    called = []
    for name in ("quantize_pack_keys", "quantize_pack_values"):

        def recorded(x, bits, *a, _name=name, **k):
            called.append((_name, bits))
            return getattr(quant, _name)(x, bits, *a, **k)

        monkeypatch.setattr(cpu_ops, name, recorded)
    x = _data(2, 20, 32, torch.float32)
    for backend in ("auto", "cpu", "torch"):
        called.clear()
        qk, qv = quantizers(backend, torch.device("cpu"))
        for bits in (2, 3, 4):
            qk(x, bits, 8, torch.float16)
            qv(x, bits, 8, torch.float16)
        want = [(n, b) for b in (2, 3, 4) for n in ("quantize_pack_keys", "quantize_pack_values")]
        assert called == ([] if backend == "torch" else want), backend


@pytest.mark.parametrize(
    "dtype, rotation, low_bits",
    [
        (torch.float32, None, 2),
        (torch.bfloat16, "hadamard", 2),
        (torch.float32, None, 3),
        (torch.float32, "hadamard", 3),
    ],
)
def test_prefill_stores_equal_the_torch_backend(tiny_tokenizer, monkeypatch, dtype, rotation, low_bits):
    """A tiny Llama prefill of two prompts of different lengths, with a search that picks FP16, INT4 and INT2 (or
    INT3) chunks: the stores built with backend "cpu" (which calls the fused quantizers) equal backend "torch"'s."""
    calls = {"quantize_pack_keys": 0, "quantize_pack_values": 0}
    for name in calls:

        def counted(*a, _fn=getattr(cpu_ops, name), _name=name, **k):  # noqa: B008 (bound per loop turn)
            calls[_name] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(cpu_ops, name, counted)
    prompts = [make_prompt(60, seed=1, needle_at=20), make_prompt(37, seed=2, needle_at=4)]
    model = make_tiny_llama(head_dim=64, dtype=dtype)
    caches, shared = {}, None
    for backend in ("torch", "cpu"):
        cfg = CocktailConfig(
            chunk_size=8,
            group_size=32,
            alpha=0.4,
            beta=0.2,
            backend=backend,
            rotation=rotation,
            low_bits=low_bits,
        )
        cache = CocktailCache(cfg, encoder=FakeEncoder())
        inputs = cache.prepare_inputs(
            tiny_tokenizer,
            [p for p, _, _ in prompts],
            contexts=[c for _, c, _ in prompts],
            queries=[q for _, _, q in prompts],
        )
        shared = shared or prefill_all_but_last(model, inputs)  # one prefill for both: bit-identical inputs
        cache.load_prefill(shared)
        caches[backend] = cache
    layers = model.config.num_hidden_layers
    assert calls == {"quantize_pack_keys": 2 * 2 * layers, "quantize_pack_values": 2 * 2 * layers}
    ref, fused = caches["torch"], caches["cpu"]
    assert fused.precision_map() == ref.precision_map()
    assert {16, 4, low_bits} <= {b for row in ref.precision_map() for b in row}
    for lt, lx in zip(ref.layers, fused.layers):
        for st, sx in zip(lt.store.segments, lx.store.segments):
            assert st.num_tokens > 0 and st.tok_off == sx.tok_off and st.chunk_off == sx.chunk_off
            assert all(torch.equal(a, b) for a, b in zip(st.tensors(), sx.tensors()))
        assert torch.equal(lt.store.full.keys, lx.store.full.keys)
        assert torch.equal(lt.store.full.values, lx.store.full.values)
