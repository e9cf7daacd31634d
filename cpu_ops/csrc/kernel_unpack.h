// Unpacking of cpu_ops' packed segments into the kernel's fp32 tiles: scales and zeros (numbers or 8-bit codes), the
// tiles' channel order, and the codes of INT4 / INT3 / INT2 tokens (keys as bare codes, values dequantized).
// Included by kernel.h (inside split_attention.cpp's `base` and `avx2` namespaces, under that build's target), so
// there is no include guard; the types (Problem, Segment, DType), kBlock and SHUFFLE8 come from split_attention.cpp.
// Needs kernel_simd.h first.

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
  int64_t i = 0;
#ifdef CPU_OPS_AVX2  // 8 at a time: the table read by a gather, the zero as below (two roundings, no FMA)
  const v8f s_max = bcast(b[0]), z_lo = bcast(b[1]), z_step = bcast(b[2]);
  for (; i + 8 <= n; i += 8) {
    const v8f t = _mm256_i32gather_ps(g.table, (__m256i)load_bytes8(sc + i), 4);
    store8(s + i, s_max * t);
    const v8f step = __builtin_convertvector(load_bytes8(zc + i), v8f) * z_step;
    store8(z + i, z_lo + step);
  }
#endif
  for (; i < n; ++i) {
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

// split_planes: the planes of x (one code byte per lane; REP = 0x00010001: two, one per 16-bit half) and, for INT3,
// w (each lane's high-bit nibble at bit 0, per half likewise); every mask is repeated per half by REP.
template <int BITS, int32_t REP = 1>
static inline void split_planes(v8i x, v8i w, v8i* c) {
  if constexpr (BITS == 3) {
    c[0] = (x & 3 * REP) | ((w & REP) << 2);  // plane j: the low bits >> 2j, the high bit j of the nibble, at bit 2
    c[1] = ((x >> 2) & 3 * REP) | ((w & 2 * REP) << 1);  // (masked before any left shift: nothing negative shifted)
    c[2] = ((x >> 4) & 3 * REP) | (w & 4 * REP);
    c[3] = ((x >> 6) & 3 * REP) | ((w & 8 * REP) >> 1);
  } else {
    for (int j = 0; j < 8 / BITS; ++j) c[j] = (x >> (j * BITS)) & ((1 << BITS) - 1) * REP;
  }
}

// INT3: lane i of the result holds bits 4i .. 4i + 3 of the little-endian 32-bit word at p (and higher bits above).
static inline v8i high_nibbles(const uint8_t* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof(word));
  return (v8i{} + static_cast<int32_t>(word)) >> v8i{0, 4, 8, 12, 16, 20, 24, 28};
}

// The k-th whole group of 8 code bytes of one token (INT3: 8 bytes of its 2-bit plane and their 4 bytes of high
// bits) as the PER = 8 / BITS (INT3: 4) tile vectors PER * k ... PER * k + PER - 1 of its codes (tile_order; INT3: see unpack_token3).
template <int BITS>
static inline void code_planes(const uint8_t* codes, int D, int k, v8i* c) {
  split_planes<BITS>(load_bytes8(codes + 8 * k), BITS == 3 ? high_nibbles(codes + D / 4 + 4 * k) : v8i{}, c);
}

// The codes of one token (D channels, PER per byte, low bits first) -> fp32 codes in tile order (tile_order). SCALED
// (a compile-time choice: no branch per vector): values are dequantized on the way, code * scale[group] +
// zero[group], vgroup[v] being the value group of tile lanes 8 * v ... 8 * v + 7.
template <int BITS, bool SCALED = false>
static inline void unpack_token(const uint8_t* codes, int D, float* dst, const float* scale = nullptr,
                                const float* zero = nullptr, const int* vgroup = nullptr);

// INT3 tokens (defined below)
template <bool SCALED>
static inline void unpack_token3(const uint8_t* codes, int D, float* dst, const float* scale, const float* zero,
                                 const int* vgroup);

template <int BITS, bool SCALED>
static inline void unpack_token(const uint8_t* codes, int D, float* dst, const float* scale, const float* zero,
                                const int* vgroup) {
  if constexpr (BITS == 3) {  // (the rest is not instantiated for INT3)
    unpack_token3<SCALED>(codes, D, dst, scale, zero, vgroup);
  } else {
    constexpr int PER = 8 / BITS, MASK = (1 << BITS) - 1;
    typedef typename std::conditional<BITS == 2, uint16_t, uint32_t>::type Word;  // the BITS bytes of 8 channels
    const int Dp = D * BITS / 8, whole = Dp & ~7;
    int v = 0;  // 8-lane vector of the tile
    auto put = [&](v8i c) {
      const v8f x = __builtin_convertvector(c & MASK, v8f);
      if constexpr (SCALED)
        store8(dst + 8 * v, x * scale[vgroup[v]] + zero[vgroup[v]]);
      else
        store8(dst + 8 * v, x);
      ++v;
    };
    for (int b = 0; b < whole; b += 8) {  // 8 bytes, one per lane: PER vectors, one per bit plane
      v8i c[PER];
      code_planes<BITS>(codes, D, b / 8, c);
      for (int j = 0; j < PER; ++j) put(c[j]);
    }
    for (int b = whole; b < Dp; b += BITS) {  // the rest in channel order: the bytes of 8 channels to all lanes
      Word word;
      std::memcpy(&word, codes + b, sizeof(Word));  // little end first, as the bytes hold the channels
      put((v8i{} + static_cast<int32_t>(word)) >> (v8i{0, 1, 2, 3, 4, 5, 6, 7} * BITS));
    }
  }
}

// INT3 (hf_cocktail.quant's layout): the low two bits of every channel packed as INT2 (D / 4 bytes), then the high
// bit of every channel, 8 per byte (channel d in byte D / 4 + d / 8 at bit d % 8). The low plane is unpacked in
// INT2's tile order; in a whole group k of 8 low bytes (32 channels), lane i of vector j holds channel
// 32k + 4i + j, whose high bit is bit 4i + j of the little-endian 32-bit word at high-plane byte 4k. Channels
// after the whole groups are in channel order: lane i of the m-th 8 holds channel 8m + i, high bit i of byte m.
template <bool SCALED>
static inline void unpack_token3(const uint8_t* codes, int D, float* dst, const float* scale, const float* zero,
                                 const int* vgroup) {
  const int Dl = D / 4, whole = Dl & ~7;
  const uint8_t* hi = codes + Dl;
  int v = 0;
  auto put = [&](v8i c) {
    const v8f x = __builtin_convertvector(c, v8f);
    if constexpr (SCALED)
      store8(dst + 8 * v, x * scale[vgroup[v]] + zero[vgroup[v]]);
    else
      store8(dst + 8 * v, x);
    ++v;
  };
  const v8i lane1 = v8i{0, 1, 2, 3, 4, 5, 6, 7};
  for (int b = 0; b < whole; b += 8) {  // 8 low bytes and their 4 high bytes: 4 vectors
    v8i c[4];
    code_planes<3>(codes, D, b / 8, c);
    for (int j = 0; j < 4; ++j) put(c[j]);
  }
  for (int b = whole; b < Dl; b += 2) {  // 8 channels: 2 low bytes, 1 high byte
    uint16_t low;
    std::memcpy(&low, codes + b, sizeof(low));
    const v8i h = v8i{} + static_cast<int32_t>(hi[b / 2]);
    put((((v8i{} + static_cast<int32_t>(low)) >> (lane1 * 2)) & 3) | (((h >> lane1) & 1) << 2));
  }
}

// Values of one token when its tile vectors come in runs of vpg per value group (vpg = G / 8, a multiple of PER; every
// code byte in a whole group of 8): each group's scale and zero are broadcast once, not once per vector.
template <int BITS>
static inline void unpack_value_runs(const uint8_t* codes, int D, int NG, int vpg, const float* scale,
                                     const float* zero, float* dst) {
  constexpr int PER = BITS == 3 ? 4 : 8 / BITS;
  for (int grp = 0, k = 0; grp < NG; ++grp) {
    const v8f sv = bcast(scale[grp]), zv = bcast(zero[grp]);
    for (const int end = k + vpg / PER; k < end; ++k) {
      v8i c[PER];
      code_planes<BITS>(codes, D, k, c);
      for (int j = 0; j < PER; ++j) store8(dst + 8 * (PER * k + j), __builtin_convertvector(c[j], v8f) * sv + zv);
    }
  }
}

// Keys of n tokens of a packed segment into the key tile as codes (fp32), in the keys' tile order.
template <int BITS>
static void unpack_key_block(const uint8_t* kc, int n, int D, float* kt) {
  const int Dp = D * BITS / 8;
  for (int t = 0; t < n; ++t) unpack_token<BITS>(kc + static_cast<int64_t>(t) * Dp, D, kt + static_cast<int64_t>(t) * D);
}

// Keys of n tokens of a segment with n_out outlier key channels into the key tile (rows of D) as codes: positions
// [0, Dr = D - n_out) hold the low-width codes in tile_order<BITS>(Dr) (its last Dr % 8 channels one at a time, in
// channel order as tile_order has them; INT3 has Dr % 8 == 0), positions [Dr, D) the 8-bit codes.
template <int BITS>
static void unpack_key_block_outliers(const uint8_t* kc, int n, int D, int n_out, float* kt) {
  constexpr int PER = BITS == 3 ? 1 : 8 / BITS;
  const int Dr = D - n_out, D8 = Dr & ~7, Dp = Dr * BITS / 8;
  for (int t = 0; t < n; ++t) {
    const uint8_t* c = kc + static_cast<int64_t>(t) * (Dp + n_out);
    float* row = kt + static_cast<int64_t>(t) * D;
    if (D8) unpack_token<BITS>(c, D8, row);
    for (int d = D8; d < Dr; ++d)
      row[d] = static_cast<float>((c[d * BITS / 8] >> (d % PER * BITS)) & ((1 << BITS) - 1));
    for (int j = 0; j < n_out; ++j) row[Dr + j] = static_cast<float>(c[Dp + j]);
  }
}

// Values of n tokens of a packed segment into the value tile, dequantized, in the values' tile order; vs / vz:
// (n, NG) value scales / zeros. vpg: vectors per group when unpack_value_runs applies, else 0. vgroup: the group of each 8 tile lanes, or null when lanes of one vector straddle
// groups; then lane_g (the group of each tile position) gives per-lane scales.
template <int BITS>
static void unpack_value_block(const uint8_t* vc, int n, int D, int NG, const float* vs, const float* vz, int vpg,
                               const int* vgroup, const int* lane_g, float* vt, float* lane_s, float* lane_z) {
  const int Dp = D * BITS / 8;
  for (int t = 0; t < n; ++t) {
    const float *ts = vs + t * NG, *tz = vz + t * NG;
    float* vrow = vt + static_cast<int64_t>(t) * D;
    if (vpg) {
      unpack_value_runs<BITS>(vc + static_cast<int64_t>(t) * Dp, D, NG, vpg, ts, tz, vrow);
    } else if (vgroup) {
      unpack_token<BITS, true>(vc + static_cast<int64_t>(t) * Dp, D, vrow, ts, tz, vgroup);
    } else {
      unpack_token<BITS>(vc + static_cast<int64_t>(t) * Dp, D, vrow);
      for (int p = 0; p < D; ++p) lane_s[p] = ts[lane_g[p]], lane_z[p] = tz[lane_g[p]];
      for (int p = 0; p < D; p += 8) store8(vrow + p, load8(vrow + p) * load8(lane_s + p) + load8(lane_z + p));
    }
  }
}

