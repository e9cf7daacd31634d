"""Property tests (hypothesis): packing is exact; split-precision attention over packed segments equals plain
attention over the dequantized cache, for random shapes, GQA ratios, precision maps and batch raggedness."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_cocktail.decode.split_attention import split_precision_attention_torch
from hf_cocktail.storage import quant
from hf_cocktail.storage.store import FullPart, LayerStore, PackedSegment

SETTINGS = settings(max_examples=40, deadline=None)


@SETTINGS
@given(
    bits=st.sampled_from([2, 4]),
    lead=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    d=st.sampled_from([4, 8, 16, 64]),
    seed=st.integers(0, 2**16),
)
def test_pack_unpack_exact(bits, lead, d, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (*lead, d), generator=g, dtype=torch.uint8)
    assert torch.equal(quant.unpack_codes(quant.pack_codes(codes, bits), bits), codes)


@st.composite
def stores(draw):
    B = draw(st.integers(1, 3))
    H_kv = draw(st.integers(1, 3))
    n_rep = draw(st.integers(1, 4))
    D = draw(st.sampled_from([16, 32]))
    C = draw(st.sampled_from([4, 8, 16]))
    G = draw(st.sampled_from([8, 16]))
    Lq = draw(st.integers(1, 2))
    full = [draw(st.integers(Lq, 20)) for _ in range(B)]
    n4 = [draw(st.integers(0, 40)) for _ in range(B)]
    n2 = [draw(st.integers(0, 40)) for _ in range(B)]
    seed = draw(st.integers(0, 2**16))
    return B, H_kv, n_rep, D, C, G, Lq, full, n4, n2, seed


@SETTINGS
@given(stores())
def test_split_attention_equals_attention_over_dequantized(args):
    B, H_kv, n_rep, D, C, G, Lq, full, n4, n2, seed = args
    g = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randn(H_kv, n, D, generator=g) * 2  # noqa: E731
    fk, fv = [rnd(n) for n in full], [rnd(n) for n in full]
    store = LayerStore(
        FullPart.from_sequences(fk, fv),
        [
            PackedSegment.from_sequences([rnd(n) for n in ns], [rnd(n) for n in ns], bits, C, G, torch.float16)
            for bits, ns in ((4, n4), (2, n2))
        ],
    )
    q = torch.randn(B, H_kv * n_rep, Lq, D, generator=g)
    out = split_precision_attention_torch(q, store, D**-0.5)
    for b in range(B):
        ks, vs = zip(*[seg.sequence(b) for seg in store.segments])
        K = torch.cat([*ks, fk[b]], 1).repeat_interleave(n_rep, 0)
        V = torch.cat([*vs, fv[b]], 1).repeat_interleave(n_rep, 0)
        T = K.shape[1]
        mask = torch.ones(Lq, T, dtype=torch.bool).tril(T - Lq)
        ref = torch.nn.functional.scaled_dot_product_attention(q[b], K, V, attn_mask=mask, scale=D**-0.5)
        torch.testing.assert_close(out[b], ref, rtol=1e-5, atol=1e-5)
