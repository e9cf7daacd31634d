// The fused CPU quantizers (quantize.cpp) and the 8-bit scales' decoder (params8.cpp), registered by
// split_attention.cpp's module. Shapes and the storage format are those of hf_cocktail.quant (see cpu_ops/quantize.py,
// the launchers that check the arguments and allocate the outputs). The quantizers return a status: 0 done, bit 1 an
// input is NaN or inf, bit 2 a scale or zero overflows its dtype (outputs are then incomplete; the launcher raises).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace cpu_ops_quant {

constexpr int64_t kNonFinite = 1;
constexpr int64_t kOverflow = 2;

// k (H, N, D) contiguous -> codes uint8 (H, N, D * bits / 8), scale / zero (H, ceil(N / chunk_size), D).
int64_t quantize_keys(const at::Tensor& k, int64_t bits, int64_t chunk_size, const at::Tensor& codes,
                      const at::Tensor& scale, const at::Tensor& zero);

// v (H, N, D) contiguous -> codes uint8 (H, N, D * bits / 8), scale / zero (H, N, D / group_size).
int64_t quantize_values(const at::Tensor& v, int64_t bits, int64_t group_size, const at::Tensor& codes,
                        const at::Tensor& scale, const at::Tensor& zero);

// 8-bit scales and zeros -> numbers (hf_cocktail.params8.decode_params8): scale_codes / zero_codes uint8 (H, R, K),
// block (H, M, 3) float32 / bfloat16 / float16, block_of_row int64 (R,) or empty (M == R), table float32 (256,);
// out_scale / out_zero float32 (H, R, K).
void decode_params8(const at::Tensor& scale_codes, const at::Tensor& zero_codes, const at::Tensor& block,
                    const at::Tensor& block_of_row, const at::Tensor& table, const at::Tensor& out_scale,
                    const at::Tensor& out_zero);

// New tokens of an 8-bit full part (tokens8.cpp): k, v (B, H, L, D) float32 / bfloat16 / float16, last dim
// contiguous -> int8 codes into k_codes / v_codes (B, H, capacity, D) and scales into k_scales / v_scales (B, H,
// capacity, 1) float32 / bfloat16 / float16, at token positions [pos, pos + L) (hf_cocktail.quant.quantize_tokens8).
// rot_k, rot_v: rotated storage, (H_kv, D, D) fp32 matrices the keys / values are first rotated by (as
// hf_cocktail.storage.rotation.Rotation.rotate_pair), or empty tensors (stored unrotated). Returns the views of the
// four buffers' first pos + L tokens (key codes, value codes, key scales, value scales).
std::vector<at::Tensor> append_tokens8(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_codes, const at::Tensor& v_codes,
                    const at::Tensor& k_scales, const at::Tensor& v_scales, int64_t pos, const at::Tensor& rot_k,
                    const at::Tensor& rot_v);

// New tokens of a full part at the model's precision (tokens8.cpp): k, v (B, H, L, D) float32 / bfloat16 / float16,
// last dim contiguous, rotated by rot_k / rot_v as in append_tokens8 (or not: empty tensors), copied into k_buf / v_buf
// (B, H, capacity, D), float, at token positions [pos, pos + L). Returns the views of the two buffers' first pos + L
// tokens (keys, values).
std::vector<at::Tensor> append_tokens(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_buf,
                                      const at::Tensor& v_buf, int64_t pos, const at::Tensor& rot_k,
                                      const at::Tensor& rot_v);

}  // namespace cpu_ops_quant
