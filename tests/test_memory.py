"""What a cache holds, in bytes: ``nbytes()`` against a walk of every tensor reachable from the cache's layers and
plans, the full part's room for appended tokens (proportionate, and on its own line of ``memory_report``), and one
rotation matrix shared by every layer and cache."""

import copy

import pytest
import torch

from hf_cocktail import CocktailCache, CocktailConfig
from hf_cocktail.cache.reports import memory_report
from hf_cocktail.integration.compat import cache_kwargs
from hf_cocktail.storage.full_part import HEADROOM_STEP, FullPart
from hf_cocktail.storage.rotation import Rotation, shared_matrices
from hf_cocktail.storage.store import LayerStore

from .conftest import FakeEncoder, make_prompt, make_tiny_llama
from .test_architectures import make_model

BASE = dict(chunk_size=8, group_size=16, alpha=0.3, beta=0.3)
CONFIGS = {
    "paper": {},
    "rotated_8bit": dict(rotation="hadamard", scale_bits=8, full_part_bits=8, low_bits=3),
    "salient": dict(rotation="hadamard_keys", salient_tokens=0.1),
    "unrotated_8bit_part": dict(scale_bits=8, full_part_bits=8),
    "values_rotated_8bit_part": dict(rotation="hadamard_values", full_part_bits=8),  # keys in the values' basis
}


def reachable_bytes(cache) -> int:
    """Bytes of the storages of every tensor reachable from the cache's layers (stores, segments, full parts,
    rotations, the model's own layers) and plans, each storage once, without the garbage collector: a walk of
    attributes, lists, tuples and dicts. The CPU context copy (``keep_context_copy``, reported apart) is left out."""
    seen_storages: dict[int, int] = {}
    seen_objects: set[int] = set()
    skip = {"_cache", "config", "context_copy", "pending"}

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            if st.nbytes():
                seen_storages[st.data_ptr()] = st.nbytes()
            return
        if id(obj) in seen_objects or obj is None or isinstance(obj, (str, int, float, bool, torch.dtype)):
            return
        seen_objects.add(id(obj))
        if isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        elif hasattr(obj, "__dict__"):
            for name, v in vars(obj).items():
                if name not in skip:
                    walk(v)

    for layer in cache.layers:
        walk(layer)
    walk(cache._plans)
    walk(cache._input_ids)
    return sum(seen_storages.values())


def generate(model, tok, config, prompts, **kw):
    cache = CocktailCache(config, encoder=FakeEncoder())
    if isinstance(prompts, tuple):
        prompts = [prompts]
    inputs = cache.prepare_inputs(
        tok, [p for p, _, _ in prompts], contexts=[c for _, c, _ in prompts], queries=[q for _, _, q in prompts]
    )
    model.generate(**inputs, **cache_kwargs(model, cache), do_sample=False, **kw)
    return cache


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_nbytes_counts_every_tensor_reachable_from_the_cache(tiny_tokenizer, name):
    """Before: nbytes() left out the full part's headroom, the per-layer fp32 rotation matrices and the index
    tensors (on this tiny model about half of what the stores held)."""
    config = CocktailConfig(**BASE, **CONFIGS[name])
    prompts = [make_prompt(90, seed=3, needle_at=20), make_prompt(40, seed=4, needle_at=5)]
    cache = generate(make_tiny_llama(attn="cocktail", head_dim=32), tiny_tokenizer, config, prompts, max_new_tokens=5)
    assert cache.nbytes() == reachable_bytes(cache) == cache.memory_report()["total_bytes"]
    assert cache.memory_report()["headroom_bytes"] > 0
    beams = generate(
        make_tiny_llama(attn="cocktail", head_dim=32), tiny_tokenizer, config, prompts[0], num_beams=2, max_new_tokens=3
    )
    assert beams.nbytes() == reachable_bytes(beams)
    twin = copy.deepcopy(cache)
    assert twin.nbytes() == reachable_bytes(twin) == cache.nbytes()


def test_nbytes_of_a_model_with_sliding_layers_and_a_context_copy(tiny_tokenizer):
    config = CocktailConfig(**BASE, rotation="hadamard", keep_context_copy=True)
    cache = generate(make_model("gemma3", "cocktail"), tiny_tokenizer, config, make_prompt(90), max_new_tokens=4)
    rep = cache.memory_report()
    assert rep["native_layers_bytes"] > 0 and rep["context_copy_bytes"] > 0
    assert cache.nbytes() == reachable_bytes(cache) == rep["total_bytes"]


def test_the_headroom_is_proportionate_and_counted_in_the_ratio(tiny_tokenizer):
    config = CocktailConfig(**BASE)
    model = make_tiny_llama(attn="cocktail", head_dim=32)
    cache = generate(model, tiny_tokenizer, config, make_prompt(200), max_new_tokens=2)  # one appended token
    rep = cache.memory_report()
    full = cache.layers[0].store.full
    B, H, R, D = full.shape
    assert full.reserved_bytes() == 2 * B * H * HEADROOM_STEP * D * 4  # fp32 keys and values: 16 tokens of room
    assert rep["headroom_bytes"] == 2 * full.reserved_bytes()  # two layers
    deployed = rep["codes_bytes"] + rep["scales_zeros_bytes"] + rep["full_precision_bytes"] // 2
    deployed += rep["headroom_bytes"] // 2 + rep["rotation_bytes"] + rep["index_bytes"]
    assert rep["ratio_to_fp16"] * rep["fp16_equivalent_bytes"] == pytest.approx(deployed, abs=1e-6)
    part = FullPart.from_sequences([torch.zeros(1, 500, 4)], [torch.zeros(1, 500, 4)])
    capacities = []
    for _ in range(200):  # the room follows the appended tokens (16, then half the appended), not the prefill's 500
        part.append(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4))
        capacities.append(part._buffers[0].shape[2])
    assert sorted(set(capacities)) == [501 + 16, 518 + 16, 535 + 17, 553 + 26, 580 + 40, 621 + 60, 682 + 91]
    assert part.nbytes() == 2 * 700 * 4 * 4


def test_one_rotation_matrix_is_shared_by_every_layer_and_cache(tiny_tokenizer):
    config = CocktailConfig(**BASE, rotation="hadamard")
    model = make_tiny_llama(attn="cocktail", head_dim=32)
    a, b = (generate(model, tiny_tokenizer, config, make_prompt(60), max_new_tokens=2) for _ in range(2))
    mats = {id(layer.store.rotation.keys) for cache in (a, b, copy.deepcopy(a)) for layer in cache.layers}
    mats |= {id(layer.store.rotation.values) for layer in a.layers}
    assert len(mats) == 1
    rep = a.memory_report()
    assert rep["rotation_bytes"] == 2 * 32 * 32 * 4  # (H_kv 2, D 32, D 32) fp32, once
    assert Rotation.make("hadamard", 2, 32, 1).keys is not a.layers[0].store.rotation.keys  # another seed


@pytest.mark.parametrize("kind", [None, "hadamard_values"])
def test_an_8_bit_part_key_basis_is_counted_once(kind):
    """A store whose 8-bit full part has keys in a basis of their own holds its ``(H_kv, D, D)`` matrices: counted
    with the rotation's, once where they are the values' matrices."""
    H, D = 2, 32
    k, v = torch.randn(1, H, 40, D), torch.randn(1, H, 40, D)
    rotation = Rotation.make(kind, H, D, seed=1)
    store = LayerStore.build(
        k,
        v,
        [{"full": torch.arange(32, 40), 4: torch.arange(0, 32)}],
        8,
        16,
        torch.float16,
        rotation=rotation,
        full_part_bits=8,
        full_key_basis=shared_matrices(H, D, 1),
    )
    assert memory_report([store], [], [])["rotation_bytes"] == H * D * D * 4


@pytest.mark.parametrize("prepared", [True, False])
def test_the_positions_and_prompt_ids_a_cache_keeps_are_int32(tiny_tokenizer, prepared):
    """The plans' token positions and the prompt's ids stay for the cache's life: 4 bytes each, and the report
    counts exactly them (with or without ``prepare_inputs``)."""
    model = make_tiny_llama()
    prompt, context, query = make_prompt(200)
    config = CocktailConfig(uniform_bits=4)
    if prepared:
        cache = generate(model, tiny_tokenizer, config, (prompt, context, query), max_new_tokens=1)
    else:
        cache = CocktailCache(config, encoder=FakeEncoder())
        enc = tiny_tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            model.generate(**enc, **cache_kwargs(model, cache), max_new_tokens=1, do_sample=False)
    held = [*cache._plans[0].positions.values(), cache._input_ids]
    assert {t.dtype for t in held} == {torch.int32}
    L = cache._input_ids.shape[1]
    assert sum(p.numel() for p in cache._plans[0].positions.values()) == L
    assert cache.memory_report()["index_bytes"] == 2 * 4 * L
