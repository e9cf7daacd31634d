"""Outlier key channels at 8 bits (hf_cocktail.storage.key_outliers): the format, its choice of channels, the store
(bytes, dequantization, appended packing) and split attention over it."""

import dataclasses

import pytest
import torch

from hf_cocktail.decode.split_attention import split_precision_attention_torch
from hf_cocktail.storage import key_outliers as ko
from hf_cocktail.storage import quant
from hf_cocktail.storage.generated import AppendedPacking, pack_appended
from hf_cocktail.storage.rotation import Rotation
from hf_cocktail.storage.store import LayerStore, PackedSegment


def _keys(H=2, N=40, D=32, hot=(3, 17), seed=0):
    """Gaussian keys whose channels ``hot`` are 20x larger (channel-fixed outliers)."""
    k = torch.randn(H, N, D, generator=torch.Generator().manual_seed(seed))
    k[..., list(hot)] *= 20
    return k


@pytest.mark.parametrize(
    "share,D,bits,want",
    [
        (0.0, 64, 4, 0),
        (1 / 16, 64, 4, 4),
        (0.05, 64, 4, 4),
        (0.05, 64, 2, 4),
        (0.05, 64, 3, 8),
        (1 / 8, 256, 4, 32),
        (0.99, 32, 4, 30),
    ],
)
def test_outlier_count_keeps_whole_code_bytes(share, D, bits, want):
    n = ko.outlier_count(share, D, bits)
    assert n == want and (D - n) % quant.channel_multiple(bits) == 0


def test_outlier_count_refuses_a_share_outside_0_1():
    with pytest.raises(ValueError, match=r"share must be in \[0, 1\), got 1.0"):
        ko.outlier_count(1.0, 64, 4)


def test_choose_channels_puts_the_largest_last_each_side_ascending():
    k = _keys(hot=(3, 17))
    scores = ko.channel_scores([k], 8)
    order = ko.choose_channels(scores, 2)
    assert order.dtype == torch.int32 and order.shape == (2, 32)
    for h in range(2):
        assert order[h, -2:].tolist() == [3, 17]
        rest = order[h, :-2].tolist()
        assert rest == sorted(set(range(32)) - {3, 17})


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_quantize_is_the_two_reference_quantizers_on_the_stored_order(bits):
    k, C = _keys(N=37), 8  # a partial last chunk
    n_out = 8
    order = ko.choose_channels(ko.channel_scores([k], C), n_out)
    codes, scale, zero = ko.quantize_pack_keys_outliers(k, bits, C, torch.float16, order, n_out)
    ks = ko.to_stored_order(k, order)
    rc, rs, rz = quant.quantize_pack_keys(ks[..., :-n_out].contiguous(), bits, C, torch.float16)
    Dp = (32 - n_out) * bits // 8
    assert codes.shape == (2, 37, Dp + n_out) and scale.shape == zero.shape == (2, 5, 32)
    assert (
        torch.equal(codes[..., :Dp], rc)
        and torch.equal(scale[..., :-n_out], rs)
        and torch.equal(zero[..., :-n_out], rz)
    )
    # the outliers: min-max over each chunk at 8 bits, the same rule (qmax 255)
    x = quant.whole_chunks(ks[..., -n_out:].float(), C)
    s8 = ((x.amax(2) - x.amin(2)) / 255).half()
    assert torch.equal(scale[..., -n_out:], s8) and torch.equal(zero[..., -n_out:], x.amin(2).half())
    want = quant.group_codes(x, s8.unsqueeze(2), x.amin(2).half().unsqueeze(2), 8).reshape(2, -1, n_out)[:, :37]
    assert torch.equal(codes[..., Dp:], want)
    deq = ko.dequantize_keys_outliers(codes, scale, zero, bits, C, order, n_out)
    # channel order restored: the outlier channels' error is within their 8-bit step, far below the 4-bit one's
    step8 = s8.float().repeat_interleave(C, dim=1)[:, :37]
    zero_err = zero[..., -n_out:].float().abs().repeat_interleave(C, dim=1)[:, :37] * 2**-11  # fp16 zeros
    err = ko.to_stored_order(deq - k, order)[..., -n_out:].abs()
    assert (err <= step8 * 0.5 * (1 + 2**-10) + zero_err + 1e-6).all()
    rest_ref = quant.dequantize_keys(rc, rs, rz, bits, C)
    assert torch.equal(ko.to_stored_order(deq, order)[..., :-n_out], rest_ref)


def _store(share, rotation=None, B=2, T=72, H=2, D=32, C=8, G=16, hot=(5, 30)):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    k[..., list(hot)] *= 20
    positions = [{"full": torch.arange(64, T), 4: torch.arange(0, 24), 2: torch.arange(24, 64)}] * B
    rot = None if rotation is None else Rotation.make(rotation, H, D, seed=1)
    extra = {} if share is None else {"key_outlier_share": share}
    store = LayerStore.build(k, v, positions, C, G, torch.float32, rotation=rot, **extra)
    return store, positions, (k, v)


def test_a_store_without_outliers_is_todays():
    store, _, _ = _store(0.0)
    today, _, _ = _store(None)
    assert all(s.key_outliers is None for s in store.segments)
    assert store.nbytes() == today.nbytes()
    for s, t in zip(store.segments, today.segments):
        assert all(torch.equal(a, b) for a, b in zip(s.tensors(), t.tensors()))
        assert s.kernel_args()[0] == t.kernel_args()[0] and s.k_codes.shape[-1] == 32 * s.bits // 8


def test_store_bytes_and_dequantization_with_outliers():
    plain, positions, (k, v) = _store(0.0)
    store, _, _ = _store(1 / 16)
    H, D = 2, 32
    for s, p in zip(store.segments, plain.segments):
        n = s.key_outliers.count
        assert n == ko.outlier_count(1 / 16, D, s.bits)
        assert all({5, 30} <= set(row[-n:]) for row in s.key_outliers.channels.tolist())
        # honest bytes: n outlier channels cost 8 - bits more code bits per token, plus the (H, D) int32 order
        N = s.num_tokens
        extra = H * N * n * (8 - s.bits) // 8 + H * D * 4
        assert s.nbytes_codes() + s.nbytes_params() == p.nbytes_codes() + p.nbytes_params() + extra
    assert store.nbytes() > plain.nbytes()
    keys, _ = store.dequantized(positions, 72, 72)
    plain_keys, _ = plain.dequantized(positions, 72, 72)
    err, plain_err = (keys - k)[:, :, :64].abs(), (plain_keys - k)[:, :, :64].abs()
    assert err[..., [5, 30]].max() < plain_err[..., [5, 30]].max() / 4  # the outliers at 8 bits
    others = [d for d in range(D) if d not in (5, 30)]
    assert torch.equal(err[..., :24, others], plain_err[..., :24, others])  # INT4 rest: the same codes


def test_store_with_outliers_selects_and_refuses_8_bit_scales():
    store, _, _ = _store(1 / 16)
    seg = store.segments[0]
    again = seg.select([1, 0])
    assert again.key_outliers is seg.key_outliers
    assert torch.equal(again.sequence(0)[0], seg.sequence(1)[0])
    with pytest.raises(ValueError, match="scale_bits=16 only, got scale_bits=8"):
        PackedSegment.from_sequences(
            [torch.randn(2, 8, 32)],
            [torch.randn(2, 8, 32)],
            4,
            8,
            16,
            torch.float32,
            None,
            None,
            4,
            8,
            seg.key_outliers,
        )


@pytest.mark.parametrize("rotation", [None, "hadamard"])
def test_split_attention_over_outliers_equals_attention_over_the_dequantized_keys(rotation):
    store, positions, _ = _store(1 / 8, rotation=rotation)
    keys, values = store.dequantized(positions, 72, 72)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 32, generator=g)  # GQA: 2 query heads per kv head
    out = split_precision_attention_torch(q, store, 32**-0.5)
    kk, vv = keys.repeat_interleave(2, dim=1), values.repeat_interleave(2, dim=1)
    ref = torch.softmax(q @ kk.transpose(-1, -2) * 32**-0.5, dim=-1) @ vv
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_appended_tokens_pack_with_the_segments_outlier_channels():
    store, _, _ = _store(1 / 16)
    seg = store.segments[0]
    store.packing = AppendedPacking(segment=0, scale_dtype=torch.float32)
    new_k = torch.randn(2, 2, 16, 32)
    new_k[..., [5, 30]] *= 20
    store.append(new_k, torch.randn(2, 2, 16, 32))
    assert pack_appended(store, 0) == 16
    packed = store.segments[0]
    assert packed.key_outliers is seg.key_outliers and packed.num_tokens == seg.num_tokens + 32
    assert packed.k_codes.shape[-1] == seg.k_codes.shape[-1]
    keys, _ = packed.sequence(0)
    torch.testing.assert_close(keys[:, 24:40], new_k[0], atol=0.3, rtol=0)  # 4-bit rest, 8-bit outliers
    assert dataclasses.replace(packed).key_outliers is seg.key_outliers


@pytest.mark.parametrize("bad", [-0.1, 0.6, "0.1", True, None])
def test_config_validates_key_outlier_share(bad):
    from hf_cocktail import CocktailConfig

    with pytest.raises(ValueError, match=rf"key_outlier_share must be a number in \[0, 0.5\].*got {bad!r}"):
        CocktailConfig(key_outlier_share=bad)


def test_config_key_outlier_share_needs_16_bit_scales_and_counts_its_bits():
    from hf_cocktail import CocktailConfig

    with pytest.raises(ValueError, match=r"key_outlier_share=0.125 needs scale_bits=16 .* got scale_bits=8"):
        CocktailConfig(key_outlier_share=0.125, scale_bits=8)
    cfg = CocktailConfig.recommended(key_outlier_share=0.125, scale_bits=16)
    assert CocktailConfig.from_dict(cfg.to_dict()) == cfg
    # 1/8 of the key channels at 8 bits instead of 4: half a bit per key element, a quarter per K/V element
    plain = CocktailConfig.recommended(scale_bits=16)
    assert cfg.packed_bits_per_element(4) == plain.packed_bits_per_element(4) + 0.25


def test_generate_with_outlier_channels_equals_dequantized_sdpa(tiny_tokenizer):
    from hf_cocktail import CocktailConfig

    from .conftest import generate_split_and_sdpa

    cfg = CocktailConfig(chunk_size=8, group_size=16, alpha=0.3, beta=0.3, rotation="hadamard", key_outlier_share=0.1)
    runs = generate_split_and_sdpa(tiny_tokenizer, cfg)
    for _, cache in runs.values():
        segments = cache.layers[0].store.segments
        assert [s.key_outliers.count for s in segments] == [4, 4]  # D=32: 3.2 channels, rounded to whole bytes
    (split, _), (sdpa, _) = runs["cocktail"], runs["sdpa"]
    assert torch.equal(split.sequences, sdpa.sequences)
    torch.testing.assert_close(torch.stack(split.logits), torch.stack(sdpa.logits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("low", [2, 3])
@pytest.mark.parametrize("share,rotation", [(1 / 16, None), (1 / 8, "hadamard"), (0.3, "hadamard")])
def test_fused_cpu_kernel_reads_outlier_channels(low, share, rotation):
    """The 4-bit segment's rest (D=32 minus 2, 4 or 10 outliers) ends with a partial group of 8 channels; INT3's is
    whole (8 or 16 outliers)."""
    g = torch.Generator().manual_seed(0)
    B, H, T, D = 2, 2, 200, 32
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    k[..., [5, 30]] *= 20
    positions = [{"full": torch.arange(180, T), 4: torch.arange(0, 77), low: torch.arange(77, 180)}] * B
    rot = None if rotation is None else Rotation.make(rotation, H, D, seed=1)
    store = LayerStore.build(k, v, positions, 16, 16, torch.float16, rotation=rot, key_outlier_share=share)
    assert all(s.key_outliers is not None for s in store.segments)
    query = torch.randn(B, 4, 2, D, generator=g)
    from .conftest import assert_fused_cpu_kernel_matches_reference

    assert_fused_cpu_kernel_matches_reference(store, query, D**-0.5)
    assert "cpu" in store.kernel_cache  # the fused kernel read the store (no fallback to the reference)


def test_fused_cpu_kernel_refuses_a_bad_outlier_item():
    cpu_ops = pytest.importorskip("cpu_ops")
    store, _, _ = _store(1 / 16)
    seg = store.segments[0]
    args = seg.coded_kernel_args()
    bad = seg.key_outliers.channels.clone()
    bad[0, 0] = bad[0, 1]
    with pytest.raises(ValueError, match=r"permutation of range\(32\)"):
        cpu_ops.attention.prepare(2, 2, 32, [(*args, (seg.key_outliers.count, bad))])
    with pytest.raises(
        ValueError, match=r"segments\[0\].k_codes must be of shape \(2, 48, 16\), got shape \(2, 48, 17\)"
    ):
        cpu_ops.attention.prepare(2, 2, 32, [(*args, (1, seg.key_outliers.channels))])
