"""cpu_ops (the fused C++ CPU split-precision attention) against an fp64 attention over the dequantized cache.

The store is built with hf_cocktail's reference quantizer (``hf_cocktail.storage.quant``) and the reference
dequantizes it with ``quant.dequantize_keys`` / ``dequantize_values``, so these tests do not depend on where
hf_cocktail's own PyTorch attention lives. Tolerance (the project's rule): the kernel's max error against fp64 is at
most twice the error of the same attention computed by PyTorch at the kernel's precision (fp32 compute, output in the
query dtype), plus, for fp32, eps * sqrt(T) * max|v| (the rounding noise of a sum of T fp32 terms). The AVX-512 VNNI
build rounds P.V's products to 16 bits: its tolerance adds fp16 PyTorch's error (conftest.cpu_kernel_low_precision).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import cpu_ops
from cpu_ops import _build
from hf_cocktail.storage import quant

from .conftest import cpu_kernel_low_precision

if not cpu_ops.available():  # compiles on first use (about a minute), then loads the cached build
    if os.environ.get("HF_COCKTAIL_REQUIRE_CPU_OPS") == "1":  # CI: a build failure must fail, not skip
        raise RuntimeError(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}")
    pytest.skip(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}", allow_module_level=True)


def _keys(g, H, n, D):
    """Keys with a few outlier channels, like real K states (what per-channel key quantization is for)."""
    k = torch.randn(H, n, D, generator=g)
    return k * (1 + 4 * (torch.rand(1, 1, D, generator=g) < 0.1))


def make_case(
    full,
    segs,
    H_kv=2,
    n_rep=1,
    D=64,
    L_q=1,
    C=32,
    G=32,
    dtype=torch.float32,
    scale_dtype=torch.float16,
    layout="plain",
    seed=0,
):
    """A random problem. ``full``: valid full-part tokens per sequence; ``segs``: ``[(bits, [tokens per
    sequence])]`` with ``bits`` an int or a pair ``(key_bits, value_bits)``. ``layout``: ``plain`` (contiguous),
    ``capacity`` (a view of a longer preallocated buffer) or ``transposed`` (a (B, R, H, D) buffer seen as
    (B, H, R, D)). Left padding of the full part is NaN (never read).

    Returns ``(args, kv)``: the kernel's arguments and, per sequence, its dequantized fp32 keys / values in
    attention order [full part, segment 0, segment 1] with the number of full-part tokens."""
    g = torch.Generator().manual_seed(seed)
    B, R = len(full), max(full)
    query = (torch.randn(B, H_kv * n_rep, L_q, D, generator=g) * 2).to(dtype)

    def alloc():
        if layout == "transposed":
            return torch.full((B, R + 5, H_kv, D), float("nan"), dtype=dtype).transpose(1, 2)[:, :, :R]
        if layout == "capacity":
            return torch.full((B, H_kv, R + 7, D), float("nan"), dtype=dtype)[:, :, :R]
        return torch.full((B, H_kv, R, D), float("nan"), dtype=dtype)

    fk, fv = alloc(), alloc()
    start = [R - n for n in full]
    for b, s in enumerate(start):
        fk[b, :, s:] = _keys(g, H_kv, R - s, D).to(dtype)
        fv[b, :, s:] = torch.randn(H_kv, R - s, D, generator=g).to(dtype)
    kv = [[(fk[b, :, start[b] :].float(), fv[b, :, start[b] :].float())] for b in range(B)]
    segments = []
    for bits, lens in segs:
        kbits, vbits = bits if isinstance(bits, tuple) else (bits, bits)
        parts = []
        for b, n in enumerate(lens):
            k, v = _keys(g, H_kv, n, D), torch.randn(H_kv, n, D, generator=g) * 1.5
            kq = quant.quantize_pack_keys(k, kbits, C, scale_dtype)
            vq = quant.quantize_pack_values(v, vbits, G, scale_dtype)
            kv[b].append((quant.dequantize_keys(*kq, kbits, C), quant.dequantize_values(*vq, vbits, G)))
            parts.append((kq, vq))
        cat = lambda i, j: torch.cat([p[i][j] for p in parts], dim=1)  # noqa: E731
        tok, chk = [0], [0]
        for n in lens:
            tok.append(tok[-1] + n)
            chk.append(chk[-1] + -(-n // C))
        segments.append(
            (
                bits,
                C,
                G,
                cat(0, 0),
                cat(0, 1),
                cat(0, 2),
                cat(1, 0),
                cat(1, 1),
                cat(1, 2),
                torch.tensor(tok, dtype=torch.int32),
                torch.tensor(chk, dtype=torch.int32),
            )
        )
    args = (query, fk, fv, torch.tensor(start, dtype=torch.int32), segments, D**-0.5)
    return args, [(torch.cat([k for k, _ in p], 1), torch.cat([v for _, v in p], 1), full[b]) for b, p in enumerate(kv)]


def reference(query, kv, scaling, compute_dtype):
    """Attention over the dequantized cache at ``compute_dtype``: one softmax over [full, segments]; the newest
    ``L_q`` full-part tokens are the queries' own (causal). Output in ``compute_dtype``."""
    B, H_q, L_q, D = query.shape
    out = torch.zeros(B, H_q, L_q, D, dtype=compute_dtype)
    for b, (K, V, n_full) in enumerate(kv):
        H_kv, T = K.shape[0], K.shape[1]
        if T == 0:
            continue
        K = K.to(compute_dtype).repeat_interleave(H_q // H_kv, 0)
        V = V.to(compute_dtype).repeat_interleave(H_q // H_kv, 0)
        s = (query[b].to(compute_dtype) * scaling) @ K.transpose(1, 2)  # (H_q, L_q, T)
        j = torch.arange(T)
        i = torch.arange(L_q)
        # full-part token j (j < n_full) is visible to query i iff j <= n_full - L_q + i
        hidden = (j[None, :] < n_full) & (j[None, :] > n_full - L_q + i[:, None])
        s = s.masked_fill(hidden, float("-inf"))
        out[b] = torch.softmax(s, -1).nan_to_num(0.0) @ V
    return out


VNNI = cpu_ops.kernel_target() == "avx512vnni"  # isa="auto" runs P.V of packed values in 16-bit integers


def check(args, kv, **kw):
    query, *_, scaling = args
    out = cpu_ops.split_precision_attention(*args, **kw)
    assert out.dtype == query.dtype and out.shape == query.shape
    truth = reference(query, kv, scaling, torch.float64)
    low = reference(query, kv, scaling, torch.float32).to(query.dtype)  # what the PyTorch path returns
    err = (out.double() - truth).abs().max().item()
    err_low = (low.double() - truth).abs().max().item()
    floor = 0.0
    if query.dtype == torch.float32:
        T = max(K.shape[1] for K, _, _ in kv)
        v_max = max([V.abs().max().item() for _, V, _ in kv if V.numel()] + [0.0])
        floor = torch.finfo(torch.float32).eps * math.sqrt(max(T, 1)) * v_max
    floor += cpu_kernel_low_precision(
        truth, lambda: reference(query, kv, scaling, torch.float16), kw.get("isa", "auto")
    )
    assert err <= 2 * err_low + floor, f"kernel error {err:.3g}, PyTorch error {err_low:.3g}, floor {floor:.3g}"
    return out


CASES = {
    # name: make_case keyword arguments
    "int2_only_mha": dict(full=[1], segs=[(2, [100])]),
    "int4_only_gqa3": dict(full=[3], segs=[(4, [77])], n_rep=3),
    "full_only": dict(full=[40], segs=[]),
    "full_only_Lq3_gqa4": dict(full=[40], segs=[], n_rep=4, L_q=3),
    "both_segments_gqa3_d64": dict(full=[20], segs=[(4, [96]), (2, [250])], H_kv=3, n_rep=3),
    "batch3_ragged_empty": dict(full=[5, 9, 3], segs=[(4, [0, 17, 40]), (2, [70, 0, 11])], n_rep=3, C=8, G=16),
    "batch3_one_sequence_no_segment_tokens": dict(full=[4, 12, 1], segs=[(4, [30, 0, 9]), (2, [41, 0, 7])], n_rep=4),
    "Lq3_causal_gqa4_batch3": dict(full=[6, 4, 9], segs=[(4, [33, 0, 5]), (2, [0, 50, 19])], n_rep=4, L_q=3),
    "d32_G8": dict(full=[7], segs=[(4, [45]), (2, [61])], D=32, G=8, C=16),
    "d128_gqa4": dict(full=[6, 2], segs=[(4, [65, 1]), (2, [130, 0])], D=128, n_rep=4),
    "d64_G4_C5_partial_chunks": dict(full=[3, 8], segs=[(4, [23, 7]), (2, [11, 29])], G=4, C=5),
    "d64_G64_C1": dict(full=[2], segs=[(2, [37])], G=64, C=1),
    # head dims whose packed rows are not whole groups of 8 bytes (the kernel's channel-order tail) and tiny G
    "d40_G8_tail_bytes": dict(full=[5, 2], segs=[(4, [33, 12]), (2, [20, 41])], D=40, G=8, n_rep=3),
    "d80_G16_tail_bytes": dict(full=[3], segs=[(4, [50]), (2, [70])], D=80, G=16, n_rep=2, L_q=3),
    "d8_G2": dict(full=[4], segs=[(4, [19]), (2, [35])], D=8, G=2, C=4),
    "capacity_view": dict(full=[5, 14], segs=[(4, [20, 3]), (2, [9, 60])], n_rep=3, L_q=3, layout="capacity"),
    "transposed_view": dict(full=[11, 6], segs=[(2, [40, 40])], n_rep=2, layout="transposed"),
    "scales_bf16": dict(full=[8], segs=[(4, [70]), (2, [90])], scale_dtype=torch.bfloat16, n_rep=3),
    "scales_fp32": dict(full=[8], segs=[(4, [70]), (2, [90])], scale_dtype=torch.float32, n_rep=3),
    "tiny_T": dict(full=[1, 1], segs=[(4, [1, 0]), (2, [0, 2])], n_rep=3),
    "long_5000": dict(full=[500], segs=[(4, [1500]), (2, [3000])], H_kv=3, n_rep=3),
    # INT3 (2-bit plane + 1-bit plane): beside INT4, alone, ragged, and head dims with channel-order tail bytes
    "int4_int3_gqa3": dict(full=[20], segs=[(4, [96]), (3, [250])], H_kv=3, n_rep=3),
    "int3_only_Lq3": dict(full=[6], segs=[(3, [77])], n_rep=2, L_q=3),
    "int3_batch3_ragged_empty": dict(full=[5, 9, 3], segs=[(4, [0, 17, 40]), (3, [70, 0, 11])], n_rep=3, C=8, G=16),
    "int3_d40_G8_tail_bytes": dict(full=[5, 2], segs=[(4, [33, 12]), (3, [20, 41])], D=40, G=8, n_rep=3),
    "int3_d8_G2": dict(full=[4], segs=[(3, [35])], D=8, G=2, C=4),
    "int3_d128_scales_bf16": dict(full=[8], segs=[(3, [130])], D=128, scale_dtype=torch.bfloat16, n_rep=4),
    "int2_d80_G4_Lq3_not_per_vector": dict(full=[3], segs=[(2, [70])], D=80, G=4, L_q=3),
    # values at fewer code bits than keys (CocktailConfig.value_bits): keys and values in different tile orders
    "k4v3_k3v2_gqa3": dict(full=[20], segs=[((4, 3), [96]), ((3, 2), [250])], H_kv=3, n_rep=3),
    "k4v2_batch3_ragged_empty": dict(
        full=[5, 9, 3], segs=[((4, 2), [0, 17, 40]), (2, [70, 0, 11])], n_rep=3, C=8, G=16
    ),
    "k4v3_d40_G8_tail_bytes": dict(full=[5, 2], segs=[((4, 3), [33, 12]), ((3, 2), [20, 41])], D=40, G=8, n_rep=3),
    "k4v3_d80_G4_not_per_vector": dict(full=[3], segs=[((4, 3), [70])], D=80, G=4, L_q=3),
    "k4v2_d128_Lq3_scales_bf16": dict(full=[8], segs=[((4, 2), [130])], D=128, L_q=3, scale_dtype=torch.bfloat16),
    "long_5000_batch2_Lq3": dict(
        full=[300, 64], segs=[(4, [1700, 100]), (2, [3000, 4836])], H_kv=1, n_rep=4, L_q=3, D=128
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_fp64_reference(name):
    check(*make_case(**CASES[name]))


@pytest.mark.parametrize("name", list(CASES))
def test_avx2_build_keeps_fp32_tolerance(name):
    """isa="avx2": fp32 arithmetic only (on a VNNI CPU, "auto" rounds P.V's products to 16 bits)."""
    check(*make_case(**CASES[name]), isa="avx2")


@pytest.mark.skipif(not VNNI, reason="this CPU has no AVX-512 VNNI: isa='auto' is the AVX2 build")
def test_vnni_build_takes_the_int16_path_and_stays_close():
    """Values in runs take the 16-bit P.V: not bit-equal to the AVX2 build (each within its tolerance of fp64: check),
    and within 1/3 of fp16 PyTorch's error of it."""
    args, kv = make_case(**CASES["both_segments_gqa3_d64"])
    fast, exact = check(args, kv), check(args, kv, isa="avx2")
    assert not torch.equal(fast, exact)
    fp16_err = (reference(args[0], kv, args[-1], torch.float16).double() - exact.double()).abs().max().item()
    assert (fast - exact).abs().max().item() < fp16_err / 3


@pytest.mark.parametrize(
    "name",
    [
        "Lq3_causal_gqa4_batch3",
        "d40_G8_tail_bytes",
        "d64_G4_C5_partial_chunks",
        "scales_bf16",
        "long_5000",
        "int4_int3_gqa3",
        "int3_d40_G8_tail_bytes",
        "int2_d80_G4_Lq3_not_per_vector",
        "k4v3_k3v2_gqa3",
        "k4v3_d40_G8_tail_bytes",
    ],
)
def test_portable_baseline_build(name):
    """The build that runs on CPUs without AVX2 (this machine runs the AVX2 one unless told otherwise)."""
    check(*make_case(**CASES[name]), isa="baseline")


@pytest.mark.parametrize("isa", ["auto", "baseline"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_baseline_low_precision(isa, dtype):
    check(*make_case(full=[30], segs=[(4, [200]), (2, [300])], n_rep=3, L_q=2, dtype=dtype), isa=isa)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("L_q", [1, 3])
def test_low_precision_query_and_full_part(dtype, L_q):
    check(
        *make_case(
            full=[30, 9],
            segs=[(4, [200, 64]), (2, [700, 33])],
            H_kv=3,
            n_rep=3,
            L_q=L_q,
            dtype=dtype,
            scale_dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float16,
        )
    )


@pytest.mark.parametrize("tokens_per_item", [1, 7, 32, 100000])
def test_work_item_sizes_do_not_change_the_result(tokens_per_item):
    """Items cut anywhere (mid-chunk, one token each, one item per source) merge to the same attention."""
    check(
        *make_case(full=[45, 3], segs=[(4, [90, 31]), (2, [0, 120])], n_rep=3, L_q=3, C=16),
        tokens_per_item=tokens_per_item,
    )


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_counts(threads):
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check(*make_case(full=[10, 20], segs=[(4, [300, 10]), (2, [500, 900])], n_rep=3))
    finally:
        torch.set_num_threads(prev)


def test_no_visible_token_gives_zeros():
    """A sequence with nothing in the cache (only padding) gets zeros, like the PyTorch path's empty softmax."""
    args, kv = make_case(full=[4, 1], segs=[(2, [5, 0])])
    start = args[3].clone()
    start[1] = args[1].shape[2]  # sequence 1: no full-part token either
    out = cpu_ops.split_precision_attention(args[0], args[1], args[2], start, args[4], args[5])
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out[0]).all()


def test_does_not_read_padding_or_other_sequences():
    """NaN left padding (make_case) and NaN codes' scales of other sequences never leak into a sequence's output."""
    args, kv = make_case(full=[3, 6], segs=[(4, [10, 20]), (2, [40, 8])], C=8)
    seg = list(args[4][1])
    seg[7] = seg[7].clone()
    seg[7][:, 40:] = float("nan")  # sequence 1's value scales
    args[4][1] = tuple(seg)
    out = cpu_ops.split_precision_attention(*args)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).any()


def test_nan_key_poisons_its_rows_like_the_reference():
    args, _ = make_case(full=[6, 6], segs=[(2, [40, 40])])
    args[1][0, 1, -3, 5] = float("nan")  # sequence 0, kv head 1
    out = cpu_ops.split_precision_attention(*args)
    assert torch.isnan(out[0, 1]).all() and torch.isfinite(out[0, 0]).all() and torch.isfinite(out[1]).all()


def _bad(args, i=None, **changes):
    """The arguments with ``changes`` applied (to segment ``i``'s fields if given): ``(args, kwargs)``."""
    a, kw = list(args), {}
    names = ["query", "full_keys", "full_values", "full_start", "segments", "scaling"]
    if i is None:
        for k, v in changes.items():
            if k in names:
                a[names.index(k)] = v
            else:
                kw[k] = v
    else:
        seg = list(a[4][i])
        for k, v in changes.items():
            seg[cpu_ops.attention.SEGMENT_FIELDS.index(k)] = v
        a[4] = [tuple(seg) if j == i else s for j, s in enumerate(a[4])]
    return a, kw


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(query=torch.zeros(1, 2, 1, 64, dtype=torch.float64)), r"query must be of dtype .*got torch.float64"),
        (dict(query=torch.zeros(1, 2, 1, 60)), r"head dim D must be a positive multiple of 8, got 60"),
        (dict(query=torch.zeros(1, 3, 1, 64)), r"H_kv \(dim 1\) must be a divisor of the query heads H_q=3, got 2"),
        (
            dict(full_keys=torch.zeros(1, 2, 9, 128)[..., ::2], full_values=torch.zeros(1, 2, 9, 128)[..., ::2]),
            r"full_keys' last dim must be contiguous \(stride 1\), got stride 2",
        ),
        (dict(full_values=torch.zeros(1, 2, 9, 64)), r"full_values must be of shape \(1, 2, 4, 64\)"),
        (dict(full_start=torch.zeros(1, dtype=torch.int64)), r"full_start must be of dtype torch.int32"),
        (dict(full_start=torch.tensor([5], dtype=torch.int32)), r"full_start\[0\] must be in \[0, R=4\], got 5"),
        (dict(segments=[None] * 3), r"segments must be a list of at most 2 segment tuples, got 3 segments"),
        (dict(scaling=float("nan")), r"scaling must be a finite float"),
        (dict(isa="avx512"), r"isa must be 'auto', 'avx2' or 'baseline', got 'avx512'"),
    ],
)
def test_invalid_arguments_name_the_argument(change, match):
    args, _ = make_case(full=[4], segs=[(4, [10])])
    with pytest.raises(ValueError, match=match):
        a, kw = _bad(args, **change)
        cpu_ops.split_precision_attention(*a, **kw)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(bits=5), r"segments\[0\].bits must be one of \(2, 3, 4\) or a pair .*, got 5"),
        (
            dict(bits=(2, 3)),
            r"segments\[0\].bits must be one of \(2, 3, 4\) or a pair \(key_bits, value_bits <= key_bits\)",
        ),
        (dict(bits=(2, 2, 2)), r"segments\[0\].bits must be one of .*, got \(2, 2, 2\)"),
        (dict(bits=(4, 2)), r"segments\[0\].k_codes must be of shape \(2, 10, 32\)"),
        (
            dict(bits=(2, 2), v_codes=torch.zeros(2, 10, 24, dtype=torch.uint8)),
            r"segments\[0\].v_codes must be of shape \(2, 10, 16\)",
        ),
        (dict(group_size=48), r"segments\[0\].group_size must be a power of two dividing D=64, got 48"),
        (dict(group_size=128), r"segments\[0\].group_size must be a power of two dividing D=64, got 128"),
        (
            dict(k_codes=torch.zeros(2, 10, 32, dtype=torch.uint8)),
            r"segments\[0\].k_codes must be of shape \(2, 10, 16\)",
        ),
        (dict(k_scale=torch.zeros(2, 1, 64, dtype=torch.float64)), r"segments\[0\].k_scale must be of dtype .*float64"),
        (dict(v_zero=torch.zeros(2, 10, 2)), r"segments\[0\].v_zero must be of dtype torch.float16"),
        (dict(tok_off=torch.tensor([0, 11], dtype=torch.int32)), r"tok_off\[B\]=11 exceeds the segment's size 10"),
        (dict(tok_off=torch.tensor([4, 2], dtype=torch.int32)), r"tok_off must be non-decreasing"),
        (dict(chunk_size=1), r"sequence 0 owns 10 tokens \(10 chunks of 1\) but only 1 chunks"),
    ],
)
def test_invalid_segments_name_the_field(change, match):
    args, _ = make_case(full=[4], segs=[(2, [10])])
    with pytest.raises(ValueError, match=match):
        a, kw = _bad(args, 0, **change)
        cpu_ops.split_precision_attention(*a, **kw)


def test_a_segment_of_12_items_is_refused():
    """A 12th item (the codebook's level table of earlier versions) is refused, not ignored: a 12th item is now the
    outlier key channels' pair."""
    (query, fk, fv, start, segments, scaling), _ = make_case(full=[4], segs=[(3, [10])])
    with pytest.raises(ValueError, match=r"segments\[0\]'s outlier key channels must be a pair \(n_out, channels\)"):
        cpu_ops.split_precision_attention(query, fk, fv, start, [(*segments[0], torch.zeros(8))], scaling)


def test_unavailable_extension_says_why(monkeypatch):
    """A failed build makes available() False and the launcher raise ImportError naming the cause and the fix."""
    monkeypatch.setattr(_build, "_module", None)
    monkeypatch.setattr(_build, "_reason", None)

    def fail():
        raise RuntimeError("no C++ compiler: 'c++' is not on PATH")

    monkeypatch.setattr(_build, "_build", fail)
    assert not cpu_ops.available()
    reason = cpu_ops.unavailable_reason()
    assert "no C++ compiler" in reason and "apt-get install g++" in reason and "pip install ninja" in reason
    args, _ = make_case(full=[4], segs=[(4, [10])])
    with pytest.raises(ImportError, match="could not be built"):
        cpu_ops.split_precision_attention(*args)


def test_is_a_leaf_package():
    """cpu_ops imports nothing from hf_cocktail (hf_cocktail's dispatcher imports it)."""
    import ast
    import pathlib

    for path in pathlib.Path(cpu_ops.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            assert not any(n.split(".")[0] == "hf_cocktail" for n in names), f"{path.name} imports {names}"
