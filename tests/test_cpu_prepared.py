"""The decode dispatch's entry into the fused CPU kernel: ``cpu_ops.attention.prepare`` checks a store's fixed
arguments once and ``split_precision_attention_prepared`` gives exactly what the checked public entry gives; the
dispatch keeps the prepared arguments and its backend choice per store, and remakes them for new segments."""

import copy
import os

import pytest
import torch

import cpu_ops
import cpu_ops.attention as cpu_attention
from hf_cocktail.decode import dispatch
from hf_cocktail.storage import params8
from hf_cocktail.storage.full_part import Int8FullPart
from hf_cocktail.storage.rotation import Rotation
from hf_cocktail.storage.store import LayerStore

from .test_cpu_ops import make_case

if not cpu_ops.available():
    if os.environ.get("HF_COCKTAIL_REQUIRE_CPU_OPS") == "1":  # CI: a build failure must fail, not skip
        raise RuntimeError(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}")
    pytest.skip(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}", allow_module_level=True)


@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("L_q", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_prepared_entry_equals_the_checked_entry(rotated, L_q, dtype):
    args, _ = make_case([9, 5], [(4, [70, 40]), ((3, 2), [33, 0])], H_kv=2, n_rep=3, L_q=L_q, dtype=dtype, seed=2)
    query, fk, fv, start, segments, scaling = args
    kw = {"rotation": (Rotation.make("hadamard", 2, 64, 1).keys,) * 2} if rotated else {}
    want = cpu_ops.split_precision_attention(*args, **kw)
    prepared = cpu_attention.prepare(2, 2, 64, segments, **kw)
    got = cpu_attention.split_precision_attention_prepared(query, fk, fv, start, prepared, scaling)
    assert torch.equal(got, want)


def _store(scale_bits=8, tokens=300, B=1):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(B, 3, tokens, 64, generator=g), torch.randn(B, 3, tokens, 64, generator=g)
    full = torch.cat([torch.arange(0, 10), torch.arange(tokens - 20, tokens)])
    pos = {"full": full, 4: torch.arange(10, 150), 2: torch.arange(150, tokens - 20)}
    return LayerStore.build(
        k,
        v,
        [pos] * B,
        32,
        32,
        torch.float16,
        rotation=Rotation.make("hadamard", 3, 64, 0),
        max_value_bits=3,
        scale_bits=scale_bits,
        full_part_bits=8,
    )


def _checked_call(query, store):
    """The kernel through the public, fully checked entry, with the arguments the dispatch used to build per step."""
    full = store.full
    assert isinstance(full, Int8FullPart)
    kw = {"scale_table": params8.scale_table("cpu")} if store.segments[0].scale_bits == 8 else {}
    return cpu_ops.split_precision_attention(
        query,
        *full.split_path_tensors(),
        full.start_tensor(),
        [s.coded_kernel_args() for s in store.segments],
        0.125,
        full_scales=(full.scales.keys, full.scales.values),
        rotation=(store.rotation.keys, store.rotation.values),
        **kw,
    )


@pytest.mark.parametrize("scale_bits", [8, 16])
def test_the_dispatch_prepares_once_per_store_and_gives_the_checked_results(scale_bits):
    store = _store(scale_bits, B=2)
    g = torch.Generator().manual_seed(1)
    prepared = None
    for _ in range(5):
        store.append(torch.randn(2, 3, 1, 64, generator=g), torch.randn(2, 3, 1, 64, generator=g))
        q = torch.randn(2, 9, 1, 64, generator=g)
        out = dispatch.split_precision_attention(q, store, 0.125, "auto")
        assert torch.equal(out, _checked_call(q, store))
        entry = store.kernel_cache["cpu"][2]
        assert prepared is None or entry is prepared  # made at the first step, then kept
        prepared = entry
    picked = store.select([1])  # new segments: new store, new arguments
    q1 = q[1:]
    assert torch.equal(dispatch.split_precision_attention(q1, picked, 0.125, "auto"), _checked_call(q1, picked))
    assert picked.kernel_cache["cpu"][2] is not prepared
    store.segments = [store.segments[1], store.segments[0]]  # the same store given other segments: remade
    dispatch.split_precision_attention(q, store, 0.125, "auto")
    assert store.kernel_cache["cpu"][2] is not prepared
    twin = copy.deepcopy(store)  # a copy starts without the derived arguments (no duplicated rotation matrices)
    assert not twin.kernel_cache and store.kernel_cache


def test_prepare_refuses_bad_fixed_arguments_naming_them():
    store = _store()
    segments = [s.coded_kernel_args() for s in store.segments]
    bad = list(segments[0])
    bad[3] = bad[3].to(torch.int16)
    with pytest.raises(ValueError, match=r"segments\[0\]\.k_codes must be of dtype torch.uint8"):
        cpu_attention.prepare(1, 3, 64, [tuple(bad)], scale_table=params8.scale_table("cpu"))
    with pytest.raises(ValueError, match=r"rotation\[0\] must be of shape \(3, 64, 64\)"):
        cpu_attention.prepare(1, 3, 64, segments, rotation=(torch.zeros(3, 64, 32), None))
    with pytest.raises(ValueError, match="scale_table must be a float32 .256,. tensor"):
        cpu_attention.prepare(1, 3, 64, segments)


@pytest.mark.parametrize(
    "query, match",
    [
        (torch.zeros(1, 9, 1, 32), r"query must be of shape \(1, \*, \*, 64\)"),
        (torch.zeros(2, 9, 1, 64), r"query must be of shape \(1, \*, \*, 64\)"),
        (torch.zeros(1, 9, 1, 64, dtype=torch.int32), "query must be of dtype"),
        (torch.zeros(1, 8, 1, 64), r"query's H_q \(dim 1\) must be a positive multiple of the key/value heads H_kv=3"),
        (torch.zeros(1, 9, 0, 64), "query's L_q must be >= 1"),
    ],
)
def test_the_prepared_entry_refuses_a_query_that_does_not_fit(query, match):
    store = _store()
    full = store.full
    prepared = dispatch._cpu_prepared(store)
    with pytest.raises(ValueError, match=match):
        cpu_attention.split_precision_attention_prepared(
            query,
            *full.split_path_tensors(),
            full.start_tensor(),
            prepared,
            0.125,
            full_scales=(full.scales.keys, full.scales.values),
            scale_table=params8.scale_table("cpu"),
        )
    with pytest.raises(ValueError, match="scale_table must be a float32"):
        cpu_attention.split_precision_attention_prepared(
            torch.zeros(1, 9, 1, 64),
            *full.split_path_tensors(),
            full.start_tensor(),
            prepared,
            0.125,
            full_scales=(full.scales.keys, full.scales.values),
        )
