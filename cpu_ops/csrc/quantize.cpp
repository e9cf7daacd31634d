// Fused CPU group quantization and bit packing, bit for bit the PyTorch reference hf_cocktail/quant.py (the spec of
// the storage format): per group one pass for min / max (and a finiteness check), then one pass for the codes, packed
// as they are made (INT4, INT3 as two bit planes, INT2), instead of the reference's ~10 tensor passes (float copy, amin, amax, isfinite checks, codes,
// int32 packing). Keys are grouped per channel within a chunk of C tokens (a work item: one chunk of one head),
// values per token in groups of G channels (a work item: one token of one head); items run on ATen's thread pool.
//
// The arithmetic is the reference's, operation by operation in fp32: scale = (max - min) / qmax and zero = min,
// each rounded to the scale dtype (c10::Half / c10::BFloat16: round to nearest even, as torch's .to()); then with
// s32, z32 those values in fp32, inv = s32 > 0 ? 1 / s32 : 0 and code = clamp(floor((x - z32) * inv + 0.5), 0, qmax).
// So this file is compiled without floating-point contraction (no fused multiply-add; see the pragmas below) and
// without -ffast-math (never reordered); the baseline target has no FMA instruction anyway.
//
// The Python launchers (cpu_ops/quantize.py) check the arguments and allocate the outputs; a status bit reports
// non-finite inputs or scales / zeros that overflow their dtype, and the launcher raises the reference's errors.
#include "quantize.h"

#include "float_types.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// After the headers, so only this file's functions are affected.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace cpu_ops_quant {
namespace {

// n inputs as fp32: the input itself for float32, else converted (exactly) into buf.
template <typename T>
inline const float* as_floats(const T* src, int64_t n, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

// Scale and zero of a group with minimum mn and maximum mx, stored in S; z32 and inv as the codes need them.
// Returns false when the scale or the zero is not finite in S (the reference's overflow error).
template <typename S, int BITS>
inline bool scale_zero(float mn, float mx, S* scale, S* zero, float& z32, float& inv) {
  constexpr float kQmax = static_cast<float>((1 << BITS) - 1);
  const float range = mx - mn;
  const S s = static_cast<S>(range / kQmax);
  const S z = static_cast<S>(mn);
  *scale = s;
  *zero = z;
  const float s32 = static_cast<float>(s);
  z32 = static_cast<float>(z);
  inv = s32 > 0.0f ? 1.0f / s32 : 0.0f;
  return std::isfinite(s32) && std::isfinite(z32);
}

// clamp(floor((x - z) * inv + 0.5), 0, qmax) as uint8. Clamping first and truncating then is the same for every y
// (floor = truncation on [0, qmax]); a NaN y (0 * inf: a scale so small that 1 / scale overflows) gives 0, as
// torch's clamp (NaN stays NaN) followed by .to(torch.uint8) does.
template <int BITS>
inline uint8_t code_of(float x, float z, float inv) {
  constexpr float kQmax = static_cast<float>((1 << BITS) - 1);
  const float d = x - z;
  const float p = d * inv;
  float y = p + 0.5f;
  y = y > 0.0f ? y : 0.0f;
  y = y < kQmax ? y : kQmax;
  return static_cast<uint8_t>(static_cast<int32_t>(y));
}

// D codes (one per byte) -> D * BITS / 8 bytes. INT4 / INT2: channel d at bit offset (d % PER) * BITS of byte d / PER
// (PER = 8 / BITS). INT3: two bit planes, the low two bits of every channel packed as INT2 (D / 4 bytes), then the
// high bit of every channel, channel d in byte D / 4 + d / 8 at bit d % 8 (D a multiple of 8).
template <int BITS>
inline void pack(const uint8_t* __restrict q, int64_t D, uint8_t* __restrict out) {
  if constexpr (BITS == 3) {
    for (int64_t j = 0; j < D / 4; ++j) {
      uint32_t b = 0;
      for (int i = 0; i < 4; ++i) b |= static_cast<uint32_t>(q[j * 4 + i] & 3) << (i * 2);
      out[j] = static_cast<uint8_t>(b);
    }
    for (int64_t j = 0; j < D / 8; ++j) {
      uint32_t b = 0;
      for (int i = 0; i < 8; ++i) b |= static_cast<uint32_t>(q[j * 8 + i] >> 2) << i;
      out[D / 4 + j] = static_cast<uint8_t>(b);
    }
  } else {
    constexpr int PER = 8 / BITS;
    for (int64_t j = 0; j < D / PER; ++j) {
      uint32_t b = 0;
      for (int i = 0; i < PER; ++i) b |= static_cast<uint32_t>(q[j * PER + i]) << (i * BITS);
      out[j] = static_cast<uint8_t>(b);
    }
  }
}

// Codes of n inputs whose zero / inverse scale are per input (keys: per channel) or one for all (values: a group).
// (Pointers are restrict and n a parameter: a uint8_t store may alias anything, which would otherwise keep the
// compiler from vectorizing.)
template <int BITS>
inline void encode(const float* __restrict x, const float* __restrict z, const float* __restrict inv, int64_t n,
                   uint8_t* __restrict q) {
  for (int64_t i = 0; i < n; ++i) q[i] = code_of<BITS>(x[i], z[i], inv[i]);
}
template <int BITS>
inline void encode(const float* __restrict x, float z, float inv, int64_t n, uint8_t* __restrict q) {
  for (int64_t i = 0; i < n; ++i) q[i] = code_of<BITS>(x[i], z, inv);
}

// Min, max and a finiteness sentinel (sum of x * 0: 0 for finite inputs, NaN as soon as one is NaN or inf) of n
// contiguous inputs; 8 interleaved lanes when n allows (min / max are exact in any order).
inline void group_stats(const float* x, int64_t n, float& mn, float& mx, float& nf) {
  if (n % 8 == 0) {
    typedef float v4f __attribute__((vector_size(16)));  // an SSE / NEON register
    v4f a[2], b[2], c[2];
    for (int u = 0; u < 2; ++u) {
      std::memcpy(&a[u], x + 4 * u, sizeof(v4f));
      b[u] = a[u];
      c[u] = a[u] * 0.0f;
    }
    for (int64_t j = 8; j < n; j += 8)
      for (int u = 0; u < 2; ++u) {
        v4f v;
        std::memcpy(&v, x + j + 4 * u, sizeof(v));
        a[u] = v < a[u] ? v : a[u];
        b[u] = v > b[u] ? v : b[u];
        c[u] = c[u] + v * 0.0f;
      }
    mn = a[0][0], mx = b[0][0], nf = c[0][0];
    for (int l = 1; l < 8; ++l) {
      const float al = a[l / 4][l % 4], bl = b[l / 4][l % 4];
      mn = al < mn ? al : mn;
      mx = bl > mx ? bl : mx;
      nf = nf + c[l / 4][l % 4];
    }
    return;
  }
  mn = mx = x[0], nf = x[0] * 0.0f;
  for (int64_t j = 1; j < n; ++j) {
    const float v = x[j];
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
    nf = nf + v * 0.0f;
  }
}

template <typename T, typename S, int BITS>
int64_t keys_impl(const T* k, int64_t H, int64_t N, int64_t D, int64_t C, uint8_t* codes, S* scale, S* zero) {
  const int64_t M = (N + C - 1) / C, Dp = D * BITS / 8;
  std::atomic<int64_t> status{0};
  at::parallel_for(0, H * M, std::max<int64_t>(1, kGrainElements / (C * D)), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(std::is_same_v<T, float> ? 0 : C * D), mn(D), mx(D), nf(D), z(D), inv(D);
    std::vector<uint8_t> q(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / M, m = item % M, t0 = m * C, rows = std::min(C, N - t0);
      const float* x = as_floats(k + (h * N + t0) * D, rows * D, buf.data());
      for (int64_t d = 0; d < D; ++d) mn[d] = mx[d] = x[d], nf[d] = x[d] * 0.0f;
      for (int64_t r = 1; r < rows; ++r) {
        const float* xr = x + r * D;
        for (int64_t d = 0; d < D; ++d) {
          const float v = xr[d];
          mn[d] = v < mn[d] ? v : mn[d];
          mx[d] = v > mx[d] ? v : mx[d];
          nf[d] = nf[d] + v * 0.0f;
        }
      }
      bool finite = true;
      for (int64_t d = 0; d < D; ++d) finite &= nf[d] == 0.0f;  // NaN compares unequal
      if (!finite) {
        status.fetch_or(kNonFinite, std::memory_order_relaxed);
        continue;
      }
      S* s_out = scale + (h * M + m) * D;
      S* z_out = zero + (h * M + m) * D;
      bool ok = true;
      for (int64_t d = 0; d < D; ++d) ok &= scale_zero<S, BITS>(mn[d], mx[d], s_out + d, z_out + d, z[d], inv[d]);
      if (!ok) {
        status.fetch_or(kOverflow, std::memory_order_relaxed);
        continue;
      }
      uint8_t* out = codes + (h * N + t0) * Dp;
      for (int64_t r = 0; r < rows; ++r) {
        encode<BITS>(x + r * D, z.data(), inv.data(), D, q.data());
        pack<BITS>(q.data(), D, out + r * Dp);
      }
    }
  });
  return status.load();
}

template <typename T, typename S, int BITS>
int64_t values_impl(const T* v, int64_t rows_total, int64_t D, int64_t G, uint8_t* codes, S* scale, S* zero) {
  const int64_t NG = D / G, Dp = D * BITS / 8;
  std::atomic<int64_t> status{0};
  at::parallel_for(0, rows_total, std::max<int64_t>(1, kGrainElements / D), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(std::is_same_v<T, float> ? 0 : D);
    std::vector<uint8_t> q(D);
    for (int64_t row = begin; row < end; ++row) {
      const float* x = as_floats(v + row * D, D, buf.data());
      S* s_out = scale + row * NG;
      S* z_out = zero + row * NG;
      int64_t bad = 0;
      for (int64_t g = 0; g < NG && !(bad & kNonFinite); ++g) {
        const float* xg = x + g * G;
        float mn, mx, nf, z, inv;
        group_stats(xg, G, mn, mx, nf);
        if (!(nf == 0.0f)) {
          bad |= kNonFinite;
        } else if (!scale_zero<S, BITS>(mn, mx, s_out + g, z_out + g, z, inv)) {
          bad |= kOverflow;
        } else {
          encode<BITS>(xg, z, inv, G, q.data() + g * G);
        }
      }
      if (bad) {
        status.fetch_or(bad, std::memory_order_relaxed);
        continue;
      }
      pack<BITS>(q.data(), D, codes + row * Dp);
    }
  });
  return status.load();
}

void check_args(const at::Tensor& x, int64_t bits, int64_t group, const at::Tensor& codes, const at::Tensor& scale,
                const at::Tensor& zero, int64_t groups_dim1, int64_t groups_dim2) {
  TORCH_CHECK_VALUE(bits >= 2 && bits <= 4, "cpu_ops quantizer: bits must be 2, 3 or 4, got ", bits);
  TORCH_CHECK_VALUE(x.dim() == 3 && x.is_contiguous(), "cpu_ops quantizer: the input must be a contiguous 3-d tensor");
  TORCH_CHECK_VALUE(group >= 1, "cpu_ops quantizer: the group size must be >= 1, got ", group);
  const int64_t H = x.size(0), N = x.size(1), D = x.size(2);
  const int64_t per = bits == 3 ? 8 : 8 / bits;
  TORCH_CHECK_VALUE(D % per == 0, "cpu_ops quantizer: D=", D, " is not a multiple of ", per);
  TORCH_CHECK_VALUE(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                        codes.sizes() == at::IntArrayRef({H, N, D * bits / 8}),
                    "cpu_ops quantizer: codes must be a contiguous uint8 tensor of shape (", H, ", ", N, ", ",
                    D * bits / 8, ")");
  for (const at::Tensor* t : {&scale, &zero})
    TORCH_CHECK_VALUE(t->scalar_type() == scale.scalar_type() && t->is_contiguous() &&
                          t->sizes() == at::IntArrayRef({H, groups_dim1, groups_dim2}),
                      "cpu_ops quantizer: scale and zero must be contiguous tensors of one dtype and of shape (", H,
                      ", ", groups_dim1, ", ", groups_dim2, ")");
}

}  // namespace

int64_t quantize_keys(const at::Tensor& k, int64_t bits, int64_t chunk_size, const at::Tensor& codes,
                      const at::Tensor& scale, const at::Tensor& zero) {
  TORCH_CHECK_VALUE(chunk_size >= 1, "cpu_ops quantizer: chunk_size must be >= 1, got ", chunk_size);
  const int64_t H = k.dim() == 3 ? k.size(0) : 0, N = k.dim() == 3 ? k.size(1) : 0, D = k.dim() == 3 ? k.size(2) : 0;
  check_args(k, bits, chunk_size, codes, scale, zero, (N + chunk_size - 1) / chunk_size, D);
  if (H * N * D == 0) return 0;
  return with_float_type(k.scalar_type(), "keys", [&](auto tin) {
    using T = typename decltype(tin)::type;
    return with_float_type(scale.scalar_type(), "scale_dtype", [&](auto ts) {
      using S = typename decltype(ts)::type;
      const T* src = static_cast<const T*>(k.const_data_ptr());
      uint8_t* c = codes.mutable_data_ptr<uint8_t>();
      S* s = static_cast<S*>(scale.mutable_data_ptr());
      S* z = static_cast<S*>(zero.mutable_data_ptr());
      switch (bits) {
        case 4: return keys_impl<T, S, 4>(src, H, N, D, chunk_size, c, s, z);
        case 3: return keys_impl<T, S, 3>(src, H, N, D, chunk_size, c, s, z);
        default: return keys_impl<T, S, 2>(src, H, N, D, chunk_size, c, s, z);
      }
    });
  });
}

int64_t quantize_values(const at::Tensor& v, int64_t bits, int64_t group_size, const at::Tensor& codes,
                        const at::Tensor& scale, const at::Tensor& zero) {
  TORCH_CHECK_VALUE(group_size >= 1 && v.dim() == 3 && v.size(2) % group_size == 0,
                    "cpu_ops quantizer: group_size must divide the head dim, got ", group_size);
  const int64_t H = v.size(0), N = v.size(1), D = v.size(2);
  check_args(v, bits, group_size, codes, scale, zero, N, D / group_size);
  if (H * N * D == 0) return 0;
  return with_float_type(v.scalar_type(), "values", [&](auto tin) {
    using T = typename decltype(tin)::type;
    return with_float_type(scale.scalar_type(), "scale_dtype", [&](auto ts) {
      using S = typename decltype(ts)::type;
      const T* src = static_cast<const T*>(v.const_data_ptr());
      uint8_t* c = codes.mutable_data_ptr<uint8_t>();
      S* s = static_cast<S*>(scale.mutable_data_ptr());
      S* z = static_cast<S*>(zero.mutable_data_ptr());
      switch (bits) {
        case 4: return values_impl<T, S, 4>(src, H * N, D, group_size, c, s, z);
        case 3: return values_impl<T, S, 3>(src, H * N, D, group_size, c, s, z);
        default: return values_impl<T, S, 2>(src, H * N, D, group_size, c, s, z);
      }
    });
  });
}

}  // namespace cpu_ops_quant
