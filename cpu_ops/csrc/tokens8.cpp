// Fused appends of new tokens to a full part. append_tokens8: to an 8-bit full part
// (hf_cocktail.storage.full_part.Int8FullPart): per token and head, quantize_tokens8 of hf_cocktail.storage.quant
// (scale = max |x| / 127 rounded to the scale dtype, code = clamp(round(x / scale), -127, 127)) written straight into
// the part's preallocated buffers, in one call for the keys and the values, instead of the reference's ~35 small
// tensor operations per layer and step.
//
// The arithmetic is the reference's, operation by operation in fp32: amax = max |x| (NaN propagates), scale = amax /
// 127 rounded to the scale dtype (round to nearest even, as torch's .to()), s32 the scale back in fp32, inv = s32 > 0
// ? 1 / s32 : 0, code = clamp(nearbyint(x * inv), -127, 127) (round half to even, as torch.round). Compiled without
// floating-point contraction (the pragma below). Unchecked, as the reference's append: a NaN input gives a NaN scale
// (its codes are then 0), which the attention output shows.
//
// Rotated storage (optional key / value matrices): the new tokens are first rotated as
// hf_cocktail.storage.rotation.Rotation.rotate_pair does it: the keys and values concatenated along the tokens where
// both share one matrix tensor (else one side at a time), in fp32, times the matrices by the batched product (at::bmm)
// that at::matmul runs for these shapes, then back to the input dtype; so the rotated tokens, hence the codes and
// scales, are bit for bit the reference's (tests/test_full_part_writer*.py compare them).
//
// append_tokens: to a full part at the model's precision (hf_cocktail.storage.full_part.FullPart), rotated as above
// where the storage is rotated, then copied into the part's preallocated buffers (the bytes of FullPart.append's two
// narrow(...).copy_ calls; copy_ itself where the buffers' dtype differs), in one call instead of about a dozen
// Python-level tensor operations per layer and decode step.
#include "float_types.h"
#include "quantize.h"

#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace cpu_ops_quant {
namespace {

// One vector of D inputs (type X) -> D int8 codes and one scale (type S).
template <typename X, typename S>
void quantize_token8(const X* x, int64_t D, int8_t* codes, S* scale) {
  float amax = 0.0f;
  bool nan = false;
  for (int64_t d = 0; d < D; ++d) {
    const float a = std::fabs(static_cast<float>(x[d]));
    nan = nan || std::isnan(a);
    amax = a > amax ? a : amax;
  }
  const S s = static_cast<S>(nan ? NAN : amax / 127.0f);
  *scale = s;
  const float s32 = static_cast<float>(s);
  const float inv = s32 > 0.0f ? 1.0f / s32 : 0.0f;
  for (int64_t d = 0; d < D; ++d) {
    float y = std::nearbyint(static_cast<float>(x[d]) * inv);
    y = y > -127.0f ? y : -127.0f;
    y = y < 127.0f ? y : 127.0f;
    codes[d] = std::isnan(static_cast<float>(x[d]) * inv) ? 0 : static_cast<int8_t>(y);
  }
}

template <typename X, typename S>
void append_one(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t pos) {
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), D = x.size(3);
  const X* xp = x.data_ptr<X>();
  int8_t* cp = codes.data_ptr<int8_t>();
  S* sp = scales.data_ptr<S>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < L; ++t)
        quantize_token8<X, S>(xp + b * x.stride(0) + h * x.stride(1) + t * x.stride(2), D,
                              cp + b * codes.stride(0) + h * codes.stride(1) + (pos + t) * codes.stride(2),
                              sp + b * scales.stride(0) + h * scales.stride(1) + (pos + t) * scales.stride(2));
}

void append_tensor(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t pos) {
  with_float_type(x.scalar_type(), "append_tokens8's k / v", [&](auto x_tag) {
    return with_float_type(scales.scalar_type(), "append_tokens8's scales", [&](auto s_tag) {
      append_one<typename decltype(x_tag)::type, typename decltype(s_tag)::type>(x, codes, scales, pos);
      return int64_t{0};
    });
  });
}

// The checks of cpu_ops.append_tokens8 (here, not in Python: the call runs once per layer and decode step).
void check_buffer(const at::Tensor& t, const char* name, const at::Tensor& k, int64_t last, int64_t pos,
                  const char* fn = "append_tokens8") {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.dim() == 4 && t.size(0) == k.size(0) && t.size(1) == k.size(1) &&
                        t.size(3) == last && t.stride(3) == 1,
                    fn, ": ", name, " must be a CPU tensor of shape (B, H_kv, capacity, ", last,
                    ") = (", k.size(0), ", ", k.size(1), ", capacity, ", last, ") with a contiguous last dim, got ",
                    t.sizes(), " strides ", t.strides(), " on ", t.device());
  TORCH_CHECK_VALUE(t.size(2) >= pos + k.size(2), fn, ": ", name, " has room for ", t.size(2),
                    " tokens, tokens [", pos, ", ", pos + k.size(2), ") were to be written");
}

void check_tokens(const at::Tensor& k, const at::Tensor& v, const char* fn = "append_tokens8") {
  for (const auto& [t, name] : {std::pair{&k, "k"}, std::pair{&v, "v"}})
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->dim() == 4 && t->stride(3) == 1, fn, ": ", name,
                      " must be a (B, H_kv, L, D) CPU tensor with a contiguous last dim, got ", t->sizes(),
                      " strides ", t->strides(), " on ", t->device());
  TORCH_CHECK_VALUE(k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(),
                    fn, ": v must match k, got k ", k.scalar_type(), " ", k.sizes(), " and v ",
                    v.scalar_type(), " ", v.sizes());
}

void check_rotation(const at::Tensor& m, const char* name, const at::Tensor& x, const char* fn = "append_tokens8") {
  if (!m.numel()) return;
  TORCH_CHECK_VALUE(m.device().is_cpu() && m.scalar_type() == at::kFloat && m.dim() == 3 && m.size(0) >= 1 &&
                        x.size(1) % m.size(0) == 0 && m.size(1) == x.size(3) && m.size(2) == x.size(3),
                    fn, ": ", name, " must be a float32 CPU tensor (H_kv, D, D) with H_kv dividing the ",
                    "tokens' heads ", x.size(1), " and D = ", x.size(3), ", got ", m.scalar_type(), " ", m.sizes(),
                    " on ", m.device());
}

// The fp32 rows of x (B, H, T, D) (any float dtype, unit last stride) into dst from token offset t0 of a contiguous
// (B, H, T_dst, D) fp32 buffer: what torch.cat along the tokens then .to(float32) produce, element by element.
void rows_to_float(const at::Tensor& x, float* dst, int64_t T_dst, int64_t t0) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  with_float_type(x.scalar_type(), "the new tokens", [&](auto tag) {
    using X = typename decltype(tag)::type;
    const X* xp = x.data_ptr<X>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < T; ++t) {
          const X* src = xp + b * x.stride(0) + h * x.stride(1) + t * x.stride(2);
          float* out = dst + ((b * H + h) * T_dst + t0 + t) * D;
          for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(src[d]);
        }
    return int64_t{0};
  });
}

// Rotation._apply(x, m) for x (B, H, T, D) whose fp32 rows are xf (B, H, T, D) contiguous: (B, H_kv, H / H_kv * T, D)
// times m (H_kv, D, D), back to `dtype`. The batched product at::matmul runs for these shapes (m broadcast over B),
// called as such: the same bmm on the same operands, so the same bits, without matmul's shape handling per call.
at::Tensor rotated_rows(const at::Tensor& xf, const at::Tensor& m, at::ScalarType dtype) {
  const int64_t B = xf.size(0), H = xf.size(1), T = xf.size(2), D = xf.size(3), H_kv = m.size(0);
  const at::Tensor mats = B == 1 ? m : m.expand({B, H_kv, D, D}).reshape({B * H_kv, D, D});
  const at::Tensor y = at::bmm(xf.view({B * H_kv, H / H_kv * T, D}), mats).view({B, H, T, D});
  return dtype == at::kFloat ? y : y.to(dtype);
}

at::Tensor rotated(const at::Tensor& x, const at::Tensor& m) {
  at::Tensor xf = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  rows_to_float(x, xf.data_ptr<float>(), x.size(2), 0);
  return rotated_rows(xf, m, x.scalar_type());
}

// Rotation.rotate_pair(k, v): both in one product where keys and values share their matrices (the same tensor), as
// there over the keys and values concatenated along the tokens.
std::pair<at::Tensor, at::Tensor> rotated_pair(const at::Tensor& k, const at::Tensor& v, const at::Tensor& rot_k,
                                               const at::Tensor& rot_v) {
  if (rot_k.numel() && rot_k.is_same(rot_v) && k.sizes() == v.sizes()) {
    const int64_t B = k.size(0), H = k.size(1), L = k.size(2), D = k.size(3);
    at::Tensor kv = at::empty({B, H, 2 * L, D}, k.options().dtype(at::kFloat));
    rows_to_float(k, kv.data_ptr<float>(), 2 * L, 0);
    rows_to_float(v, kv.data_ptr<float>(), 2 * L, L);
    const at::Tensor y = rotated_rows(kv, rot_k, k.scalar_type());
    return {y.narrow(2, 0, L), y.narrow(2, L, L)};
  }
  return {rot_k.numel() ? rotated(k, rot_k) : k, rot_v.numel() ? rotated(v, rot_v) : v};
}

// buf[:, :, pos : pos + L] = x (B, H, L, D), unit last strides: row by row where the dtypes are the same (the bytes
// Tensor.copy_ writes), else with copy_ itself (its casts).
void copy_rows(const at::Tensor& x, const at::Tensor& buf, int64_t pos) {
  if (x.scalar_type() != buf.scalar_type()) {
    buf.narrow(2, pos, x.size(2)).copy_(x);
    return;
  }
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), row = x.size(3) * x.element_size();
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(buf.data_ptr());
  const int64_t es = x.element_size();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < L; ++t)
        std::memcpy(dst + (b * buf.stride(0) + h * buf.stride(1) + (pos + t) * buf.stride(2)) * es,
                    src + (b * x.stride(0) + h * x.stride(1) + t * x.stride(2)) * es, row);
}

}  // namespace

std::vector<at::Tensor> append_tokens8(const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& k_codes,
                                       const at::Tensor& v_codes, const at::Tensor& k_scales,
                                       const at::Tensor& v_scales, int64_t pos, const at::Tensor& rot_k,
                                       const at::Tensor& rot_v) {
  TORCH_CHECK_VALUE(pos >= 0, "append_tokens8: pos must be >= 0, got ", pos);
  check_tokens(k_in, v_in);
  check_rotation(rot_k, "rotation[0] (the key matrices)", k_in);
  check_rotation(rot_v, "rotation[1] (the value matrices)", v_in);
  const auto [k, v] = rotated_pair(k_in, v_in, rot_k, rot_v);
  for (const auto& [c, name] : {std::pair{&k_codes, "codes[0] (the key codes)"},
                                 std::pair{&v_codes, "codes[1] (the value codes)"}}) {
    TORCH_CHECK_VALUE(c->scalar_type() == at::kChar, "append_tokens8: ", name, " must be int8, got ",
                      c->scalar_type());
    check_buffer(*c, name, k, k.size(3), pos);
  }
  TORCH_CHECK_VALUE(k_scales.scalar_type() == v_scales.scalar_type(),
                    "append_tokens8: scales[0] and scales[1] (key and value scales) must have one dtype, got ",
                    k_scales.scalar_type(),
                    " and ", v_scales.scalar_type());
  check_buffer(k_scales, "scales[0] (the key scales)", k, 1, pos);
  check_buffer(v_scales, "scales[1] (the value scales)", k, 1, pos);
  append_tensor(k, k_codes, k_scales, pos);
  append_tensor(v, v_codes, v_scales, pos);
  // what the part holds now: the buffers' first pos + L tokens (views made here, not by four Python narrow calls)
  const int64_t end = pos + k.size(2);
  return {k_codes.narrow(2, 0, end), v_codes.narrow(2, 0, end), k_scales.narrow(2, 0, end),
          v_scales.narrow(2, 0, end)};
}

std::vector<at::Tensor> append_tokens(const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& k_buf,
                                      const at::Tensor& v_buf, int64_t pos, const at::Tensor& rot_k,
                                      const at::Tensor& rot_v) {
  constexpr const char* fn = "append_tokens";
  TORCH_CHECK_VALUE(pos >= 0, fn, ": pos must be >= 0, got ", pos);
  check_tokens(k_in, v_in, fn);
  check_rotation(rot_k, "rotation[0] (the key matrices)", k_in, fn);
  check_rotation(rot_v, "rotation[1] (the value matrices)", v_in, fn);
  for (const auto& [b, name] : {std::pair{&k_buf, "buffers[0] (the key buffer)"},
                                 std::pair{&v_buf, "buffers[1] (the value buffer)"}}) {
    TORCH_CHECK_VALUE(at::isFloatingType(b->scalar_type()), fn, ": ", name, " must be a float tensor, got ",
                      b->scalar_type());
    check_buffer(*b, name, k_in, k_in.size(3), pos, fn);
  }
  const auto [k, v] = rotated_pair(k_in, v_in, rot_k, rot_v);
  const int64_t L = k.size(2), end = pos + L;
  copy_rows(k, k_buf, pos);  // FullPart.append's copies
  copy_rows(v, v_buf, pos);
  return {k_buf.narrow(2, 0, end), v_buf.narrow(2, 0, end)};
}

}  // namespace cpu_ops_quant
