"""The exact head of an 8-bit full part (:mod:`hf_cocktail.storage.exact_head`): each sequence's first
``sink_tokens`` tokens at the model's precision beside their codes, read instead of them by the PyTorch path, the
fused CPU kernel and Triton (interpreted), with and without the part's own key basis.

Shapes: B sequences, H_kv key/value heads, S head tokens, T tokens, D head dim.
"""

from __future__ import annotations

import pytest
import torch

from hf_cocktail.decode import dispatch
from hf_cocktail.storage.exact_head import ExactHead
from hf_cocktail.storage.full_part import Int8FullPart
from hf_cocktail.storage.rotation import Rotation, shared_matrices
from hf_cocktail.storage.store import LayerStore

from .conftest import assert_fused_cpu_kernel_matches_reference


def _sequences(lengths=(7, 11), H=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(H, n, D, generator=g) * 3 for n in lengths]
    return ks, [torch.randn(H, n, D, generator=g) for n in lengths]


def test_the_head_keeps_every_sequence_s_first_tokens_exactly_and_the_rest_as_codes():
    ks, vs = _sequences()
    part = Int8FullPart.from_sequences(ks, vs, torch.float16, exact_tokens=4)
    plain = Int8FullPart.from_sequences(ks, vs, torch.float16)
    assert part.head.count == 4 and part.start == [4, 0]
    for b, (k, v) in enumerate(zip(ks, vs)):
        s = part.start[b]
        assert torch.equal(part.keys[b, :, s : s + 4], k[:, :4]) and torch.equal(part.values[b, :, s : s + 4], v[:, :4])
        assert torch.equal(part.keys[b, :, s + 4 :], plain.keys[b, :, s + 4 :])
        assert not torch.equal(plain.keys[b, :, s : s + 4], k[:, :4])  # the codes alone are not exact
    keys, values = part.tokens(2, 6)  # tokens 2..7: sequence 0's head is 4..7, sequence 1's 0..3
    torch.testing.assert_close(keys, part.keys[:, :, 2:8], rtol=0, atol=0)
    torch.testing.assert_close(values, part.values[:, :, 2:8], rtol=0, atol=0)
    assert part.nbytes() == plain.nbytes() + 2 * 2 * 4 * 2 * 16 * 4  # keys and values, B=2, S=4, H=2, D=16, fp32
    assert part.deployed_bytes() == plain.deployed_bytes() + 2 * 2 * 4 * 2 * 16 * 2


def test_a_short_sequence_limits_the_head_and_a_crop_shortens_it():
    ks, vs = _sequences((3, 9))
    part = Int8FullPart.from_sequences(ks, vs, torch.float16, exact_tokens=4)
    assert part.head.count == 3  # every sequence keeps the same number: the shortest has 3
    assert ExactHead.from_sequences(ks, vs, 0) is None
    ks, vs = _sequences((5, 5))
    part = Int8FullPart.from_sequences(ks, vs, torch.float16, exact_tokens=4)
    part.truncate(3)
    assert part.head.count == 2 and torch.equal(part.keys[:, :, :2], torch.stack([k[:, :2] for k in ks]))
    part.truncate(2)
    assert part.head is None


def test_rows_are_selected_with_their_head_and_head_tokens_are_never_removed():
    ks, vs = _sequences((6, 6))
    part = Int8FullPart.from_sequences(ks, vs, torch.float16, exact_tokens=4)
    swapped = part.select([1, 0, 1])
    assert torch.equal(swapped.keys[0], part.keys[1]) and torch.equal(swapped.head.values[2], part.head.values[1])
    with pytest.raises(ValueError, match="include exact head tokens"):
        part.remove(3, 2)
    part.remove(4, 2)
    assert part.length == 4 and torch.equal(part.keys, torch.stack([k[:, :4] for k in ks]))


def exact_head_store(kind, lengths=(70, 66), S=4, H=2, D=32, basis=True, device="cpu"):
    """``(store, positions, (k, v))``: a store whose sequences start at different places of the full part (left
    padding, and full parts of different lengths), with an exact head of ``S`` tokens; the first tokens carry large
    keys (sinks), so that 8-bit codes of them would show."""
    g = torch.Generator().manual_seed(0)
    B, T = len(lengths), 72
    k, v = (torch.randn(B, H, T, D, generator=g).to(device) for _ in range(2))
    k[:, :, :8] *= 20
    positions = []
    for b, n in enumerate(lengths):
        first = T - n + S + 4 + 3 * b  # the sequence's first tokens (its head among them) stay in the full part
        last = torch.arange(T - 6, T)
        positions.append({"full": torch.cat([torch.arange(T - n, first), last]), 4: torch.arange(first, T - 6)})
    rotation = Rotation.make(kind, H, D, seed=1, device=device)
    fb = shared_matrices(H, D, 1, device) if basis else None
    store = LayerStore.build(
        k, v, positions, 8, 16, torch.float16, rotation=rotation, full_part_bits=8, full_key_basis=fb, exact_tokens=S
    )
    return store, positions, (k, v)


@pytest.mark.parametrize("kind,basis", [(None, True), (None, False), ("hadamard", False), ("hadamard_values", True)])
def test_the_store_reads_its_sink_tokens_exactly(kind, basis):
    store, positions, (k, v) = exact_head_store(kind, basis=basis)
    keys, values = store.dequantized(positions, 72, 72)
    for b, pos in enumerate(positions):
        sinks = pos["full"][:4]
        torch.testing.assert_close(keys[b, :, sinks], k[b, :, sinks], atol=2e-5, rtol=0)  # (fp32 rotation only)
        torch.testing.assert_close(values[b, :, sinks], v[b, :, sinks], atol=2e-5, rtol=0)
        assert (keys[b, :, pos["full"][4:]] - k[b, :, pos["full"][4:]]).abs().max() > 1e-3  # the rest: 8-bit codes


@pytest.mark.parametrize("kind,basis", [(None, True), (None, False), ("hadamard", False), ("hadamard_values", True)])
@pytest.mark.parametrize("L_q", [1, 3])
@pytest.mark.parametrize("per_item", [None, 3])
def test_the_fused_cpu_kernel_equals_the_reference(kind, basis, L_q, per_item, monkeypatch):
    """``per_item`` 3: work items of 3 tokens, so the head (4 tokens) spans two items and shares one with codes."""
    store, _, _ = exact_head_store(kind, basis=basis)
    store.append(torch.randn(2, 2, L_q, 32), torch.randn(2, 2, L_q, 32))
    if per_item is not None:
        import cpu_ops.attention

        monkeypatch.setattr(cpu_ops.attention, "_default_tokens_per_item", lambda *_: per_item)
    query = torch.randn(2, 4, L_q, 32, generator=torch.Generator().manual_seed(5))
    assert_fused_cpu_kernel_matches_reference(store, query, 32**-0.5)


def test_the_cpu_kernel_reads_the_head():
    """Without ``full_head`` the kernel reads the sinks' codes: a different result (the argument is read); a head of
    the wrong shape is refused naming it."""
    cpu_ops = pytest.importorskip("cpu_ops")
    if not cpu_ops.available():
        pytest.skip(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}")
    from cpu_ops.attention import split_precision_attention as fused

    store, _, _ = exact_head_store(None, basis=False)
    full = store.full
    query = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(5)) * 4
    args = (
        query,
        *full.split_path_tensors(),
        full.start_tensor(),
        [dispatch._kernel_segment(s) for s in store.segments],
    )
    kw = dict(full_scales=(full.scales.keys, full.scales.values))
    right = fused(*args, 32**-0.5, full_head=(full.head.keys, full.head.values), **kw)
    torch.testing.assert_close(right, dispatch.split_precision_attention(query, store, 32**-0.5, "cpu"))
    assert (fused(*args, 32**-0.5, **kw) - right).abs().max() > 1e-4
    with pytest.raises(ValueError, match=r"full_head\[0\] must be of shape \(2, 2, \*, 32\)"):
        fused(*args, 32**-0.5, full_head=(full.head.keys[:, :1], full.head.values), **kw)


def test_basis_matrices_are_the_shared_ones():
    store, _, _ = exact_head_store(None)
    assert store.full.key_basis is shared_matrices(2, 32, 1)
