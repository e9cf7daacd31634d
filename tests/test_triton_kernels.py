"""Triton kernels vs their PyTorch references: quantize + pack bit for bit, split-precision attention within the
error of a PyTorch computation, and one end-to-end generation. Without CUDA the kernels run under
TRITON_INTERPRET=1 (fp32, small shapes); the ``gpu`` tests use realistic sizes in fp16/bf16.
"""

import os
import sys

import torch

INTERPRET = not torch.cuda.is_available()
if INTERPRET:  # must be set before the first import of triton, and before triton_ops decorates its kernels
    _PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402

triton = pytest.importorskip("triton")


def _interpret_triton_language():
    """tests/conftest.py imports hf_cocktail, hence transformers, which imports triton before this module can set
    TRITON_INTERPRET: triton.language's own @jit helpers (tl.sum, tl.max, tl.zeros, ...) were then built for the
    compiler and fail inside interpreted kernels. Rebuild them as `import triton` does under TRITON_INTERPRET=1."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    rebuilt = {}  # id -> new function: a helper exported by several modules stays one object
    for name, mod in list(sys.modules.items()):
        if mod is not None and (name == "triton.language" or name.startswith("triton.language.")):
            for attr, obj in list(vars(mod).items()):
                if isinstance(obj, JITFunction):
                    setattr(mod, attr, rebuilt.setdefault(id(obj), InterpretedFunction(obj.fn)))


if INTERPRET:
    _interpret_triton_language()

import triton_ops  # noqa: E402
from hf_cocktail import CocktailCache, CocktailConfig  # noqa: E402
from hf_cocktail.decode import dispatch  # noqa: E402
from hf_cocktail.decode.split_attention import split_precision_attention_torch  # noqa: E402
from hf_cocktail.integration.compat import cache_kwargs  # noqa: E402
from hf_cocktail.storage import quant  # noqa: E402
from hf_cocktail.storage.full_part import Int8FullPart, full_part_from_sequences  # noqa: E402
from hf_cocktail.storage.store import LayerStore, PackedSegment  # noqa: E402

from .conftest import FakeEncoder, make_prompt, make_tiny_llama, prefill_all_but_last  # noqa: E402

if INTERPRET:  # the kernels are interpreted now; keep the variable set only while this module's tests run
    if _PREV_INTERPRET is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _PREV_INTERPRET

    @pytest.fixture(autouse=True, scope="module")
    def _interpret():
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "1")
            yield


DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ----------------------------------------------------------------------------- quantize + pack
def assert_same_quantization(x, bits, group, scale_dtype, keys):
    tri = (triton_ops.quantize_pack_keys if keys else triton_ops.quantize_pack_values)(x, bits, group, scale_dtype)
    ref = (quant.quantize_pack_keys if keys else quant.quantize_pack_values)(x, bits, group, scale_dtype)
    for name, a, b in zip(("codes", "scale", "zero"), tri, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), f"{name} differ at {int((a != b).sum())} of {a.numel()} entries"
    return ref


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale_dtype", [None, torch.float16, torch.bfloat16, torch.float32])
def test_quantize_pack_bit_exact(bits, dtype, scale_dtype):
    g = torch.Generator().manual_seed(bits)
    # N not a multiple of C (partial last chunk), C not a power of two, head dims 64 / 128 / 96 (not a power of 2)
    for H, N, D, C, G in [(2, 37, 64, 8, 32), (1, 5, 128, 32, 16), (2, 19, 96, 6, 32)]:
        x = (torch.randn(H, N, D, generator=g) * 4 + torch.randn(1, 1, D, generator=g) * 8).to(dtype).to(DEV)
        assert_same_quantization(x, bits, C, scale_dtype, keys=True)
        assert_same_quantization(x, bits, G, scale_dtype, keys=False)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_quantize_rounding_ties_and_constant_groups(scale_dtype, bits):
    """Scales and zeros exactly halfway between two storage values (must round to even), small integers (exact
    code ties) and constant groups (scale 0 -> code 0)."""
    eps, qmax = torch.finfo(scale_dtype).eps, (1 << bits) - 1
    ties = [1 + eps / 2, 1 + 3 * eps / 2, 2 + 3 * eps]  # halfway cases: round down, up, up to the even neighbour
    x = torch.randint(-3, 4, (2, 24, 64)).float()
    for c, t in enumerate(ties):
        x[0, :8, c] = t  # constant channel in chunk 0: zero = t (tie), scale = 0
        x[0, 8:16, 8 + c] = torch.linspace(0, qmax * t, 8)  # chunk 1: min 0, scale = t (tie)
        x[1, 3 + c, :16] = torch.linspace(-qmax * t, 0, 16)  # value group 0 of a token: scale t, zero -qmax*t
    x[1, :, 40] = 7.0  # constant channel in every chunk
    x[1, 9, :] = -1.5  # constant token (every value group)
    assert_same_quantization(x.to(DEV), bits, 8, scale_dtype, keys=True)
    assert_same_quantization(x.to(DEV), bits, 16, scale_dtype, keys=False)
    scale = triton_ops.quantize_pack_keys(x.to(DEV), bits, 8, scale_dtype)[1].float().cpu()
    assert scale[0, 1, 8:11].tolist() == [1.0, 1 + 2 * eps, 2 + 4 * eps]  # really rounded to even


def test_quantize_empty_segment():
    x = torch.zeros(2, 0, 64, device=DEV)
    for bits in (2, 3, 4):
        assert_same_quantization(x, bits, 32, torch.float16, keys=True)
        assert_same_quantization(x, bits, 32, torch.float16, keys=False)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's fp16 cast
@pytest.mark.parametrize("case", ["nan", "inf", "overflow", "bits", "head_dim", "head_dim_int3", "group"])
def test_quantize_errors_match_reference(case):
    x = torch.randn(1, 9, 64)
    bits, group, keys, sd = 2, 16, True, torch.float16
    if case == "nan":
        x[0, 3, 5] = float("nan")
    elif case == "inf":
        x[0, 3, 5], keys = float("inf"), False
    elif case == "overflow":
        x[0, 3, 5] = 1e6  # scale (1e6 - min) / 3 overflows fp16
    elif case == "bits":
        bits = 5
    elif case == "head_dim":
        x = torch.randn(1, 9, 66)  # 66 is not a multiple of 4 (2-bit codes per byte)
    elif case == "head_dim_int3":
        x, bits = torch.randn(1, 9, 68), 3  # 68 is a multiple of 4 but not of 8 (INT3's 1-bit plane)
    else:
        group, keys = 24, False  # does not divide 64
    fns = (
        (triton_ops.quantize_pack_keys, quant.quantize_pack_keys)
        if keys
        else (triton_ops.quantize_pack_values, quant.quantize_pack_values)
    )
    msgs = []
    for fn in fns:
        with pytest.raises(ValueError) as e:
            fn(x.to(DEV), bits, group, sd)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantize_pack_bit_exact_gpu(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(8, 4096 + 17, 128, generator=g, device="cuda") * 3).to(dtype)
    for bits in (2, 3, 4):
        for scale_dtype in (torch.float16, torch.bfloat16, torch.float32):
            assert_same_quantization(x, bits, 32, scale_dtype, keys=True)
            assert_same_quantization(x, bits, 32, scale_dtype, keys=False)


# ----------------------------------------------------------------------------- split-precision attention
def make_store(
    full,
    packed,
    H_kv,
    D,
    C,
    G,
    dtype=torch.float32,
    scale_dtype=torch.float16,
    seed=0,
    max_value_bits=None,
    scale_bits=16,
    full_part_bits=16,
    full_key_basis=None,
):
    """A LayerStore of ``len(full)`` sequences with the given per-sequence token counts, on DEV: ``full`` for the
    full-precision part, ``packed`` maps each packed segment's bit width to its counts (in storage order);
    ``max_value_bits`` caps the values' code width (CocktailConfig.value_bits), ``scale_bits`` is the scales',
    ``full_part_bits`` the full part's, ``full_key_basis`` an 8-bit part's keys' own basis (or None)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randn(H_kv, n, D, generator=g).to(DEV)  # noqa: E731
    fp = full_part_from_sequences(
        [rnd(n).to(dtype) for n in full],
        [rnd(n).to(dtype) for n in full],
        full_part_bits,
        torch.float16,
        full_key_basis,
    )
    quantize_keys, quantize_values = dispatch.quantizers("triton", torch.device(DEV))
    segs = [
        PackedSegment.from_sequences(
            [rnd(n) for n in ns],
            [rnd(n) for n in ns],
            bits,
            C,
            G,
            scale_dtype,
            quantize_keys,
            quantize_values,
            bits if max_value_bits is None else min(bits, max_value_bits),
            scale_bits,
        )
        for bits, ns in packed.items()
    ]
    return LayerStore(fp, segs)


def attention_sdpa(query, store, scaling, dtype):
    """PyTorch SDPA in ``dtype`` over each sequence's dequantized cache (packed segments first, then the full part,
    so that the newest L_q tokens come last and attend causally among themselves)."""
    B, H_q, Lq, D = query.shape
    out = []
    for b in range(B):
        s = store.full.start[b]
        parts = [seg.sequence(b) for seg in store.segments] + [(store.full.keys[b, :, s:], store.full.values[b, :, s:])]
        K = torch.cat([k.to(dtype) for k, _ in parts], 1)[None]
        V = torch.cat([v.to(dtype) for _, v in parts], 1)[None]
        T = K.shape[2]
        mask = torch.ones(Lq, T, dtype=torch.bool, device=query.device).tril(T - Lq)
        out.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[b : b + 1].to(dtype), K, V, attn_mask=mask, scale=scaling, enable_gqa=True
            )
        )
    return torch.cat(out)


def triton_attention(query, store, scaling, **kw):
    """The Triton launcher on a store's tensors, as hf_cocktail.decode.dispatch calls it."""
    full = store.full
    return triton_ops.split_precision_attention(
        query, full.keys, full.values, full.start_tensor(), [s.kernel_args() for s in store.segments], scaling, **kw
    )


def check_attention(query, store, scaling, low, **kw):
    """The kernel's error against an fp64 computation must be at most twice the error of ``low``, the same
    attention computed by PyTorch at the kernel's precision, plus (fp32 only) the rounding noise of a sum of T fp32
    terms, eps * sqrt(T) * max|v|, which stands in for ``low``'s error when that happens to be tiny."""
    out = triton_attention(query, store, scaling, **kw)
    assert out.dtype == query.dtype and out.shape == query.shape
    truth = attention_sdpa(query, store, scaling, torch.float64)
    err = (out.double() - truth).abs().max().item()
    err_low = (low.double() - truth).abs().max().item()
    floor = 0.0
    if query.dtype == torch.float32:
        T = max(store.full.length - s for s in store.full.start) + sum(
            max(seg.tok_off[b + 1] - seg.tok_off[b] for b in range(len(seg.tok_off) - 1)) for seg in store.segments
        )
        v_max = max(
            [store.full.values.abs().max().item()]
            + [
                seg.sequence(b)[1].abs().max().item()
                for seg in store.segments
                for b in range(query.shape[0])
                if seg.tok_off[b + 1] > seg.tok_off[b]
            ]
        )
        floor = torch.finfo(torch.float32).eps * math.sqrt(T) * v_max
    assert err <= 2 * err_low + floor, f"kernel error {err:.3g}, PyTorch error {err_low:.3g}, floor {floor:.3g}"
    return out


ATTN_CASES = {
    # name: (full token counts per sequence, {bits: packed token counts per sequence}), H_kv, n_rep, D, L_q, C, G,
    # tokens_per_split
    "mha_ragged": (([7], {4: [13], 2: [21]}), 2, 1, 64, 1, 8, 32, None),
    "gqa3_batch3_empty_segments_Lq2": (([5, 9, 3], {4: [0, 17, 8], 2: [20, 0, 11]}), 1, 3, 64, 2, 8, 16, 8),
    "gqa4_batch3_d128": (([6, 1, 3], {4: [19, 33, 0], 2: [50, 7, 0]}), 2, 4, 128, 1, 16, 32, None),
    "gqa4_d128_Lq2_full_only": (([6, 4], {4: [0, 0], 2: [0, 0]}), 2, 4, 128, 2, 16, 32, None),
    "gqa4_d64_many_splits": (([4, 12], {4: [30, 2], 2: [9, 41]}), 1, 4, 64, 1, 8, 32, 5),
    # INT3 (low_bits=3): after INT4, alone (uniform_bits=3), ragged with empty and split segments, head dim 128
    "int4_int3_mha": (([7], {4: [13], 3: [21]}), 2, 1, 64, 1, 8, 32, None),
    "int3_only_gqa2_batch2_Lq2": (([5, 3], {3: [17, 26]}), 1, 2, 64, 2, 8, 16, None),
    "int4_int3_gqa4_batch3_d128": (([6, 1, 3], {4: [19, 0, 8], 3: [0, 30, 11]}), 2, 4, 128, 1, 16, 32, 8),
}


@pytest.mark.parametrize("name", list(ATTN_CASES))
def test_split_attention_matches_reference(name):
    (full, packed), H_kv, n_rep, D, Lq, C, G, tps = ATTN_CASES[name]
    store = make_store(full, packed, H_kv, D, C, G, scale_dtype=torch.bfloat16 if n_rep == 3 else torch.float16)
    assert [seg.bits for seg in store.segments] == list(packed)
    g = torch.Generator().manual_seed(1)
    query = (torch.randn(len(full), H_kv * n_rep, Lq, D, generator=g) * 2).to(DEV)
    scaling = D**-0.5
    check_attention(query, store, scaling, split_precision_attention_torch(query, store, scaling), tokens_per_split=tps)


SEGMENT_COUNT_CASES = {
    # every packed-segment count the GPU path can see (0, 1, 2): the kernel's segment count is a compile-time
    # constant, an absent segment compiles no code and gets typed stand-ins
    0: (([7, 3], {}), 2, 2, 64, 2, 8, 32, 4),
    1: (([5, 3], {4: [17, 26]}), 1, 4, 128, 1, 16, 32, 8),
    2: (([5, 3], {4: [9, 0], 2: [4, 21]}), 2, 1, 64, 1, 8, 32, None),
}


DOT_CASES = {
    # 16 query rows per kv head or more (n_rep * L_q): the products go through tl.dot in blocks of 16 rows
    "gqa8_Lq2_16_rows": (([6, 2], {4: [19, 8], 2: [23, 11]}), 1, 8, 64, 2, 8, 32, 8),
    "gqa7_Lq3_21_rows_d128_int3": (([5], {4: [17], 3: [30]}), 2, 7, 128, 3, 16, 32, None),
}


def _attention_launch(query, store, scaling):
    """The split-attention launch the Triton launcher plans for ``store`` (its constexprs and arguments)."""
    full = store.full
    segments = [s.kernel_args() for s in store.segments]
    return triton_ops.plan_split_attention(query, full.keys, full.values, full.start_tensor(), segments, scaling)[0]


@pytest.mark.parametrize("name", list(DOT_CASES))
def test_split_attention_dot_path_matches_reference(name):
    (full, packed), H_kv, n_rep, D, Lq, C, G, tps = DOT_CASES[name]
    store = make_store(full, packed, H_kv, D, C, G)
    query = (torch.randn(len(full), H_kv * n_rep, Lq, D, generator=torch.Generator().manual_seed(5)) * 2).to(DEV)
    ref = split_precision_attention_torch(query, store, D**-0.5)
    attn = _attention_launch(query, store, 1.0)
    assert attn.constexprs["DOT"] and attn.constexprs["BQ"] == 16
    check_attention(query, store, D**-0.5, ref, tokens_per_split=tps)


@pytest.mark.parametrize("count", list(SEGMENT_COUNT_CASES))
def test_split_attention_every_segment_count(count):
    (full, packed), H_kv, n_rep, D, Lq, C, G, tps = SEGMENT_COUNT_CASES[count]
    store = make_store(full, packed, H_kv, D, C, G)
    assert len(store.segments) == count
    query = (torch.randn(len(full), H_kv * n_rep, Lq, D, generator=torch.Generator().manual_seed(3)) * 2).to(DEV)
    attn = _attention_launch(query, store, D**-0.5)
    assert attn.constexprs["SEGS"] == count
    # the first pointer of each absent segment's 14 arguments (11 tensors with the outlier channel order, 3 ints),
    # after the query, the full part's query and 18 arguments of strides and the full part
    absent = attn.args[20 + 14 * count : 20 + 14 * 2 : 14]
    assert [t.dtype for t in absent] == [torch.uint8] * (2 - count)  # typed stand-ins, not the full keys
    ref = split_precision_attention_torch(query, store, D**-0.5)
    check_attention(query, store, D**-0.5, ref, tokens_per_split=tps)


def eager_attention(query, store, scaling, dtype, sinks=None, softcap=None):
    """transformers' eager attention in ``dtype`` over each sequence's dequantized cache (packed segments, then the
    full part): ``s = scaling * q.k``, soft-capped as ``softcap * tanh(s / softcap)`` before the causal mask, a sink
    logit per query head in the softmax's denominator that contributes no value (gpt-oss)."""
    B, H_q, Lq, D = query.shape
    out = []
    for b in range(B):
        s0 = store.full.start[b]
        parts = [seg.sequence(b) for seg in store.segments]
        parts.append((store.full.keys[b, :, s0:], store.full.values[b, :, s0:]))
        K = torch.cat([k.to(dtype) for k, _ in parts], 1)
        V = torch.cat([v.to(dtype) for _, v in parts], 1)
        n_rep = H_q // K.shape[0]
        K, V = K.repeat_interleave(n_rep, 0), V.repeat_interleave(n_rep, 0)
        T = K.shape[1]
        s = query[b].to(dtype) @ K.transpose(1, 2) * scaling  # (H_q, L_q, T)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        causal = torch.ones(Lq, T, dtype=torch.bool, device=query.device).tril(T - Lq)
        s = s.masked_fill(~causal, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.to(dtype)[:, None, None].expand(H_q, Lq, 1)], -1)
        p = torch.softmax(s, -1)[..., :T]
        out.append(p @ V)
    return torch.stack(out)


SINK_SOFTCAP_CASES = {
    # name: (full, packed), H_kv, n_rep, D, L_q, sinks, softcap, tokens_per_split (many splits: the sink once)
    "sinks_gqa4_many_splits": (([6, 3], {4: [19, 8], 2: [23, 11]}), 2, 4, 64, 1, True, None, 5),
    "softcap_mha_Lq2": (([7, 4], {4: [13, 9], 3: [21, 6]}), 2, 1, 128, 2, False, 3.0, None),
    "sinks_softcap_gqa2_Lq2_one_segment": (([5, 9], {4: [17, 30]}), 1, 2, 64, 2, True, 2.0, 7),
    "sinks_softcap_gqa8_Lq2_dot": (([6, 3], {4: [19, 8], 2: [23, 11]}), 1, 8, 64, 2, True, 5.0, 6),
}


@pytest.mark.parametrize("name", list(SINK_SOFTCAP_CASES))
def test_split_attention_sinks_and_softcap(name):
    """Attention sinks and logit soft-capping against eager attention: the kernel's error from an fp64 computation
    is at most twice fp32 PyTorch's plus fp32 summation noise; and both really change the output."""
    (full, packed), H_kv, n_rep, D, Lq, with_sinks, softcap, tps = SINK_SOFTCAP_CASES[name]
    store = make_store(full, packed, H_kv, D, 8, 32)
    g = torch.Generator().manual_seed(4)
    query = (torch.randn(len(full), H_kv * n_rep, Lq, D, generator=g) * 4).to(DEV)
    sinks = (torch.randn(H_kv * n_rep, generator=g) * 2 + 3).to(DEV) if with_sinks else None
    scaling = D**-0.5
    out = triton_attention(query, store, scaling, sinks=sinks, softcap=softcap, tokens_per_split=tps)
    truth = eager_attention(query.double(), store, scaling, torch.float64, sinks, softcap)
    low = eager_attention(query, store, scaling, torch.float32, sinks, softcap)
    err, err_low = ((x.double() - truth).abs().max().item() for x in (out, low))
    T = max(n + sum(ns[b] for ns in packed.values()) for b, n in enumerate(full))
    floor = torch.finfo(torch.float32).eps * math.sqrt(T) * 4.0  # |v| of randn stays below 4 here
    assert err <= 2 * err_low + floor, f"kernel error {err:.3g}, PyTorch error {err_low:.3g}, floor {floor:.3g}"
    plain = eager_attention(query.double(), store, scaling, torch.float64)
    assert (plain - truth).abs().max() > 1e-3  # the sinks / the cap really change the result


@pytest.mark.parametrize("sinks,softcap", [(True, None), (False, 30.0), (True, 2.0)])
def test_dispatch_sinks_and_softcap_triton_equals_reference(sinks, softcap):
    """Through the dispatch (which passes sinks= / softcap= to this launcher) against the PyTorch reference."""
    store = make_store([5, 9], {4: [17, 8], 2: [20, 11]}, 2, 64, 8, 32)
    g = torch.Generator().manual_seed(6)
    query = (torch.randn(2, 8, 1, 64, generator=g) * 3).to(DEV)
    sink = (torch.randn(8, generator=g) + 2).to(DEV) if sinks else None
    ref = split_precision_attention_torch(query, store, 0.125, sinks=sink, softcap=softcap)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to the reference
        out = dispatch.split_precision_attention(query, store, 0.125, "triton", sinks=sink, softcap=softcap)
    assert not torch.equal(out, ref)  # computed by the kernel, not handed over from the reference
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_split_attention_rejects_bad_sinks_and_softcap():
    store = make_store([4], {4: [3]}, 2, 64, 8, 32)
    query = torch.randn(1, 4, 1, 64).to(DEV)
    with pytest.raises(ValueError, match=re.escape("sinks must be a float tensor of shape (H_q=4,)")):
        triton_attention(query, store, 0.1, sinks=torch.zeros(2, device=DEV))
    for bad in (0.0, -1.0, float("inf"), "50"):
        with pytest.raises(ValueError, match="softcap must be a finite number > 0 or None"):
            triton_attention(query, store, 0.1, softcap=bad)


def test_split_attention_other_head_dim_falls_back(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned", set())
    store = make_store([4], {4: [9], 2: [5]}, 2, 32, 8, 16)
    query = torch.randn(1, 4, 1, 32).to(DEV)
    with pytest.warns(RuntimeWarning, match="head dims"):
        out = dispatch.split_precision_attention(query, store, 0.2, "triton")
    assert torch.equal(out, split_precision_attention_torch(query, store, 0.2))
    with pytest.raises(ValueError, match="head dim D must be one of"):  # the launcher itself refuses it
        triton_attention(query, store, 0.2)


def test_split_attention_rejects_bad_gqa():
    store = make_store([4], {4: [3], 2: [3]}, 2, 64, 8, 32)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        triton_attention(torch.randn(1, 3, 1, 64).to(DEV), store, 0.1)


VALUE_BITS_CASES = {
    # name: (full token counts per sequence, {key bits: packed token counts per sequence}), max value bits, H_kv,
    # n_rep, D, L_q, C, G, tokens_per_split
    "k4v3_k3v3_mha": (([7], {4: [13], 3: [21]}), 3, 2, 1, 64, 1, 8, 32, None),
    "k4v2_k2v2_gqa3_batch3_Lq2": (([5, 9, 3], {4: [0, 17, 8], 2: [20, 0, 11]}), 2, 1, 3, 64, 2, 8, 16, 8),
    "k4v2_k3v2_gqa4_d128": (([6, 1], {4: [19, 33], 3: [50, 7]}), 2, 2, 4, 128, 1, 16, 32, None),
}


@pytest.mark.parametrize("name", list(VALUE_BITS_CASES))
def test_split_attention_value_bits_matches_reference(name):
    """Values at fewer code bits than keys: each read at its own width."""
    (full, packed), max_vb, H_kv, n_rep, D, Lq, C, G, tps = VALUE_BITS_CASES[name]
    store = make_store(full, packed, H_kv, D, C, G, max_value_bits=max_vb)
    assert [(seg.bits, seg.value_bits) for seg in store.segments] == [(b, min(b, max_vb)) for b in packed]
    g = torch.Generator().manual_seed(1)
    query = (torch.randn(len(full), H_kv * n_rep, Lq, D, generator=g) * 2).to(DEV)
    scaling = D**-0.5
    check_attention(query, store, scaling, split_precision_attention_torch(query, store, scaling), tokens_per_split=tps)


def test_split_attention_8_bit_scales_matches_reference():
    """8-bit scales and zeros: the kernel reads the decoded fp32 numbers of kernel_args()."""
    store = make_store([5, 9], {4: [17, 8], 3: [20, 11]}, 2, 64, 8, 32, max_value_bits=3, scale_bits=8)
    assert [seg.scale_bits for seg in store.segments] == [8, 8]
    assert store.segments[0].kernel_args()[4].dtype == torch.float32
    query = (torch.randn(2, 4, 1, 64, generator=torch.Generator().manual_seed(1)) * 2).to(DEV)
    check_attention(query, store, 0.125, split_precision_attention_torch(query, store, 0.125))


def test_split_attention_8_bit_full_part_matches_reference():
    """full_part_bits=8: the kernel reads the full part the store dequantizes for the step."""
    store = make_store([5, 9], {4: [17, 8], 2: [20, 11]}, 2, 64, 8, 32, full_part_bits=8)
    assert isinstance(store.full, Int8FullPart)
    query = (torch.randn(2, 4, 1, 64, generator=torch.Generator().manual_seed(1)) * 2).to(DEV)
    check_attention(query, store, 0.125, split_precision_attention_torch(query, store, 0.125))


@pytest.mark.parametrize(
    "bits, match",
    [
        ((2, 3), re.escape("segments[1] value bits must be <= key bits, got bits (2, 3)")),
        ((3, 5), re.escape("bits must be one of (2, 3, 4), got 5")),
        # codes narrower or wider than the declared bits are refused before the kernel reads past them
        ((3, 2), re.escape("segments[1].v_codes must be uint8 of shape (H_kv=2, N, D*bits//8=16) for 2-bit codes")),
        (4, re.escape("segments[1].k_codes must be uint8 of shape (H_kv=2, N, D*bits//8=32) for 4-bit codes")),
    ],
)
def test_split_attention_rejects_bad_value_bits(bits, match):
    store = make_store([4], {4: [3], 3: [3]}, 2, 64, 8, 32)
    full = store.full
    segments = [store.segments[0].kernel_args(), (bits, *store.segments[1].kernel_args()[1:])]
    with pytest.raises(ValueError, match=match):
        triton_ops.split_precision_attention(
            torch.randn(1, 2, 1, 64).to(DEV), full.keys, full.values, full.start_tensor(), segments, 0.1
        )


def test_split_attention_rejects_unsupported_bits():
    store = make_store([4], {4: [3], 3: [3]}, 2, 64, 8, 32)
    full = store.full
    segments = [store.segments[0].kernel_args(), (5, *store.segments[1].kernel_args()[1:])]
    with pytest.raises(ValueError, match=re.escape("bits must be one of (2, 3, 4), got 5")):
        triton_ops.split_precision_attention(
            torch.randn(1, 2, 1, 64).to(DEV), full.keys, full.values, full.start_tensor(), segments, 0.1
        )


def test_split_attention_rejects_a_segment_of_12_items():
    """A 12th item that is not outlier key channels ``(n_out, channels)`` (e.g. the codebook's level table of earlier
    versions) is refused, not ignored."""
    store = make_store([4], {4: [3], 3: [3]}, 2, 64, 8, 32)
    full, seg = store.full, store.segments[1].kernel_args()
    with pytest.raises(ValueError, match=r"segments\[1\]'s outlier key channels must be a pair \(n_out, channels\)"):
        triton_ops.split_precision_attention(
            torch.randn(1, 2, 1, 64).to(DEV),
            full.keys,
            full.values,
            full.start_tensor(),
            [store.segments[0].kernel_args(), (*seg, torch.zeros(8, device=DEV))],
            0.1,
        )


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,Lq", [(1, 1), (3, 2)])
@pytest.mark.parametrize("low_bits", [2, 3])
@pytest.mark.parametrize("max_value_bits", [None, 2])
def test_split_attention_realistic_gpu(dtype, B, Lq, low_bits, max_value_bits):
    """~4K tokens per sequence, Llama-3-8B heads (H_q 32, H_kv 8, D 128), ragged INT4 + INT2 / INT3 segments
    (values at their chunk's bits, or at 2 bits), fp16/bf16."""
    full = [420, 97, 1300][:B]
    int4 = [1210, 0, 2047][:B]
    low = [2466, 3999, 700][:B]
    store = make_store(full, {4: int4, low_bits: low}, 8, 128, 32, 32, dtype=dtype, max_value_bits=max_value_bits)
    g = torch.Generator(device="cuda").manual_seed(1)
    query = torch.randn(B, 32, Lq, 128, generator=g, device="cuda").to(dtype)
    check_attention(query, store, 128**-0.5, attention_sdpa(query, store, 128**-0.5, dtype))


def test_import_without_triton_gives_install_hint(monkeypatch):
    from hf_cocktail.decode.dispatch import TRITON_INSTALL_HINT

    for name in [m for m in sys.modules if m == "triton_ops" or m.startswith("triton_ops.")]:
        monkeypatch.delitem(sys.modules, name)  # restored after the test
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    with pytest.raises(ImportError, match=re.escape(TRITON_INSTALL_HINT)):
        import triton_ops  # noqa: F401


# ----------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("low_bits", [2, 3])
def test_generate_triton_backend_equals_torch_backend(tiny_tokenizer, monkeypatch, low_bits):
    """A tiny Llama (head dim 64, GQA 2) generating greedily for a batch of two prompts of different lengths, with
    a search that picks FP16, INT4 and INT2 (or INT3, ``low_bits=3``) chunks: the Triton backend (quantize kernels
    at prefill, split attention at decode) must store the same codes and produce the same tokens as the PyTorch
    backend."""
    calls = {}
    for name in ("quantize_pack_keys", "quantize_pack_values", "split_precision_attention"):

        def counted(*a, _fn=getattr(triton_ops, name), _name=name, **k):  # noqa: B008 (bound per loop turn)
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **k)

        monkeypatch.setattr(triton_ops, name, counted)
    prompts = [make_prompt(60, seed=1, needle_at=20), make_prompt(33, seed=2, needle_at=4)]
    model = make_tiny_llama(head_dim=64)
    gen = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    # one full-precision prefill branched into both caches (the codes are compared bit for bit)
    shared, runs = None, {}
    for backend in ("torch", "triton"):
        cfg = CocktailConfig(chunk_size=8, group_size=32, alpha=0.4, beta=0.2, low_bits=low_bits, backend=backend)
        cache = CocktailCache(cfg, encoder=FakeEncoder())
        inputs = cache.prepare_inputs(
            tiny_tokenizer,
            [p for p, _, _ in prompts],
            contexts=[c for _, c, _ in prompts],
            queries=[q for _, _, q in prompts],
        )
        shared = shared or prefill_all_but_last(model, inputs)
        cache.load_prefill(shared)
        runs[backend] = (model.generate(**inputs, **cache_kwargs(model, cache), **gen), cache)
    (out_t, cache_t), (out_x, cache_x) = runs["torch"], runs["triton"]
    layers = model.config.num_hidden_layers
    # the loaded prefill quantizes 2 segments of 2 sequences per layer; each of the 4 steps (the last prompt token,
    # then 3 new ones) runs the attention once per layer
    assert calls == {
        "quantize_pack_keys": 2 * 2 * layers,
        "quantize_pack_values": 2 * 2 * layers,
        "split_precision_attention": gen["max_new_tokens"] * layers,
    }
    assert cache_x.precision_map() == cache_t.precision_map()
    assert {b for row in cache_t.precision_map() for b in row} == {16, 4, low_bits}
    for lt, lx in zip(cache_t.layers, cache_x.layers):
        for st, sx in zip(lt.store.segments, lx.store.segments):
            assert all(torch.equal(a, b) for a, b in zip(st.tensors(), sx.tensors()))
    assert torch.equal(out_x.sequences, out_t.sequences)
    logits_t, logits_x = torch.stack(out_t.logits, 1), torch.stack(out_x.logits, 1)
    # both run in fp32 and differ only in the order of the attention sums: about eps * sqrt(T) relative per layer
    T = inputs["input_ids"].shape[1] + gen["max_new_tokens"]
    tol = layers * torch.finfo(torch.float32).eps * math.sqrt(T) * logits_t.abs().max().item()
    torch.testing.assert_close(logits_x, logits_t, rtol=0, atol=tol)


@pytest.mark.parametrize(
    "kind,low_bits", [("hadamard", 2), ("hadamard_keys", 2), ("hadamard_values", 2), ("hadamard", 3)]
)
def test_split_attention_rotated_store_triton_equals_torch(kind, low_bits):
    """A rotated store: the dispatcher rotates the query and the output around the Triton kernel exactly as the
    PyTorch reference does around its own attention."""
    from hf_cocktail.storage.rotation import Rotation

    store = make_store([5, 9], {4: [17, 8], low_bits: [20, 11]}, 2, 64, 8, 16)
    store.rotation = Rotation.make(kind, 2, 64, seed=1, device=DEV)
    query = (torch.randn(2, 6, 2, 64, generator=torch.Generator().manual_seed(2)) * 2).to(DEV)
    ref = split_precision_attention_torch(query, store, 0.125)
    out = dispatch.split_precision_attention(query, store, 0.125, "triton")
    assert out.dtype == query.dtype and out.shape == query.shape
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    plain = split_precision_attention_torch(query, dataclasses.replace(store, rotation=None), 0.125)
    assert (plain - ref).abs().max() > 1e-3  # the rotation really is applied
