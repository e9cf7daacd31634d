// What the fused CPU quantizers (quantize.cpp), the 8-bit scales' decoder (params8.cpp) and the 8-bit full part's append
// (tokens8.cpp) share: dispatch on a float32 / bfloat16 / float16 tensor's C++ type and the parallel grain.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace cpu_ops_quant {

constexpr int64_t kGrainElements = 1 << 15;  // input elements per parallel work share (at least)

template <typename T>
struct Tag {
  using type = T;
};

// f(Tag<T>{}) with T the C++ type of a float32 / bfloat16 / float16 tensor.
template <typename F>
int64_t with_float_type(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: return f(Tag<float>{});
    case at::kBFloat16: return f(Tag<c10::BFloat16>{});
    case at::kHalf: return f(Tag<c10::Half>{});
    default: TORCH_CHECK_VALUE(false, "cpu_ops quantizer: ", what, " must be float32, bfloat16 or float16, got ", t);
  }
  return 0;
}

}  // namespace cpu_ops_quant
