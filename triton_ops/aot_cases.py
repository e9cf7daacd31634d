"""The launch specializations of the ahead-of-time compile report (:mod:`triton_ops.aot`): model-shaped decode
cases (the ones that must stay within the register budget), a coverage sweep of what the dispatch can reach (head
dims, code widths and key / value pairs, 8-bit parameters, 8-bit full part, 0 / 1 / 2 packed segments, L_q 1..8,
GQA 1..8, fp16 / bf16 / fp32 queries, sinks, soft-capping) and the quantize kernels.

A case builds small CPU stand-in tensors of the right dtypes and layouts (never launched) and asks the launchers'
own planning functions (:func:`triton_ops.attention.plan_split_attention`,
:func:`triton_ops.quantize.plan_quantize_keys`, ...) for their :class:`~triton_ops.launch.Launch` objects, so
the constexprs, tiles, warps and stages are exactly those of a real launch.

Shapes: B batch, H_kv key/value heads, n_rep query heads per kv head, L_q query tokens, D head dim, R full-part
length, N tokens of a segment, M its chunks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .attention import plan_split_attention
from .quantize import plan_quantize_keys, plan_quantize_values

CHUNK, GROUP = 32, 32  # CocktailConfig's chunk_size and group_size defaults
REC_GROUP = 64  # CocktailConfig.recommended()'s value groups (64 channels at D 64, 128 and 256)
NUM_SMS = 132  # H100 SXM / H200: tokens_per_split as on those GPUs


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention launch: a model's heads and a stored format. ``segs``: per packed segment ``(key_bits,
    value_bits)`` (0, 1 or 2 of them); ``p8``: 8-bit scales and zeros; ``f8``: the 8-bit full part; ``fq``: its
    keys in a basis of their own (an fp32 query of their own, the layer's keys unrotated); ``head``: its exact head
    (4 sink tokens at the query's dtype); ``outliers``: the share of key channels stored at 8 bits in every segment
    (outlier key channels, 16-bit scales only; 0: none); ``G``: the value group size (a compile-time constant)."""

    name: str
    D: int
    H_kv: int
    n_rep: int
    segs: tuple[tuple[int, int], ...] = ((4, 4), (2, 2))
    L_q: int = 1
    dtype: torch.dtype = torch.bfloat16
    p8: bool = False
    f8: bool = False
    sinks: bool = False
    softcap: float | None = None
    B: int = 4
    model_shaped: bool = False
    outliers: float = 0.0
    fq: bool = False
    head: bool = False
    G: int = GROUP

    def setting(self) -> str:
        segs = "+".join(f"k{k}v{v}" if k != v else f"int{k}" for k, v in self.segs) or "full part only"
        extra = [
            f
            for f, on in (("p8", self.p8), ("f8", self.f8), ("fq", self.fq), ("head", self.head), ("sinks", self.sinks))
            if on
        ]
        extra += [f"softcap{self.softcap:g}"] if self.softcap else []
        extra += [f"outliers1/{round(1 / self.outliers)}"] if self.outliers else []
        extra += [f"G{self.G}"] if self.G != GROUP else []
        return " ".join([segs, *extra, str(self.dtype).removeprefix("torch."), f"Lq{self.L_q}"])

    def launches(self) -> dict:
        """``{"split_attn_kernel": Launch, "merge_kernel": Launch}`` of this case."""
        B, H_kv, D, R = self.B, self.H_kv, self.D, 77
        q = torch.empty(B, H_kv * self.n_rep, self.L_q, D, dtype=self.dtype)
        fdtype = torch.int8 if self.f8 else self.dtype
        fk, fv = torch.empty(B, H_kv, R, D, dtype=fdtype), torch.empty(B, H_kv, R, D, dtype=fdtype)
        kw: dict = dict(max_tokens=[1000] * len(self.segs), min_full_start=3, num_sms=NUM_SMS)
        if self.f8:
            kw["full_scales"] = (torch.empty(B, H_kv, R, 1, dtype=torch.float16),) * 2
        if self.fq:
            kw["full_query"] = torch.empty(q.shape, dtype=torch.float32)
        if self.head:
            kw["full_head"] = (torch.empty(B, H_kv, 4, D, dtype=self.dtype),) * 2
        if self.p8:
            kw["scale_table"] = torch.empty(256, dtype=torch.float32)
        if self.sinks:
            kw["sinks"] = torch.empty(H_kv * self.n_rep, dtype=torch.float32)
        kw["softcap"] = self.softcap
        start = torch.zeros(B, dtype=torch.int32)
        segments = [
            _segment(bits, B, H_kv, D, self.p8, n, _outlier_count(self.outliers, D, bits[0]), self.G)
            for bits, n in zip(self.segs, (2013, 2999))
        ]
        attn, merge, _ = plan_split_attention(q, fk, fv, start, segments, D**-0.5, **kw)
        return {"split_attn_kernel": attn, "merge_kernel": merge}


def _outlier_count(share: float, D: int, bits: int) -> int:
    """``hf_cocktail.storage.key_outliers.outlier_count``: ``share * D`` rounded up to whole code bytes of the
    other channels (a multiple of 8 channels for INT3, of ``8 // bits`` otherwise)."""
    m = 8 if bits == 3 else 8 // bits
    return min(math.ceil(share * D / m) * m, D - m) if share else 0


def _segment(
    bits: tuple[int, int], B: int, H_kv: int, D: int, p8: bool, N: int, n_out: int = 0, G: int = GROUP
) -> tuple:
    """A packed segment's kernel tuple (``PackedSegment.coded_kernel_args``'s layout) of ``N`` tokens, values in
    groups of ``G`` channels; with ``n_out`` outlier key channels, their item ``(n_out, channels)`` last (dispatch's
    layout)."""
    M = -(-N // CHUNK) + B
    kb, vb = bits
    pdt = torch.uint8 if p8 else torch.float16
    k_params = [torch.empty(H_kv, M, D, dtype=pdt) for _ in range(2)]
    v_params = [torch.empty(H_kv, N, D // G, dtype=pdt) for _ in range(2)]
    offsets = [torch.zeros(B + 1, dtype=torch.int32) for _ in range(2)]
    k_codes = torch.empty(H_kv, N, (D - n_out) * kb // 8 + n_out, dtype=torch.uint8)
    v_codes = torch.empty(H_kv, N, D * vb // 8, dtype=torch.uint8)
    seg = (bits if kb != vb else kb, CHUNK, G, k_codes, *k_params, v_codes, *v_params, *offsets)
    if n_out:
        return (*seg, (n_out, torch.arange(D, dtype=torch.int32).expand(H_kv, D).contiguous()))
    return seg + ((torch.empty(H_kv, M, 3), torch.empty(H_kv, M, 3)) if p8 else ())


# (name, D, H_kv, n_rep): Llama-3-8B, Qwen2.5-7B, SmolLM2-135M, Gemma 3 270M (one KV head), Gemma 3 4B, a D128 MHA
MODELS = (
    ("llama3-8b", 128, 8, 4),
    ("qwen2.5-7b", 128, 4, 7),
    ("smollm2-135m", 64, 3, 3),
    ("gemma3-270m", 256, 1, 4),
    ("gemma3-4b", 256, 4, 2),
    ("mha-d128", 128, 32, 1),
)
# the stored formats of the presets and the settings the dispatch reaches: (segs, p8, f8)
SETTINGS = (
    (((4, 4), (2, 2)), False, False),
    (((4, 4), (3, 3)), False, False),
    (((4, 2), (2, 2)), False, False),
    (((4, 4), (2, 2)), True, True),
    (((4, 4), (3, 3)), True, False),
    (((4, 4), (2, 2)), False, True),
)


def model_cases() -> list[Case]:
    """Model-shaped decode: every model x every setting in bf16 at L_q 1, fp16 once, L_q 4 plain and with the 8-bit
    formats (speculative decoding), 0 and 1 segments once, the 8-bit full part with its exact head, with and without
    keys in a basis of their own (``fq``), with 2 and 1 segments; ``recommended()``'s format (INT4, 8-bit parameters,
    values in groups of 64) with its 16-bit full part and with an 8-bit one (exact head, keys in their own basis);
    gpt-oss-20b's sinks (D 64, 8 KV heads, GQA 8) and
    Gemma 2 9B's soft-capping (D 256, 8 KV heads, GQA 2, cap 50); outlier key channels (1/16 and 1/8 of D at
    8 bits) with INT4+INT2 and INT4+INT3, 1/16 at L_q 4 and with the 8-bit full part (:func:`outlier_cases`)."""
    out = outlier_cases()
    for name, D, H_kv, n_rep in MODELS:
        base: dict[str, Any] = dict(D=D, H_kv=H_kv, n_rep=n_rep, model_shaped=True)
        for segs, p8, f8 in SETTINGS:
            out.append(Case(name, segs=segs, p8=p8, f8=f8, **base))
        out.append(Case(name, dtype=torch.float16, p8=True, f8=True, **base))
        out.append(Case(name, L_q=4, **base))
        out.append(Case(name, L_q=4, p8=True, f8=True, **base))
        out.append(Case(name, segs=(), **base))
        out.append(Case(name, segs=((4, 4),), p8=True, f8=True, **base))
        out.append(Case(name, p8=True, f8=True, head=True, **base))
        out.append(Case(name, p8=True, f8=True, fq=True, head=True, **base))
        out.append(Case(name, segs=((4, 4),), p8=True, f8=True, fq=True, head=True, **base))
        out.append(Case(name, segs=((4, 4),), p8=True, G=REC_GROUP, **base))
        out.append(Case(name, segs=((4, 4),), p8=True, f8=True, fq=True, head=True, G=REC_GROUP, **base))
    for p8 in (False, True):
        out.append(Case("gpt-oss-20b", 64, 8, 8, sinks=True, p8=p8, f8=p8, model_shaped=True))
        out.append(Case("gemma2-9b", 256, 8, 2, softcap=50.0, p8=p8, f8=p8, model_shaped=True))
    return out


def outlier_cases() -> list[Case]:
    """Model-shaped decode over segments with outlier key channels (``hf_cocktail.storage.key_outliers``; 16-bit
    scales only): every model with INT4+INT2 at 1/16 and 1/8 of D, INT4+INT3 at 1/8, L_q 4 and the 8-bit full
    part at 1/16."""
    out = []
    for name, D, H_kv, n_rep in MODELS:
        base: dict[str, Any] = dict(D=D, H_kv=H_kv, n_rep=n_rep, model_shaped=True)
        out += [Case(name, outliers=1 / 16, **base), Case(name, outliers=1 / 8, **base)]
        out.append(Case(name, segs=((4, 4), (3, 3)), outliers=1 / 8, **base))
        out += [Case(name, L_q=4, outliers=1 / 16, **base), Case(name, f8=True, outliers=1 / 16, **base)]
    return out


def ci_cases() -> list[Case]:
    """The CI's representative model-shaped set (:mod:`tests.test_triton_aot`, about 2 minutes on 2 cores): per
    model INT4+INT2 plain and with both 8-bit formats, L_q 4, no packed segment, one; sinks and soft-capping once;
    the 8-bit formats with the full part's exact head on SmolLM2 (INT4+INT2) and Gemma 3 270M (INT4, keys in their
    own basis); ``recommended()``'s format (values in groups of 64) on Gemma 3 270M;
    outlier key channels on SmolLM2 (1/16), Gemma 3 270M and Qwen2.5-7B (1/8)."""
    out = []
    for name, D, H_kv, n_rep in MODELS:
        base: dict[str, Any] = dict(D=D, H_kv=H_kv, n_rep=n_rep, model_shaped=True)
        out += [Case(name, **base), Case(name, p8=True, f8=True, **base), Case(name, L_q=4, **base)]
        out += [Case(name, segs=(), **base), Case(name, segs=((4, 4),), p8=True, f8=True, **base)]
    out.append(Case("gpt-oss-20b", 64, 8, 8, sinks=True, model_shaped=True))
    out.append(Case("gemma3-270m", 256, 1, 4, segs=((4, 4),), p8=True, f8=True, fq=True, head=True, model_shaped=True))
    out.append(Case("smollm2-135m", 64, 3, 3, p8=True, f8=True, head=True, model_shaped=True))
    out.append(Case("gemma3-270m", 256, 1, 4, segs=((4, 4),), p8=True, G=REC_GROUP, model_shaped=True))
    out.append(Case("gemma2-9b", 256, 8, 2, softcap=50.0, model_shaped=True))
    out.append(Case("smollm2-135m", 64, 3, 3, outliers=1 / 16, model_shaped=True))
    out.append(Case("gemma3-270m", 256, 1, 4, outliers=1 / 8, model_shaped=True))
    out.append(Case("qwen2.5-7b", 128, 4, 7, outliers=1 / 8, model_shaped=True))
    return out


def sweep_cases() -> list[Case]:
    """What else the dispatch can launch: every head dim with every segment layout (plain and 8-bit formats),
    GQA 1..8 and L_q 1..8 at D 128, fp16 / fp32 queries at every head dim, sinks with soft-capping together."""
    layouts = ((), ((4, 4),), ((3, 3),), ((2, 2),), ((4, 4), (2, 2)), ((4, 4), (3, 3)), ((4, 2), (3, 2)))
    out = []
    for D in (64, 128, 256):
        for segs in layouts:
            for fmt in (False, True):
                out.append(Case(f"sweep-d{D}", D, 2, 4, segs=segs, p8=fmt and bool(segs), f8=fmt))
        for dtype in (torch.float16, torch.float32):
            out.append(Case(f"sweep-d{D}", D, 2, 4, dtype=dtype))
        out.append(Case(f"sweep-d{D}", D, 2, 4, sinks=True, softcap=30.0, L_q=2))
    for n_rep in range(1, 9):
        out.append(Case("sweep-gqa", 128, 2, n_rep))
    for L_q in range(2, 9):
        out.append(Case("sweep-lq", 128, 2, 1, L_q=L_q))
        out.append(Case("sweep-lq-gqa4", 128, 2, 4, L_q=L_q))
    return out


def quantize_launches() -> list[tuple[str, str, object]]:
    """``(kernel, setting, Launch)`` of the quantize kernels: every head dim and code width from bf16, fp16 and
    fp32 states with their scale dtypes (prefill on 1000 tokens of 8 heads); values also in ``recommended()``'s
    groups of 64 (INT4 from bf16)."""
    out = []
    for D in (64, 128, 256):
        for bits in (2, 3, 4):
            for dtype, sd in ((torch.bfloat16, torch.float16), (torch.float16, torch.float16), (torch.float32, None)):
                x = torch.empty(8, 1000, D, dtype=dtype)
                tag = f"D{D} int{bits} {str(dtype).removeprefix('torch.')} scales {str(sd or dtype)[6:]}"
                out.append(("_quant_keys_kernel", tag, plan_quantize_keys(x, bits, CHUNK, sd)[0]))
                out.append(("_quant_values_kernel", tag, plan_quantize_values(x, bits, GROUP, sd)[0]))
        x = torch.empty(8, 1000, D, dtype=torch.bfloat16)
        tag = f"D{D} int4 bfloat16 scales float16 G{REC_GROUP}"
        out.append(("_quant_values_kernel", tag, plan_quantize_values(x, 4, REC_GROUP, torch.float16)[0]))
    return out
