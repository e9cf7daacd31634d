// The computation of cpu_ops' fused split-precision decode attention. split_attention.cpp includes this file twice,
// into namespace `base` (the compiler's baseline target) and into namespace `avx2` (under #pragma GCC target
// "avx2,fma,f16c"), and picks one at run time; so there is no include guard. The types (Problem, Segment, WorkItem,
// DType), kBlock and the SHUFFLE8 macro come from that file.
//
// Notation: rows = n_rep * L_q query rows of one kv head (row r = rep * L_q + i), D head dim (a multiple of 8),
// G value group size, NG = D / G. Per work item the tokens go in blocks of at most kBlock tokens (a block never
// crosses a key chunk); a block's keys and values are unpacked into two small (kBlock, D) fp32 tiles that stay in L1.

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
static inline float hsum(v8f v) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
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

// n scales and zeros of a packed segment from element offset off -> fp32: numbers of the segment's dtype, or 8-bit
// codes decoded with their block blk (s_max, z_lo, z_step): s_max * table[code] and z_lo + code * z_step
// (hf_cocktail.params8.decode_params8).
static inline void load_params(const Segment& g, const void* scale, const void* zero, const void* block, int64_t off,
                               int64_t blk, int64_t n, float* s, float* z) {
  if (!g.k_block) {
    to_float(scale, g.s_dtype, off, n, s);
    to_float(zero, g.s_dtype, off, n, z);
    return;
  }
  float b[3];
  to_float(block, g.b_dtype, 3 * blk, 3, b);
  const uint8_t *sc = static_cast<const uint8_t*>(scale) + off, *zc = static_cast<const uint8_t*>(zero) + off;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = b[0] * g.table[sc[i]];
    const float step = static_cast<float>(zc[i]) * b[2];
    z[i] = b[1] + step;
  }
}

// Channel order of a packed segment's tiles. Whole groups of 8 code bytes are unpacked one byte per lane and one
// plane (bit offset j * BITS) at a time, so tile position 8 * (PER * k + j) + i holds channel PER * (8 * k + i) + j
// (PER = 8 / BITS codes per byte); bytes after the last whole group of 8 are unpacked in channel order. Returns
// perm: perm[pos] is the channel at tile position pos. q.k and P.V do not depend on the order, so a packed item
// computes in this order and puts its output back in channel order at the end.
template <int BITS>
static std::vector<int> tile_order(int D) {
  if constexpr (BITS == 3) return tile_order<2>(D);  // INT3: its 2-bit plane sets the order (unpack_token3)
  constexpr int PER = 8 / BITS;
  const int planar = ((D * BITS / 8) & ~7) * PER;  // channels of the whole groups of 8 bytes
  std::vector<int> perm(D);
  for (int pos = 0; pos < D; ++pos)
    perm[pos] = pos < planar ? PER * (8 * (pos / (8 * PER)) + pos % 8) + pos / 8 % PER : pos;
  return perm;
}

// 8 codes -> their levels in code units: the codes themselves (uniform levels, table null), or table[code] for a
// codebook (hf_cocktail.quant.LLOYD_LEVELS; table: 8 floats, the levels padded with zeros).
static inline v8f code_levels(v8i c, const float* table) {
  if (!table) return __builtin_convertvector(c, v8f);
#ifdef CPU_OPS_AVX2
  return (v8f)_mm256_permutevar8x32_ps(_mm256_loadu_ps(table), (__m256i)c);
#else
  v8f x;
  for (int i = 0; i < 8; ++i) x[i] = table[c[i]];
  return x;
#endif
}

// The codes of one token (D channels, PER per byte, low bits first) -> fp32 levels (code_levels) in tile order
// (tile_order). With `scale`, values are dequantized on the way: level * scale[group] + zero[group], vgroup[v] being
// the value group of tile lanes 8 * v ... 8 * v + 7.
template <int BITS>
static inline void unpack_token(const uint8_t* codes, int D, float* dst, const float* table, const float* scale = nullptr,
                                const float* zero = nullptr, const int* vgroup = nullptr);

// INT3 tokens (defined below)
static inline void unpack_token3(const uint8_t* codes, int D, float* dst, const float* table, const float* scale,
                                 const float* zero, const int* vgroup);

template <int BITS>
static inline void unpack_token(const uint8_t* codes, int D, float* dst, const float* table, const float* scale,
                                const float* zero, const int* vgroup) {
  if constexpr (BITS == 3) return unpack_token3(codes, D, dst, table, scale, zero, vgroup);
  constexpr int PER = BITS == 3 ? 1 : 8 / BITS, MASK = (1 << BITS) - 1;
  typedef typename std::conditional<BITS == 2, uint16_t, uint32_t>::type Word;  // the BITS bytes of 8 channels
  const int Dp = D * BITS / 8, whole = Dp & ~7;
  int v = 0;  // 8-lane vector of the tile
  auto put = [&](v8i c) {
    const v8f x = code_levels(c & MASK, table);
    store8(dst + 8 * v, scale ? x * scale[vgroup[v]] + zero[vgroup[v]] : x);
    ++v;
  };
  for (int b = 0; b < whole; b += 8) {  // 8 bytes, one per lane: PER vectors, one per bit plane
    const v8i x = load_bytes8(codes + b);
    for (int j = 0; j < PER; ++j) put(x >> (j * BITS));
  }
  for (int b = whole; b < Dp; b += BITS) {  // the rest in channel order: the bytes of 8 channels to all lanes
    Word word;
    std::memcpy(&word, codes + b, sizeof(Word));  // little end first, as the bytes hold the channels
    put((v8i{} + static_cast<int32_t>(word)) >> (v8i{0, 1, 2, 3, 4, 5, 6, 7} * BITS));
  }
}

// INT3 (hf_cocktail.quant's layout): the low two bits of every channel packed as INT2 (D / 4 bytes), then the high
// bit of every channel, 8 per byte (channel d in byte D / 4 + d / 8 at bit d % 8). The low plane is unpacked in
// INT2's tile order; in a whole group k of 8 low bytes (32 channels), lane i of vector j holds channel
// 32k + 4i + j, whose high bit is bit 4i + j of the little-endian 32-bit word at high-plane byte 4k. Channels
// after the whole groups are in channel order: lane i of the m-th 8 holds channel 8m + i, high bit i of byte m.
static inline void unpack_token3(const uint8_t* codes, int D, float* dst, const float* table,
                                 const float* scale = nullptr, const float* zero = nullptr,
                                 const int* vgroup = nullptr) {
  const int Dl = D / 4, whole = Dl & ~7;
  const uint8_t* hi = codes + Dl;
  int v = 0;
  auto put = [&](v8i c) {
    const v8f x = code_levels(c, table);
    store8(dst + 8 * v, scale ? x * scale[vgroup[v]] + zero[vgroup[v]] : x);
    ++v;
  };
  const v8i lane4 = v8i{0, 4, 8, 12, 16, 20, 24, 28}, lane1 = v8i{0, 1, 2, 3, 4, 5, 6, 7};
  for (int b = 0; b < whole; b += 8) {
    const v8i x = load_bytes8(codes + b);
    uint32_t word;
    std::memcpy(&word, hi + b / 2, sizeof(word));
    const v8i w = v8i{} + static_cast<int32_t>(word);
    for (int j = 0; j < 4; ++j) put(((x >> (2 * j)) & 3) | ((((w >> (lane4 + j)) & 1)) << 2));
  }
  for (int b = whole; b < Dl; b += 2) {  // 8 channels: 2 low bytes, 1 high byte
    uint16_t low;
    std::memcpy(&low, codes + b, sizeof(low));
    const v8i h = v8i{} + static_cast<int32_t>(hi[b / 2]);
    put((((v8i{} + static_cast<int32_t>(low)) >> (lane1 * 2)) & 3) | (((h >> lane1) & 1) << 2));
  }
}

// Keys of n tokens of a packed segment into the key tile as levels (code units), in the keys' tile order.
template <int BITS>
static void unpack_key_block(const uint8_t* kc, int n, int D, const float* table, float* kt) {
  const int Dp = D * BITS / 8;
  for (int t = 0; t < n; ++t)
    unpack_token<BITS>(kc + static_cast<int64_t>(t) * Dp, D, kt + static_cast<int64_t>(t) * D, table);
}

// Values of n tokens of a packed segment into the value tile, dequantized, in the values' tile order; vs / vz:
// (n, NG) value scales / zeros. vgroup: the group of each 8 tile lanes, or null when lanes of one vector straddle
// groups; then lane_g (the group of each tile position) gives per-lane scales. table: the codebook (code_levels).
template <int BITS>
static void unpack_value_block(const uint8_t* vc, int n, int D, int NG, const float* vs, const float* vz,
                               const int* vgroup, const int* lane_g, const float* table, float* vt, float* lane_s,
                               float* lane_z) {
  const int Dp = D * BITS / 8;
  for (int t = 0; t < n; ++t) {
    const float *ts = vs + t * NG, *tz = vz + t * NG;
    float* vrow = vt + static_cast<int64_t>(t) * D;
    if (vgroup) {
      unpack_token<BITS>(vc + static_cast<int64_t>(t) * Dp, D, vrow, table, ts, tz, vgroup);
    } else {
      unpack_token<BITS>(vc + static_cast<int64_t>(t) * Dp, D, vrow, table);
      for (int p = 0; p < D; ++p) lane_s[p] = ts[lane_g[p]], lane_z[p] = tz[lane_g[p]];
      for (int p = 0; p < D; p += 8) store8(vrow + p, load8(vrow + p) * load8(lane_s + p) + load8(lane_z + p));
    }
  }
}

// s[r * kBlock + t] = bias[r] + q[r, :] . k[t, :] for t < n8 (n8 a multiple of 8; q: rows x D, k: n8 x D).
static inline void block_scores(const float* q, const float* bias, const float* k, int rows, int n8, int D, float* s) {
  for (int r = 0; r < rows; ++r) {
    const float* qr = q + static_cast<int64_t>(r) * D;
    for (int t0 = 0; t0 < n8; t0 += 8) {
      v8f acc[8] = {};
      for (int d = 0; d < D; d += 8) {
        const v8f qv = load8(qr + d);
        for (int j = 0; j < 8; ++j) acc[j] += qv * load8(k + static_cast<int64_t>(t0 + j) * D + d);
      }
      store8(s + r * kBlock + t0, sum_lanes8(acc) + bias[r]);
    }
  }
}

// One online-softmax step (base 2) over a block: scores s (rows x n8, -inf where masked) become probabilities
// 2**(s - m_new); the running max m, sum l and output acc (rows x D) of each row are rescaled by 2**(m_old - m_new).
static inline void softmax_step(float* s, int rows, int n8, int D, float* m, float* l, float* acc) {
  for (int r = 0; r < rows; ++r) {
    float* sr = s + r * kBlock;
    float mb = -INFINITY;
    for (int t = 0; t < n8; ++t) mb = sr[t] > mb ? sr[t] : mb;
    const float m_new = mb > m[r] ? mb : m[r];
    if (m_new == -INFINITY) {  // every token so far masked: nothing to add
      std::memset(sr, 0, n8 * sizeof(float));
      continue;
    }
    v8f sum{};
    for (int t = 0; t < n8; t += 8) {
      const v8f p = exp2_neg(load8(sr + t) - m_new);
      store8(sr + t, p);
      sum += p;
    }
    if (m_new != m[r]) {
      const v8f alpha = bcast(m[r] == -INFINITY ? 0.0f : std::exp2(m[r] - m_new));
      float* ar = acc + static_cast<int64_t>(r) * D;
      for (int d = 0; d < D; d += 8) store8(ar + d, load8(ar + d) * alpha);
      l[r] *= alpha[0];
      m[r] = m_new;
    }
    l[r] += hsum(sum);
  }
}

// acc[r, d0 : d0 + 8 * NV] += sum_{t < n} p[r, t] * v[t, d0 : d0 + 8 * NV], with the NV accumulators in registers.
template <int NV>
static inline void pv_slice(const float* p, const float* v, int rows, int n, int D, int d0, float* acc) {
  for (int r = 0; r < rows; ++r) {
    float* ar = acc + static_cast<int64_t>(r) * D + d0;
    v8f a[NV];
    for (int j = 0; j < NV; ++j) a[j] = load8(ar + 8 * j);
    for (int t = 0; t < n; ++t) {
      const v8f w = bcast(p[r * kBlock + t]);
      const float* vt = v + static_cast<int64_t>(t) * D + d0;
      for (int j = 0; j < NV; ++j) a[j] += w * load8(vt + 8 * j);
    }
    for (int j = 0; j < NV; ++j) store8(ar + 8 * j, a[j]);
  }
}

static inline void block_pv(const float* p, const float* v, int rows, int n, int D, float* acc) {
  int d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) pv_slice<4>(p, v, rows, n, D, d0, acc);
  for (; d0 < D; d0 += 8) pv_slice<1>(p, v, rows, n, D, d0, acc);
}

// Partial attention of one work item (a token range of one sequence, kv head and source): writes its running max
// m (rows), sum l (rows) and unnormalised output acc (rows, D), all base 2.
static void run_item(const Problem& P, const WorkItem& w, float* m, float* l, float* acc) {
  const int D = P.D, rows = P.rows;
  std::vector<float> s(static_cast<size_t>(rows) * kBlock), kt(static_cast<size_t>(kBlock) * D, 0.0f),
      vt(static_cast<size_t>(kBlock) * D, 0.0f), bias(rows, 0.0f);
  for (int r = 0; r < rows; ++r) m[r] = -INFINITY, l[r] = 0.0f;
  std::fill(acc, acc + static_cast<int64_t>(rows) * D, 0.0f);
  const float* q = P.q + (static_cast<int64_t>(w.b) * P.H_kv + w.h) * rows * D;  // (rows, D), pre-scaled
  // a block of n tokens is computed as n8 (n rounded up to 8): tile rows [n, n8) are zero, their scores -inf
  auto finish_block = [&](int n) {
    const int n8 = (n + 7) & ~7;
    for (int r = 0; r < rows; ++r)
      for (int t = n; t < n8; ++t) s[r * kBlock + t] = -INFINITY;
    softmax_step(s.data(), rows, n8, D, m, l, acc);
    block_pv(s.data(), vt.data(), rows, n, D, acc);
  };
  auto clear_tail = [&](int n) {
    const int n8 = (n + 7) & ~7;
    std::memset(kt.data() + static_cast<int64_t>(n) * D, 0, static_cast<size_t>(n8 - n) * D * sizeof(float));
    std::memset(vt.data() + static_cast<int64_t>(n) * D, 0, static_cast<size_t>(n8 - n) * D * sizeof(float));
    return n8;
  };

  if (w.src == 0) {  // full-precision part: key t is visible to row r iff t <= R - L_q + r % L_q
    const int64_t base = w.b * P.f_sb + w.h * P.f_sh;
    for (int64_t a = w.lo; a < w.hi; a += kBlock) {
      const int n = static_cast<int>(std::min<int64_t>(kBlock, w.hi - a));
      for (int t = 0; t < n; ++t) {
        if (P.f_int8) {
          const int64_t off = base + (a + t) * P.f_st, soff = w.b * P.fs_sb + w.h * P.fs_sh + (a + t) * P.fs_st;
          float sk, sv;
          to_float(P.fks, P.fs_dtype, soff, 1, &sk);
          to_float(P.fvs, P.fs_dtype, soff, 1, &sv);
          int8_to_float(static_cast<const int8_t*>(P.fk) + off, sk, D, kt.data() + t * D);
          int8_to_float(static_cast<const int8_t*>(P.fv) + off, sv, D, vt.data() + t * D);
        } else {
          to_float(P.fk, P.f_dtype, base + (a + t) * P.f_st, D, kt.data() + t * D);
          to_float(P.fv, P.f_dtype, base + (a + t) * P.f_st, D, vt.data() + t * D);
        }
      }
      block_scores(q, bias.data(), kt.data(), rows, clear_tail(n), D, s.data());
      if (a + n > P.R - P.L_q + 1) {  // the block reaches the queries' own tokens
        for (int r = 0; r < rows; ++r)
          for (int t = 0; t < n; ++t)
            if (a + t > P.R - P.L_q + r % P.L_q) s[r * kBlock + t] = -INFINITY;
      }
      finish_block(n);
    }
    return;
  }

  const Segment& g = P.seg[w.src - 1];
  const int kDp = D * g.bits / 8, vDp = D * g.vbits / 8, NG = D / g.G;
  const int64_t t0 = g.tok_off[w.b], c0 = g.chunk_off[w.b];
  // keys and values each in the tile order of their code width (INT3 orders as INT2)
  const std::vector<int> kperm = g.bits == 4 ? tile_order<4>(D) : tile_order<2>(D);
  const std::vector<int> vperm = g.vbits == 4 ? tile_order<4>(D) : tile_order<2>(D);
  std::vector<int> lane_g(D), vgroup(D / 8);
  bool uniform = true;  // every 8 tile lanes in one value group (G >= 8 * PER, the usual case)
  for (int p = 0; p < D; ++p) {
    lane_g[p] = vperm[p] / g.G;
    uniform = uniform && lane_g[p] == lane_g[p & ~7];
    if (p % 8 == 0) vgroup[p / 8] = lane_g[p];
  }
  std::vector<float> qp(static_cast<size_t>(rows) * D), qs(qp.size()), kscale(D), kzero(D), ks_tile(D),
      vsc(static_cast<size_t>(kBlock) * NG), vze(vsc.size()), lane_s(D), lane_z(D);
  float table[8] = {};  // the codebook's levels, padded to 8 lanes (code_levels); unused for uniform levels
  if (g.levels) std::copy(g.levels, g.levels + (1 << g.bits), table);
  for (int r = 0; r < rows; ++r)  // the queries in tile order
    for (int p = 0; p < D; ++p) qp[r * D + p] = q[static_cast<int64_t>(r) * D + kperm[p]];
  const uint8_t* kc = g.k_codes + static_cast<int64_t>(w.h) * g.N * kDp;
  const uint8_t* vc = g.v_codes + static_cast<int64_t>(w.h) * g.N * vDp;
  auto unpack_keys = g.bits == 2 ? unpack_key_block<2> : g.bits == 3 ? unpack_key_block<3> : unpack_key_block<4>;
  auto unpack_values = g.vbits == 2   ? unpack_value_block<2>
                       : g.vbits == 3 ? unpack_value_block<3>
                                      : unpack_value_block<4>;
  int64_t chunk = -1;
  for (int64_t a = w.lo; a < w.hi;) {
    const int64_t c = c0 + (a - t0) / g.C;  // the chunk of token a; the block ends at the chunk's end
    const int n = static_cast<int>(std::min<int64_t>({kBlock, w.hi - a, t0 + (c - c0 + 1) * g.C - a}));
    if (c != chunk) {  // keys: q . k_t = sum_d (q_d * s_cd) * level_td + sum_d q_d * z_cd, scales once per chunk
      chunk = c;
      const int64_t blk = static_cast<int64_t>(w.h) * g.M + c;
      load_params(g, g.k_scale, g.k_zero, g.k_block, blk * D, blk, D, kscale.data(), kzero.data());
      for (int p = 0; p < D; ++p) ks_tile[p] = kscale[kperm[p]];
      for (int r = 0; r < rows; ++r) {
        v8f bz{};
        for (int d = 0; d < D; d += 8) {
          store8(qs.data() + r * D + d, load8(qp.data() + r * D + d) * load8(ks_tile.data() + d));
          bz += load8(q + static_cast<int64_t>(r) * D + d) * load8(kzero.data() + d);
        }
        bias[r] = hsum(bz);
      }
    }
    // values: level * vs + vz per token and group of G channels, dequantized into the tile (shared by all rows)
    const int64_t voff = (static_cast<int64_t>(w.h) * g.N + a) * NG;  // (the values' blocks: one per chunk too)
    load_params(g, g.v_scale, g.v_zero, g.v_block, voff, static_cast<int64_t>(w.h) * g.M + c,
                static_cast<int64_t>(n) * NG, vsc.data(), vze.data());
    const float* levels = g.levels ? table : nullptr;
    unpack_keys(kc + a * kDp, n, D, levels, kt.data());
    unpack_values(vc + a * vDp, n, D, NG, vsc.data(), vze.data(), uniform ? vgroup.data() : nullptr, lane_g.data(),
                  levels, vt.data(), lane_s.data(), lane_z.data());
    block_scores(qs.data(), bias.data(), kt.data(), rows, clear_tail(n), D, s.data());
    finish_block(n);
    a += n;
  }
  for (int r = 0; r < rows; ++r) {  // the output back in channel order
    float* ar = acc + static_cast<int64_t>(r) * D;
    std::copy(ar, ar + D, lane_s.begin());
    for (int p = 0; p < D; ++p) ar[vperm[p]] = lane_s[p];
  }
}

// Runs every work item on `workers` threads of ATen's pool (dynamic scheduling; inline when workers is 1), then
// merges the partials of each (sequence, kv head) with a log-sum-exp reduction; out (B, H_q, L_q, D) contiguous, in
// out_dtype.
static void run_all(const Problem& P, const std::vector<WorkItem>& items, const std::vector<int64_t>& first_item,
                    int64_t workers, void* out, DType out_dtype) {
  const int rows = P.rows, D = P.D;
  const int64_t n_items = static_cast<int64_t>(items.size());
  std::vector<float> pm(n_items * rows), pl(n_items * rows), pacc(n_items * rows * D);
  std::atomic<int64_t> next{0};
  auto work = [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n_items; i = next++)
      run_item(P, items[i], pm.data() + i * rows, pl.data() + i * rows, pacc.data() + i * rows * D);
  };
  if (workers == 1)
    work(0, 1);  // no parallel region: on a busy machine waking a thread team costs more than a small problem
  else
    at::parallel_for(0, workers, 1, work);
  std::vector<float> o(D), rotated(D);
  for (int64_t bh = 0; bh + 1 < static_cast<int64_t>(first_item.size()); ++bh) {  // bh = b * H_kv + h
    for (int r = 0; r < rows; ++r) {
      float mx = -INFINITY;
      for (int64_t i = first_item[bh]; i < first_item[bh + 1]; ++i) mx = std::max(mx, pm[i * rows + r]);
      std::fill(o.begin(), o.end(), 0.0f);
      float sum = 0.0f;
      for (int64_t i = first_item[bh]; i < first_item[bh + 1]; ++i) {
        if (pm[i * rows + r] == -INFINITY) continue;  // an item that saw no token for this row
        const float wgt = std::exp2(pm[i * rows + r] - mx);
        sum += wgt * pl[i * rows + r];
        const float* a = pacc.data() + (i * rows + r) * D;
        for (int d = 0; d < D; ++d) o[d] += wgt * a[d];
      }
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // a row that sees no token gets 0 (as the reference)
      for (int d = 0; d < D; ++d) o[d] *= inv;
      if (P.rot_o) {  // rotated values: the output rotated back, o . R^T
        std::copy(o.begin(), o.end(), rotated.begin());
        times_matrix(rotated.data(), P.rot_o + (bh % P.H_kv) * static_cast<int64_t>(D) * D, D, true, o.data());
      }
      const int64_t dst = ((bh * P.n_rep + r / P.L_q) * P.L_q + r % P.L_q) * D;  // (b, h * n_rep + rep, i, :)
      if (out_dtype == DType::F32)
        std::copy(o.begin(), o.end(), static_cast<float*>(out) + dst);
      else if (out_dtype == DType::BF16)
        for (int d = 0; d < D; ++d) static_cast<c10::BFloat16*>(out)[dst + d] = c10::BFloat16(o[d]);
      else
        for (int d = 0; d < D; ++d) static_cast<c10::Half*>(out)[dst + d] = c10::Half(o[d]);
    }
  }
}
