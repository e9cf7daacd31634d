// The 8-lane vector helpers of cpu_ops' fused attention kernel: vector types, loads and stores, horizontal sums,
// exp2, and the conversions of stored numbers to fp32 (float32 / bfloat16 / float16 arrays, int8 codes).
// Included by kernel.h (inside split_attention.cpp's `base` and `avx2` namespaces, under that build's target), so
// there is no include guard; the types (Problem, Segment, DType), kBlock and SHUFFLE8 come from split_attention.cpp.

// 8-lane vectors (GCC / Clang vector extensions): AVX registers in the avx2 build, pairs of SSE registers otherwise.
// They are declared here, under the target pragma: a vector type declared outside it would not get an AVX mode.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint8_t v8u8 __attribute__((vector_size(8)));

static inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
static inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
static inline v8f bcast(float x) { return v8f{} + x; }
static inline v8f as_float(v8i x) { return (v8f)x; }  // bit casts
static inline v8i as_int(v8f x) { return (v8i)x; }
static inline float hsum(v8f v) {  // a tree: halves, quarters, pairs
  v = v + SHUFFLE8(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v = v + SHUFFLE8(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  return v[0] + v[1];
}
static inline float hmax(v8f v) {  // the largest lane (lanes never NaN here), as a tree
  v8f u = SHUFFLE8(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v = u > v ? u : v;
  u = SHUFFLE8(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v = u > v ? u : v;
  return v[1] > v[0] ? v[1] : v[0];
}

// Lane-wise (a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7), like x86's vhaddps.
static inline v8f hadd(v8f a, v8f b) {
  return SHUFFLE8(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE8(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// Lane j of the result is the sum of the 8 lanes of a[j] (8 dot products finished at once).
static inline v8f sum_lanes8(const v8f* a) {
  const v8f x = hadd(hadd(a[0], a[1]), hadd(a[2], a[3])), y = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
  return SHUFFLE8(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE8(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
}

// 2**x for x <= 0, lane-wise (Cephes exp2f polynomial, rel. error < 2e-7); 0 for x < -126, including -inf; NaN
// stays NaN (a NaN score poisons the row, as in the reference).
static inline v8f exp2_neg(v8f x) {
  const v8i keep = ~(x < bcast(-126.0f));  // lanes of -1 (keep) / 0
  x = as_float((as_int(x) & keep) | (as_int(bcast(-126.0f)) & ~keep));
  const v8i i = __builtin_convertvector(x - 0.5f, v8i);  // round to nearest (x <= 0): f in [-0.5, 0.5]
  const v8f f = x - __builtin_convertvector(i, v8f);
  v8f p = bcast(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  const v8f y = (p * f + 1.0f) * as_float((i + 127) << 23);  // times 2**i
  return as_float(as_int(y) & keep);
}

// 8 bytes, zero-extended to 8 int32 lanes.
static inline v8i load_bytes8(const uint8_t* p) {
#ifdef CPU_OPS_AVX2  // GCC turns the generic conversion into byte-by-byte inserts
  return (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  v8u8 bytes;
  std::memcpy(&bytes, p, 8);
  return __builtin_convertvector(bytes, v8i);
#endif
}

// n elements (a multiple of 8 or not) of a float32 / bfloat16 / float16 array from element offset off -> fp32.
static inline void to_float(const void* src, DType dt, int64_t off, int64_t n, float* dst) {
  if (dt == DType::F32) {
    std::memcpy(dst, static_cast<const float*>(src) + off, n * sizeof(float));
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src) + off;
  int64_t i = 0;
  if (dt == DType::BF16) {
    for (; i + 8 <= n; i += 8) {
      v8u16 h;
      std::memcpy(&h, s + i, sizeof(h));
      const v8i u = __builtin_convertvector(h, v8i) << 16;
      store8(dst + i, as_float(u));
    }
    for (; i < n; ++i) {
      const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
      std::memcpy(dst + i, &u, 4);
    }
    return;
  }
#ifdef CPU_OPS_AVX2  // defined by split_attention.cpp for the avx2 build
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
#endif
  for (; i < n; ++i) dst[i] = c10::detail::fp16_ieee_to_fp32_value(s[i]);
}

// y = x . M (transpose false: y[e] = sum_d x[d] M[d, e]) or x . M^T (y[e] = sum_d x[d] M[e, d]); M (D, D) fp32.
static void times_matrix(const float* x, const float* M, int D, bool transpose, float* y) {
  if (!transpose) {
    for (int e = 0; e < D; e += 8) store8(y + e, v8f{});
    for (int d = 0; d < D; ++d) {
      const v8f w = bcast(x[d]);
      const float* row = M + static_cast<int64_t>(d) * D;
      for (int e = 0; e < D; e += 8) store8(y + e, load8(y + e) + w * load8(row + e));
    }
    return;
  }
  for (int e = 0; e < D; ++e) {
    const float* row = M + static_cast<int64_t>(e) * D;
    v8f acc{};
    for (int d = 0; d < D; d += 8) acc += load8(x + d) * load8(row + d);
    y[e] = hsum(acc);
  }
}

// D int8 codes of one token of an 8-bit full part -> fp32 code * scale (hf_cocktail.quant.dequantize_tokens8).
static inline void int8_to_float(const int8_t* src, float scale, int D, float* dst) {
  typedef int8_t v8s8 __attribute__((vector_size(8)));
  for (int d = 0; d < D; d += 8) {
    v8s8 c;
    std::memcpy(&c, src + d, sizeof(c));
    store8(dst + d, __builtin_convertvector(__builtin_convertvector(c, v8i), v8f) * scale);
  }
}
