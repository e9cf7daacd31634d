"""A KIVI-like quantized KV cache, the baseline that quantizes every token (not only the context).

Keys are quantized per channel in groups of 32 tokens, values per token in groups of 32 channels (the quantizer of
``hf_cocktail.storage.quant``, FP16 scales); the most recent tokens stay at full precision (keys: the ``len % R`` newest,
quantized R at a time as in KIVI's code; values: the R newest). Unlike Cocktail, the template, the question and the
generated tokens are quantized too once they leave the residual window, so this is not a CocktailCache precision
plan. Attention runs over the dequantized keys/values (simulated: no fused kernel).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_cocktail.storage import quant

from ..kv_bytes import deployed_tensor_bytes

KIVI_GROUP = 32


class KiviLayer(CacheLayerMixin):
    """One layer of :class:`KiviCache` (batch size 1 or more; every sequence has the same length)."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, bits: int, residual: int, group: int = KIVI_GROUP, scale_dtype=torch.float16):
        super().__init__()
        if residual % group:
            raise ValueError(f"KIVI residual length {residual} must be a multiple of the key group size {group}")
        self.bits, self.residual, self.group, self.scale_dtype = bits, residual, group, scale_dtype
        self.kq: list | None = None  # per sequence: (codes, scale, zero), keys of quantized tokens
        self.vq: list | None = None
        self.kf = self.vf = None  # full-precision residual (B, H, n, D)
        self.seq_len = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, _, D = key_states.shape
        empty_k = quant.quantize_pack_keys(key_states.new_zeros((H, 0, D)), self.bits, self.group, self.scale_dtype)
        empty_v = quant.quantize_pack_values(value_states.new_zeros((H, 0, D)), self.bits, self.group, self.scale_dtype)
        self.kq = [empty_k for _ in range(B)]
        self.vq = [empty_v for _ in range(B)]
        self.kf = key_states[:, :, :0]
        self.vf = value_states[:, :, :0]
        self.is_initialized = True

    @staticmethod
    def _cat3(a, b):
        return tuple(torch.cat([x, y], dim=1) for x, y in zip(a, b))

    def update(self, key_states, value_states, *args, **kwargs):
        first = not self.is_initialized
        if first:
            self.lazy_initialization(key_states, value_states)
        self.seq_len += key_states.shape[2]
        self.kf = torch.cat([self.kf, key_states], dim=2)
        self.vf = torch.cat([self.vf, value_states], dim=2)
        nk = (self.kf.shape[2] // self.residual) * self.residual  # keys: quantize whole residual blocks
        if nk:
            for b in range(self.kf.shape[0]):
                self.kq[b] = self._cat3(
                    self.kq[b], quant.quantize_pack_keys(self.kf[b, :, :nk], self.bits, self.group, self.scale_dtype)
                )
            self.kf = self.kf[:, :, nk:]
        nv = self.vf.shape[2] - self.residual  # values: keep the R newest at full precision
        if nv > 0:
            for b in range(self.vf.shape[0]):
                self.vq[b] = self._cat3(
                    self.vq[b], quant.quantize_pack_values(self.vf[b, :, :nv], self.bits, self.group, self.scale_dtype)
                )
            self.vf = self.vf[:, :, nv:]
        if first:  # the prefill attends at full precision, as in KIVI (quantization only affects later steps)
            return key_states, value_states
        return self.dequantized()

    def dequantized(self):
        ks = [quant.dequantize_keys(*self.kq[b], self.bits, self.group, self.dtype) for b in range(len(self.kq))]
        vs = [quant.dequantize_values(*self.vq[b], self.bits, self.group, self.dtype) for b in range(len(self.vq))]
        keys = torch.cat([torch.stack(ks), self.kf], dim=2)
        values = torch.cat([torch.stack(vs), self.vf], dim=2)
        return keys, values

    def get_mask_sizes(self, query_length: int):
        return self.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.kq = self.vq = self.kf = self.vf = None
        self.seq_len = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("KiviCache does not support beam search")

    def kv_nbytes(self, deployed: bool = True) -> int:
        """Deployed bytes: packed codes, FP16 scales/zeros, full-precision residual at 2 bytes/element
        (``deployed=False``: the bytes really held)."""
        if not self.is_initialized:
            return 0
        total = deployed_tensor_bytes(self.kf, deployed) + deployed_tensor_bytes(self.vf, deployed)
        for parts in (self.kq, self.vq):
            for triple in parts:
                total += sum(deployed_tensor_bytes(t, deployed) for t in triple)
        return total

    def quantized_tokens(self) -> tuple[int, int]:
        return self.seq_len - self.kf.shape[2], self.seq_len - self.vf.shape[2]


class KiviCache(Cache):
    """KIVI-like quantized KV cache (simulated: the quantized part is dequantized at each step for attention)."""

    def __init__(
        self, num_layers: int, bits: int = 2, residual: int = 128, group: int = KIVI_GROUP, scale_dtype=torch.float16
    ):
        if bits not in (2, 4):
            raise ValueError(f"KiviCache bits must be 2 or 4, got {bits}")
        super().__init__(layers=[KiviLayer(bits, residual, group, scale_dtype) for _ in range(num_layers)])

    def kv_nbytes(self, deployed: bool = True) -> int:
        return sum(layer.kv_nbytes(deployed) for layer in self.layers)
