"""The fused CPU kernel on the stored formats of the recommended settings, read as stored: 8-bit scale / zero codes
(``scale_bits=8``), the 8-bit full part (``full_part_bits=8``) and rotated storage (the query rotated and the output
rotated back inside the kernel), for head dims 64, 128, 256 and 1 to 8 KV heads.

The truth is an fp64 attention over the store dequantized by the references (``params8.decode_params8``,
``quant.dequantize_tokens8``), in the store's basis, with the query rotated and the output rotated back in fp64.
Tolerance (the project's rule, as in ``test_cpu_ops``): the kernel's error is at most twice the error of the PyTorch
reference path (``backend="torch"``) against that truth, plus for fp32 eps * sqrt(T) * max|v|.

Shapes: B batch, H_q query heads, H_kv key/value heads, L_q query tokens, T tokens, D head dim.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

import cpu_ops
from hf_cocktail.decode import dispatch
from hf_cocktail.decode.split_attention import split_precision_attention_torch
from hf_cocktail.storage import quant
from hf_cocktail.storage.full_part import Int8FullPart
from hf_cocktail.storage.rotation import Rotation
from hf_cocktail.storage.store import LayerStore

from .conftest import cpu_kernel_low_precision

if not cpu_ops.available():
    if os.environ.get("HF_COCKTAIL_REQUIRE_CPU_OPS") == "1":
        raise RuntimeError(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}")
    pytest.skip(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}", allow_module_level=True)


def make_store(D=64, H_kv=2, n_rep=2, B=2, T=80, L_q=1, scale_bits=8, full_part_bits=8, rotation=None, seed=0, G=16):
    """A layer store of ``B`` sequences of ``T`` prompt tokens plus ``L_q`` appended ones, chunks of 8 at 4 and 2
    bits (the second sequence one chunk shorter: left padding); returns ``(query (B, H_kv * n_rep, L_q, D), store)``."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H_kv, T, D, generator=g) * (1 + 4 * (torch.rand(1, 1, 1, D, generator=g) < 0.1))
    v = torch.randn(B, H_kv, T, D, generator=g)
    chunks = torch.arange(T // 8)
    positions = []
    for b in range(B):
        first = 8 * b  # sequence 1 starts one chunk later
        full = torch.cat([torch.arange(first, first + 3), torch.arange(T - 5, T)])
        four = torch.cat([torch.arange(8 * c + 3 * (c == b // 8), 8 * c + 8) for c in chunks[(chunks % 3 == 1)]])
        two = torch.cat([torch.arange(8 * c, 8 * c + 8) for c in chunks[(chunks % 3 == 2) & (chunks < T // 8 - 1)]])
        positions.append({"full": full, 4: four[four >= first + 3], 2: two[two >= first + 3]})
    rot = Rotation.make(rotation, H_kv, D, seed=1)
    store = LayerStore.build(
        k, v, positions, 8, G, torch.float16, rotation=rot, scale_bits=scale_bits, full_part_bits=full_part_bits
    )
    store.append(torch.randn(B, H_kv, L_q, D, generator=g), torch.randn(B, H_kv, L_q, D, generator=g))
    query = torch.randn(B, H_kv * n_rep, L_q, D, generator=g) * 2
    return query, store


def attention_at(query: torch.Tensor, store: LayerStore, scaling: float, dtype=torch.float64) -> torch.Tensor:
    """Attention at ``dtype`` (fp64: the truth) over the store as the references dequantize it, ``(B, H_q, L_q, D)``."""
    B, H_q, L_q, D = query.shape
    full = store.full
    if isinstance(full, Int8FullPart):
        fk, fv = (
            c.to(dtype) * s.to(dtype)
            for c, s in ((full.codes.keys, full.scales.keys), (full.codes.values, full.scales.values))
        )
    else:
        fk, fv = full.keys.to(dtype), full.values.to(dtype)
    rot = store.rotation
    out = torch.zeros(B, H_q, L_q, D, dtype=dtype)
    for b in range(B):
        s = full.start[b]
        parts = [seg.sequence(b) for seg in store.segments] + [(fk[b, :, s:], fv[b, :, s:])]
        K = torch.cat([p[0].to(dtype) for p in parts], 1)
        V = torch.cat([p[1].to(dtype) for p in parts], 1)
        H_kv, T = K.shape[0], K.shape[1]
        q = query[b].to(dtype).reshape(H_kv, H_q // H_kv * L_q, D)
        if rot is not None and rot.keys is not None:
            q = q @ rot.keys.to(dtype)
        scores = (q * scaling) @ K.transpose(1, 2)
        i = torch.arange(L_q).repeat(H_q // H_kv)
        hidden = torch.arange(T)[None, :] > (T - L_q + i)[:, None]
        o = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ V
        if rot is not None and rot.values is not None:
            o = o @ rot.values.to(dtype).transpose(1, 2)
        out[b] = o.reshape(H_q, L_q, D)
    return out


def check(query, store, scaling=None):
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the PyTorch path would warn: it must not happen here
        out = dispatch.split_precision_attention(query, store, scaling, "cpu")
    assert out.dtype == query.dtype and out.shape == query.shape
    truth = attention_at(query, store, scaling)
    low = split_precision_attention_torch(query, store, scaling)
    err = (out.double() - truth).abs().max().item()
    err_low = (low.double() - truth).abs().max().item()
    floor = 0.0
    if query.dtype == torch.float32:
        T = store.full.length + sum(s.num_tokens for s in store.segments)
        floor = torch.finfo(torch.float32).eps * math.sqrt(T) * 8.0
    floor += cpu_kernel_low_precision(truth, lambda: attention_at(query, store, scaling, torch.float16))
    assert err <= 2 * err_low + floor, f"kernel error {err:.3g}, PyTorch error {err_low:.3g}, floor {floor:.3g}"
    return out


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("H_kv", [1, 2, 3, 8])
@pytest.mark.parametrize("rotation", [None, "hadamard"])
def test_head_dims_and_kv_heads(D, H_kv, rotation):
    """8-bit scales and zeros, the 8-bit full part, rotated or not: every head dim and KV head count above."""
    check(*make_store(D=D, H_kv=H_kv, n_rep=4 if H_kv == 1 else 2, rotation=rotation, T=48, seed=D + H_kv))


@pytest.mark.parametrize("D,G", [(64, 64), (256, 64), (256, 128)])
@pytest.mark.parametrize("full_part_bits", [8, 16])
def test_recommended_value_groups(D, G, full_part_bits):
    """``recommended()``'s format: 8-bit scale / zero codes on values in groups of 64 channels (128 once), rotated
    values, a 16- or 8-bit full part; SmolLM2's and Gemma 3 270M's heads."""
    H_kv, n_rep = (1, 4) if D == 256 else (3, 3)
    kw = dict(full_part_bits=full_part_bits, rotation="hadamard_values")
    query, store = make_store(D=D, H_kv=H_kv, n_rep=n_rep, G=G, **kw)
    assert {s.group_size for s in store.segments} == {G}
    check(query, store)


@pytest.mark.parametrize("scale_bits", [8, 16])
@pytest.mark.parametrize("full_part_bits", [8, 16])
@pytest.mark.parametrize("rotation", [None, "hadamard", "hadamard_keys", "hadamard_values"])
def test_every_format_combination(scale_bits, full_part_bits, rotation):
    check(*make_store(scale_bits=scale_bits, full_part_bits=full_part_bits, rotation=rotation, n_rep=3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("L_q", [1, 3])
def test_low_precision_queries_and_causal_rows(dtype, L_q):
    query, store = make_store(D=128, L_q=L_q, rotation="hadamard", n_rep=3)
    check(query.to(dtype), store)


def test_int8_full_part_is_read_with_its_scales():
    """Reading the int8 codes without their scales (all scales 1) changes the output: the kernel reads them."""
    query, store = make_store(rotation=None)
    out = check(query, store)
    store.full.scales.keys.fill_(1.0)
    store.full.scales.values.fill_(1.0)
    assert (dispatch.split_precision_attention(query, store, 0.125, "cpu") - out).abs().max() > 1e-2


def test_params8_codes_are_decoded_with_their_blocks():
    """The kernel decodes the uint8 codes with the blocks: doubling every key block's s_max changes the output like
    the reference's."""
    query, store = make_store(full_part_bits=16)
    for seg in store.segments:
        seg.k_block[..., 0] *= 2
    check(query, store)


def _seg8_args():
    query, store = make_store()
    full = store.full
    return query, full, [s.coded_kernel_args() for s in store.segments]


def test_params8_needs_blocks_and_table():
    query, full, segs = _seg8_args()
    keys, values = full.split_path_tensors()
    scales = (full.scales.keys, full.scales.values)
    with pytest.raises(ValueError, match="scale_table must be a float32"):
        cpu_ops.split_precision_attention(query, keys, values, full.start_tensor(), segs, 0.1, full_scales=scales)
    with pytest.raises(ValueError, match=r"segments\[0\] must be a tuple with k_block and v_block"):
        cpu_ops.split_precision_attention(
            query, keys, values, full.start_tensor(), [segs[0][:11]], 0.1, full_scales=scales
        )


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(full_scales=None), "full_keys must be of dtype torch.float32"),
        (dict(full_scales=(torch.ones(1), torch.ones(1))), r"full_scales\[0\] must be of shape"),
        (dict(rotation=(torch.eye(64), None)), r"rotation\[0\] must be of shape \(2, 64, 64\)"),
        (dict(rotation=torch.eye(64)), r"rotation must be a pair"),
    ],
)
def test_invalid_new_arguments_name_the_argument(kw, match):
    query, full, _ = _seg8_args()
    keys, values = full.split_path_tensors()
    args = dict(full_scales=(full.scales.keys, full.scales.values)) | kw
    with pytest.raises(ValueError, match=match):
        cpu_ops.split_precision_attention(query, keys, values, full.start_tensor(), [], 0.1, **args)


def test_int3_and_value_bits_with_params8_and_rotation():
    g = torch.Generator().manual_seed(3)
    B, H, T, D = 1, 2, 64, 64
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    positions = [{"full": torch.arange(56, 64), 4: torch.arange(0, 24), 3: torch.arange(24, 56)}]
    store = LayerStore.build(
        k,
        v,
        positions,
        8,
        16,
        torch.bfloat16,
        rotation=Rotation.make("hadamard", H, D, 0),
        max_value_bits=3,
        scale_bits=8,
        full_part_bits=8,
    )
    assert [s.code_bits for s in store.segments] == [(4, 3), 3]
    check(torch.randn(B, 2 * H, 1, D, generator=g), store)
    assert quant.SUPPORTED_BITS  # the module is used by the reference above


def test_head_dim_the_kernel_cannot_read_falls_back_warning_once(monkeypatch):
    """D=12 (not a multiple of 8): the PyTorch path, with one warning for all steps."""
    monkeypatch.setattr(dispatch, "_warned", set())
    query, store = make_store(D=12, rotation=None, T=48, G=4)
    with pytest.warns(RuntimeWarning, match="multiple of 8, got 12") as record:
        outs = [dispatch.split_precision_attention(query, store, 0.3, "cpu") for _ in range(3)]
    assert len([w for w in record if "multiple of 8" in str(w.message)]) == 1
    assert all(torch.equal(o, split_precision_attention_torch(query, store, 0.3)) for o in outs)
