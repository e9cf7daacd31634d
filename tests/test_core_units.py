"""Config validation, the reference quantizer/packer, and the chunk search."""

import json

import pytest
import torch

from hf_cocktail import CocktailConfig
from hf_cocktail.planning.plans import assign_precisions
from hf_cocktail.planning.scoring import score_chunks
from hf_cocktail.storage import quant

from .conftest import ConstEncoder, FakeEncoder


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 2.5}, "chunk_size"),
        ({"alpha": 1.5}, "alpha"),
        ({"beta": -0.1}, "beta"),
        ({"alpha": 0.7, "beta": 0.5}, "alpha + beta"),
        ({"encoder": ""}, "encoder"),
        ({"group_size": 24}, "group_size"),
        ({"uniform_bits": 8}, "uniform_bits"),
        ({"uniform_bits": True}, "uniform_bits"),
        ({"backend": "cuda"}, "backend"),
        ({"scale_dtype": "int8"}, "scale_dtype"),
    ],
)
def test_config_rejects_bad_values_naming_argument_and_value(kwargs, needle):
    with pytest.raises(ValueError) as e:
        CocktailConfig(**kwargs)
    msg = str(e.value)
    assert needle in msg and repr(next(iter(kwargs.values()))) in msg


def test_config_round_trip(tmp_path):
    cfg = CocktailConfig(chunk_size=16, alpha=0.5, uniform_bits=4, backend="torch")
    assert CocktailConfig.from_dict(cfg.to_dict()) == cfg
    path = cfg.save_pretrained(tmp_path)
    assert json.load(open(path))["format_version"] == 1
    assert CocktailConfig.from_pretrained(tmp_path) == cfg
    assert CocktailConfig.from_pretrained(tmp_path, alpha=0.2).alpha == 0.2


def test_config_from_dict_errors():
    with pytest.raises(ValueError, match="unknown CocktailConfig keys"):
        CocktailConfig.from_dict({"chunk_sz": 3})
    with pytest.raises(ValueError, match="format_version"):
        CocktailConfig.from_dict({"format_version": 99})


# ----------------------------------------------------------------------------- quantizer
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pack_unpack_round_trip_exact(bits):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 1 << bits, (3, 7, 64), generator=g, dtype=torch.uint8)
    packed = quant.pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 7, 64 * bits // 8)
    assert torch.equal(quant.unpack_codes(packed, bits), codes)


def test_pack_layout_is_little_end_first():
    codes = torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8)
    assert quant.pack_codes(codes, 2).tolist() == [[1 | (2 << 2) | (3 << 4)]]
    assert quant.pack_codes(torch.tensor([[5, 12]], dtype=torch.uint8), 4).tolist() == [[5 | (12 << 4)]]


def test_int3_layout_is_a_two_bit_plane_then_a_one_bit_plane():
    codes = torch.tensor([[7, 0, 5, 2, 1, 6, 3, 4]], dtype=torch.uint8)  # D = 8
    packed = quant.pack_codes(codes, 3).tolist()[0]
    low = [c & 3 for c in codes[0].tolist()]
    high = [c >> 2 for c in codes[0].tolist()]
    assert packed[:2] == [sum(c << (2 * i) for i, c in enumerate(low[j : j + 4])) for j in (0, 4)]
    assert packed[2] == sum(h << i for i, h in enumerate(high))
    with pytest.raises(ValueError, match="multiple of 8"):
        quant.pack_codes(torch.zeros(1, 4, dtype=torch.uint8), 3)


def _step_bound(x_groups_min, x_groups_max, bits, dtype):
    # half a quantization step, plus the rounding of scale/zero to their storage dtype
    step = (x_groups_max - x_groups_min) / ((1 << bits) - 1)
    eps = torch.finfo(dtype).eps
    return step / 2 + eps * (x_groups_max.abs() + x_groups_min.abs()) * (1 << bits)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("N", [64, 45, 1])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_keys_error_within_half_step_per_group(bits, N, scale_dtype):
    C = 16
    k = torch.randn(2, N, 32, generator=torch.Generator().manual_seed(N)) * 3
    codes, scale, zero = quant.quantize_pack_keys(k, bits, C, scale_dtype)
    M = -(-N // C)
    assert codes.shape == (2, N, 32 * bits // 8) and scale.shape == (2, M, 32) and scale.dtype == scale_dtype
    deq = quant.dequantize_keys(codes, scale, zero, bits, C)
    for m in range(M):
        grp = k[:, m * C : (m + 1) * C]
        bound = _step_bound(grp.amin(1, keepdim=True), grp.amax(1, keepdim=True), bits, scale_dtype)
        assert ((deq[:, m * C : (m + 1) * C] - grp).abs() <= bound + 1e-6).all()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_values_error_within_half_step_per_group(bits):
    G = 16
    v = torch.randn(3, 10, 64, generator=torch.Generator().manual_seed(1))
    codes, scale, zero = quant.quantize_pack_values(v, bits, G, torch.float16)
    assert scale.shape == (3, 10, 4)
    deq = quant.dequantize_values(codes, scale, zero, bits, G)
    g = v.reshape(3, 10, 4, G)
    bound = _step_bound(g.amin(-1, keepdim=True), g.amax(-1, keepdim=True), bits, torch.float16)
    assert ((deq.reshape(3, 10, 4, G) - g).abs() <= bound + 1e-6).all()
    # the error is not trivially zero: 2/3/4-bit codes really lose information
    assert (deq - v).abs().max() > 1e-3


def test_constant_group_is_exact():
    k = torch.full((1, 8, 8), 0.75)
    codes, scale, zero = quant.quantize_pack_keys(k, 2, 4)
    assert torch.equal(quant.dequantize_keys(codes, scale, zero, 2, 4), k)


def test_quantizer_errors():
    with pytest.raises(ValueError, match="bits must be one of"):
        quant.quantize_pack_keys(torch.zeros(1, 4, 8), 5, 4)
    with pytest.raises(ValueError, match="group_size=24 must divide"):
        quant.quantize_pack_values(torch.zeros(1, 4, 64), 2, 24)
    with pytest.raises(ValueError, match="NaN or inf"):
        quant.quantize_pack_keys(torch.tensor([[[float("nan")] * 8]]), 2, 4)
    with pytest.raises(ValueError, match="overflow scale_dtype"):
        quant.quantize_pack_values(torch.tensor([[[-7e4, 7e4, 0.0, 1.0]]]), 2, 4, torch.float16)


# ----------------------------------------------------------------------------- search
def test_thresholds_follow_the_paper_formula():
    s = torch.tensor([0.0, 0.5, 0.6, 0.61, 0.9, 0.91, 1.0], dtype=torch.float64)
    # T_low = 0.6, T_high = 0.9: > 0.9 -> 16; (0.6, 0.9] -> 4; <= 0.6 -> 2
    assert assign_precisions(s, 0.6, 0.1) == [2, 2, 2, 4, 4, 16, 16]
    assert assign_precisions(s, 0.0, 0.0) == [2, 4, 4, 4, 4, 4, 4]
    assert assign_precisions(s, 0.6, 0.1, low_bits=3) == [3, 3, 3, 4, 4, 16, 16]


def test_all_equal_scores_give_all_int2_as_the_formula_says():
    assert assign_precisions(torch.full((5,), 0.3), 0.6, 0.1) == [2] * 5
    assert assign_precisions(torch.zeros(0), 0.6, 0.1) == []
    assert score_chunks(ConstEncoder(), "q", ["a", "b"]).tolist() == pytest.approx([1.0, 1.0])


def test_score_chunks_ranks_the_relevant_chunk_first_in_one_encoder_call():
    enc = FakeEncoder()
    s = score_chunks(enc, "secret code", ["w1 w2 w3", "the secret code is w7", "w4 w5"])
    assert enc.calls == 1
    assert int(s.argmax()) == 1
    assert assign_precisions(s, 0.6, 0.1)[1] == 16


def test_promote_neighbors():
    from hf_cocktail.planning.plans import promote_neighbors

    assert promote_neighbors([2, 2, 16, 4, 2, 2, 16], 1) == [2, 16, 16, 16, 2, 16, 16]
    assert promote_neighbors([16, 2, 2], 0) == [16, 2, 2]
    with pytest.raises(ValueError, match="neighbors applies to the alpha/beta mode"):
        CocktailConfig(neighbors=1, target_bits=6.0)
