// 8-bit scales and zeros -> numbers on CPU, bit for bit hf_cocktail.storage.params8.decode_params8 (declared in
// quantize.h, registered by split_attention.cpp's module; the launcher is cpu_ops/quantize.py's decode_params8).
// Compiled without floating-point contraction, as quantize.cpp: the reference computes a product, then a sum.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

#include "float_types.h"
#include "quantize.h"

// After the headers, so only this file's functions are affected.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace cpu_ops_quant {
namespace {

// Row r of head h (K parameters) uses its block row: scale = s_max * table[sc], zero = z_lo + zc * z_step, in fp32
// as the reference (a product, then a sum: no contraction, the file's pragmas).
template <typename S>
void decode8_impl(const uint8_t* sc, const uint8_t* zc, const S* block, const int64_t* block_of_row,
                  const float* table, int64_t H, int64_t R, int64_t K, int64_t M, float* out_s, float* out_z) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(K, 1));
  at::parallel_for(0, H * R, grain, [&](int64_t begin, int64_t end) {
    int64_t row = begin;
    while (row < end) {  // the rows of one head at a time; a block's numbers are read once for its run of rows
      const int64_t h = row / R, stop = std::min(end, (h + 1) * R);
      int64_t last = -1;
      float s_max = 0.f, z_lo = 0.f, z_step = 0.f;
      for (int64_t r = row - h * R; row < stop; ++row, ++r) {
        const int64_t bi = block_of_row ? block_of_row[r] : r;
        if (bi != last) {
          TORCH_CHECK_INDEX(bi >= 0 && bi < M, "cpu_ops decode_params8: block_of_row holds ", bi, ", not in [0, ", M, ")");
          const S* b = block + (h * M + bi) * 3;
          s_max = static_cast<float>(b[0]), z_lo = static_cast<float>(b[1]), z_step = static_cast<float>(b[2]);
          last = bi;
        }
        const uint8_t* s_row = sc + row * K;
        const uint8_t* z_row = zc + row * K;
        float* os = out_s + row * K;
        float* oz = out_z + row * K;
        for (int64_t k = 0; k < K; ++k) {
          os[k] = s_max * table[s_row[k]];
          const float step = static_cast<float>(z_row[k]) * z_step;
          oz[k] = z_lo + step;
        }
      }
    }
  });
}

}  // namespace

void decode_params8(const at::Tensor& scale_codes, const at::Tensor& zero_codes, const at::Tensor& block,
                    const at::Tensor& block_of_row, const at::Tensor& table, const at::Tensor& out_scale,
                    const at::Tensor& out_zero) {
  TORCH_CHECK_VALUE(scale_codes.dim() == 3 && block.dim() == 3 && block.size(2) == 3,
                    "cpu_ops decode_params8: codes must be (H, R, K) and block (H, M, 3)");
  const int64_t H = scale_codes.size(0), R = scale_codes.size(1), K = scale_codes.size(2), M = block.size(1);
  for (const at::Tensor* t : {&scale_codes, &zero_codes, &block, &table, &out_scale, &out_zero})
    TORCH_CHECK_VALUE(t->is_contiguous() && t->device().is_cpu(), "cpu_ops decode_params8: contiguous CPU tensors");
  TORCH_CHECK_VALUE(zero_codes.sizes() == scale_codes.sizes() && out_scale.sizes() == scale_codes.sizes() &&
                        out_zero.sizes() == scale_codes.sizes() && block.size(0) == H,
                    "cpu_ops decode_params8: shapes disagree");
  TORCH_CHECK_VALUE(scale_codes.scalar_type() == at::kByte && zero_codes.scalar_type() == at::kByte &&
                        table.scalar_type() == at::kFloat && table.numel() == 256,
                    "cpu_ops decode_params8: uint8 codes and a float32 table of 256 entries");
  TORCH_CHECK_VALUE(out_scale.scalar_type() == at::kFloat && out_zero.scalar_type() == at::kFloat,
                    "cpu_ops decode_params8: the outputs must be float32");
  const int64_t* rows = nullptr;
  if (block_of_row.numel()) {
    TORCH_CHECK_VALUE(block_of_row.scalar_type() == at::kLong && block_of_row.is_contiguous() &&
                          block_of_row.numel() == R,
                      "cpu_ops decode_params8: block_of_row must be a contiguous int64 tensor of R entries");
    rows = block_of_row.const_data_ptr<int64_t>();
  } else {
    TORCH_CHECK_VALUE(M == R, "cpu_ops decode_params8: without block_of_row, block needs one row per code row");
  }
  if (H * R * K == 0) return;
  with_float_type(block.scalar_type(), "block", [&](auto ts) {
    using S = typename decltype(ts)::type;
    decode8_impl<S>(scale_codes.const_data_ptr<uint8_t>(), zero_codes.const_data_ptr<uint8_t>(),
                    static_cast<const S*>(block.const_data_ptr()), rows, table.const_data_ptr<float>(), H, R, K, M,
                    out_scale.mutable_data_ptr<float>(), out_zero.mutable_data_ptr<float>());
    return int64_t{0};
  });
}

}  // namespace cpu_ops_quant
