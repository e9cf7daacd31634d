"""Attention sinks (gpt-oss) and logit soft-capping (Gemma 2) in split-precision decode attention: the PyTorch
reference against transformers' eager semantics over the dequantized store, and the fused CPU kernel against an fp64
attention with the project's tolerance (twice fp32 PyTorch's error plus, on AVX-512 VNNI, fp16 PyTorch's)."""

from __future__ import annotations

import math

import pytest
import torch

import cpu_ops
from hf_cocktail.decode import dispatch
from hf_cocktail.decode.split_attention import split_precision_attention_torch
from hf_cocktail.storage import quant
from hf_cocktail.storage.rotation import Rotation
from hf_cocktail.storage.store import LayerStore

from .conftest import cpu_kernel_low_precision
from .test_cpu_ops import CASES, make_case

SOFTCAP = 2.0  # small enough that tanh bends the scores of these random problems


def eager(query, K, V, n_full, scaling, sinks=None, softcap=None, dtype=torch.float64):
    """transformers' eager attention (Gemma 2's soft-capping, gpt-oss's sinks) of one sequence over its dequantized
    keys/values ``(H_kv, T, D)`` at ``dtype``; the newest ``L_q`` of the ``n_full`` full-part tokens (first in ``K``)
    are the queries' own. ``query (H_q, L_q, D)``."""
    H_q, L_q, _ = query.shape
    n_rep = H_q // K.shape[0]
    K, V = K.to(dtype).repeat_interleave(n_rep, 0), V.to(dtype).repeat_interleave(n_rep, 0)
    s = query.to(dtype) @ K.transpose(1, 2) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    j, i = torch.arange(K.shape[1]), torch.arange(L_q)
    s = s.masked_fill((j[None, :] < n_full) & (j[None, :] > n_full - L_q + i[:, None]), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(dtype).reshape(H_q, 1, 1).expand(H_q, L_q, 1)], dim=-1)
        s = s - s.max(dim=-1, keepdim=True).values
    p = torch.softmax(s, dim=-1)
    return (p[..., : K.shape[1]] if sinks is not None else p) @ V


def eager_batch(query, kv, scaling, dtype, **kw):
    return torch.stack([eager(query[b], K, V, n, scaling, dtype=dtype, **kw) for b, (K, V, n) in enumerate(kv)])


SINK_CASES = ["int4_only_gqa3", "both_segments_gqa3_d64", "Lq3_causal_gqa4_batch3", "d128_gqa4", "long_5000"]


@pytest.mark.parametrize("mode", ["sinks", "softcap", "both"])
@pytest.mark.parametrize("name", SINK_CASES)
@pytest.mark.parametrize("isa", ["auto", "baseline"])
def test_fused_cpu_kernel_with_sinks_and_softcap_matches_fp64(name, mode, isa):
    args, kv = make_case(**CASES[name])
    query, *_, scaling = args
    H_q = query.shape[1]
    kw = {}
    if mode != "softcap":
        T = max(K.shape[1] for K, _, _ in kv)
        kw["sinks"] = torch.linspace(-1.0, 3.0, H_q) + math.log(T)  # about the log of the tokens: a real share
    if mode != "sinks":
        kw["softcap"] = SOFTCAP
    out = cpu_ops.split_precision_attention(*args, isa=isa, **kw)
    truth = eager_batch(query, kv, scaling, torch.float64, **kw)
    err = (out.double() - truth).abs().max().item()
    err_low = (eager_batch(query, kv, scaling, torch.float32, **kw).double() - truth).abs().max().item()
    v_max = max(V.abs().max().item() for _, V, _ in kv if V.numel())
    floor = 1e-6 * v_max + cpu_kernel_low_precision(
        truth, lambda: eager_batch(query, kv, scaling, torch.float16, **kw), isa
    )
    assert err <= 2 * err_low + floor, f"kernel error {err:.3g}, PyTorch fp32 error {err_low:.3g}, floor {floor:.3g}"
    plain = cpu_ops.split_precision_attention(*args, isa=isa)
    assert (out - plain).abs().max() > 1e-3  # the sinks / the cap really change the attention


def test_a_sink_alone_gives_zeros_where_no_token_is_visible():
    args, _ = make_case(full=[1], segs=[], n_rep=2, L_q=1)
    query, fk, fv, _, segs, scaling = args
    empty_start = torch.tensor([1], dtype=torch.int32)  # the sequence owns no token
    out = cpu_ops.split_precision_attention(query, fk, fv, empty_start, segs, scaling, sinks=torch.zeros(4))
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(sinks=torch.zeros(5)), r"sinks must be of shape \(6\), got shape \(5,\)"),
        (dict(sinks=torch.zeros(6, dtype=torch.int64)), "sinks must be of dtype"),
        (dict(softcap=0.0), "softcap must be a positive finite float or None, got 0.0"),
        (dict(softcap=float("inf")), "softcap must be a positive finite float"),
        (dict(softcap=True), "softcap must be a positive finite float"),
    ],
)
def test_bad_sinks_or_softcap_name_the_argument(kw, match):
    args, _ = make_case(full=[4], segs=[(4, [20])], n_rep=3)
    with pytest.raises(ValueError, match=match):
        cpu_ops.split_precision_attention(*args, **kw)


def make_store(rotation=None, seed=0):
    """A store of 2 sequences of 90 prompt tokens: an INT4 and an INT2 segment and a full part, ``(B=2, H_kv=2,
    D=64)``; returns it with its positions (for ``LayerStore.dequantized``)."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 2, 90, 64, generator=g), torch.randn(2, 2, 90, 64, generator=g)
    positions = [{"full": torch.arange(60, 90), 4: torch.arange(0, 30), 2: torch.arange(30, 60)}] * 2
    rot = Rotation.make(rotation, 2, 64, 0)
    store = LayerStore.build(
        k, v, positions, 8, 16, torch.float16, quant.quantize_pack_keys, quant.quantize_pack_values, rot
    )
    return store, positions


@pytest.mark.parametrize("rotation", [None, "hadamard"])
@pytest.mark.parametrize("L_q", [1, 3])
def test_reference_and_dispatch_equal_eager_over_the_dequantized_store(rotation, L_q):
    store, positions = make_store(rotation)
    g = torch.Generator().manual_seed(1)
    store.append(torch.randn(2, 2, L_q, 64, generator=g), torch.randn(2, 2, L_q, 64, generator=g))
    query = torch.randn(2, 6, L_q, 64, generator=g)
    kw = dict(sinks=torch.linspace(-1.0, 2.0, 6), softcap=SOFTCAP)
    k, v = store.dequantized(positions, 90 + L_q, 90)  # original order: the queries' own tokens last
    kv = [(k[b], v[b], 90 + L_q) for b in range(2)]
    truth = eager_batch(query, kv, 0.3, torch.float64, **kw)
    err_low = (eager_batch(query, kv, 0.3, torch.float32, **kw).double() - truth).abs().max().item()
    ref = split_precision_attention_torch(query, store, 0.3, **kw)
    assert (ref.double() - truth).abs().max().item() <= 2 * err_low + 1e-6
    backends = ["auto", "torch"] + (
        ["triton"] if dispatch.triton_available() and dispatch.triton_interpreting() else []
    )
    for backend in backends:  # auto: the fused CPU kernel where it builds; triton: interpreted on CPU
        out = dispatch.split_precision_attention(query, store, 0.3, backend, **kw)
        low = cpu_kernel_low_precision(truth, lambda: eager_batch(query, kv, 0.3, torch.float16, **kw))
        assert (out.double() - truth).abs().max().item() <= 2 * err_low + 1e-6 + low
    plain = split_precision_attention_torch(query, store, 0.3)
    assert (plain - ref).abs().max() > 1e-3


@pytest.mark.parametrize("mask", ["none", "bool", "float"])
def test_exact_prefill_attention_in_query_blocks_equals_eager(monkeypatch, mask):
    """The prefill path of soft-capped / sink models (``exact_attention_forward``) computed in blocks of query rows
    gives transformers' eager attention (fp64 here) for a causal mask given as None, boolean or additive."""
    from hf_cocktail.integration import attention

    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(2, 6, 5, 16, generator=g),
        torch.randn(2, 2, 9, 16, generator=g),
        torch.randn(2, 2, 9, 16, generator=g),
    )
    visible = torch.arange(9)[None, :] <= torch.arange(5)[:, None] + 4  # causal, the last 5 keys the queries' own
    m = {
        "none": None,
        "bool": visible[None, None].expand(2, 1, 5, 9),
        "float": torch.zeros(2, 1, 5, 9).masked_fill(~visible, -1e30),
    }[mask]
    sinks, module = torch.linspace(-1.0, 1.0, 6), torch.nn.Module().eval()
    whole, _ = attention.exact_attention_forward(module, q, k, v, m, 0.4, softcap=SOFTCAP, s_aux=sinks)
    monkeypatch.setattr(attention, "SCORES_PER_BLOCK", 2 * 6 * 9 * 2)  # blocks of 2 query rows
    blocked, _ = attention.exact_attention_forward(module, q, k, v, m, 0.4, softcap=SOFTCAP, s_aux=sinks)
    truth = torch.stack([eager(q[b] * 1.0, k[b], v[b], 9, 0.4, sinks=sinks, softcap=SOFTCAP) for b in range(2)])
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-6)  # matmuls of other shapes: rounding only
    torch.testing.assert_close(whole.transpose(1, 2).double(), truth, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("q_scale", [0.01, 30.0, 100.0])
@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_gemma2_cap_of_50_on_large_and_small_scores_keeps_fp32_precision(q_scale, isa):
    """Gemma 2's soft-cap (50) where tanh saturates (scores in the hundreds) and where it is linear (tiny scores):
    the fp32 builds stay within twice fp32 PyTorch's error (the vectorised tanh loses nothing measurable)."""
    args, kv = make_case(**CASES["both_segments_gqa3_d64"])
    args = (args[0] * q_scale, *args[1:])
    query, *_, scaling = args
    out = cpu_ops.split_precision_attention(*args, softcap=50.0, isa=isa)
    truth = eager_batch(query, kv, scaling, torch.float64, softcap=50.0)
    err_low = (eager_batch(query, kv, scaling, torch.float32, softcap=50.0).double() - truth).abs().max().item()
    assert (out.double() - truth).abs().max().item() <= 2 * err_low + 1e-7
