// P.V of packed values in 16-bit integers, for the AVX-512 VNNI build of kernel.h (CPU_OPS_VNNI; included by kernel.h
// inside split_attention.cpp's `vnni` namespace, so there is no include guard). Needs kernel_simd.h and
// kernel_unpack.h first.
//
// Per block of n tokens and query row r, with value scales vs (n, NG) and zeros vz (n, NG):
//   sum_t p[r, t] * (code[t, d] * vs[t, g] + vz[t, g])
//     = sum_t w[r, t, g] * code[t, d] + sum_t p[r, t] * vz[t, g],   w[r, t, g] = p[r, t] * vs[t, g] >= 0.
// w is rounded to 16-bit integers on one scale per row and block (its largest w -> 32767), so the first sum is a
// dot product of 16-bit integers over pairs of tokens (vpdpwssd, 16 products per instruction where fp32 FMA does
// 8), exact in int32 (at most 16 pairs * 2 * 15 * 32767 < 2**24, exact in fp32 as well). The only rounding is w's:
// at most 2**-16 of the block's largest w per term (the attention's error against fp64 measures 9-47x below fp16
// PyTorch's: tests/test_cpu_ops.py).
// The zero term stays in fp32. Only values in runs (unpack_value_runs' layout: every vector in one group, vpg
// vectors per group) take this path; the tile order is theirs, so the output permutation is unchanged.

constexpr int kWScale = 32767;  // w's largest value per row and block

// code_planes for two tokens at once (b: the second token's codes, or null for none): lane i of c[j] holds the code
// of token a in its low 16 bits and token b's in its high 16 bits (the bytes of both in one lane, then the planes).
template <int BITS>
static inline void code_plane_pairs(const uint8_t* a, const uint8_t* b, int D, int k, v8i* c) {
  v8i x = load_bytes8(a + 8 * k), w{};
  if (b) x |= load_bytes8(b + 8 * k) << 16;
  if constexpr (BITS == 3) {
    w = high_nibbles(a + D / 4 + 4 * k) & 15;
    if (b) w |= (high_nibbles(b + D / 4 + 4 * k) & 15) << 16;
  }
  split_planes<BITS, 0x00010001>(x, w, c);
}

// The values of n tokens as pairs of 16-bit codes: tile[(t / 2) * D + pos] holds token t's code at tile position
// pos in its low half and token t + 1's in its high half (0 past n).
template <int BITS>
static void unpack_value_pairs(const uint8_t* vc, int n, int D, int32_t* tile) {
  constexpr int PER = BITS == 3 ? 4 : 8 / BITS;
  const int Dp = D * BITS / 8, groups = D / (8 * PER);  // whole groups of 8 code bytes per token (runs: all of them)
  for (int t = 0; t < n; t += 2) {
    const uint8_t* a = vc + static_cast<int64_t>(t) * Dp;
    int32_t* dst = tile + static_cast<int64_t>(t / 2) * D;
    for (int k = 0; k < groups; ++k) {
      v8i c[PER];
      code_plane_pairs<BITS>(a, t + 1 < n ? a + Dp : nullptr, D, k, c);
      for (int j = 0; j < PER; ++j) std::memcpy(dst + 8 * (PER * k + j), &c[j], sizeof(c[j]));
    }
  }
}

// Scratch of block_pv16 for `rows` query rows and NG value groups: the block's scales and zeros group-major
// (NG, kBlock), one row's w (NG, kBlock); per row its zero terms (NG), w's 16-bit pairs (NG, kBlock / 2), the scale
// back (1 / w's scale) and whether a NaN poisons it.
struct Pv16Scratch {
  int NG;
  std::vector<float> vs_t, vz_t, w, zero_term, inv;
  std::vector<int32_t> wq;
  std::vector<char> poisoned;
  Pv16Scratch(int rows, int NG)
      : NG(NG), vs_t(static_cast<size_t>(NG) * kBlock), vz_t(vs_t.size()), w(vs_t.size()),
        zero_term(static_cast<size_t>(rows) * NG), inv(rows), wq(static_cast<size_t>(rows) * NG * kBlock / 2),
        poisoned(rows) {}
  int32_t* wq_row(int r) { return wq.data() + static_cast<int64_t>(r) * NG * (kBlock / 2); }
};

typedef int32_t v8i_u __attribute__((vector_size(32), aligned(4)));  // an unaligned load of 8 lanes

static inline v8i dot_pairs(v8i acc, v8i codes, v8i w) {
  return (v8i)_mm256_dpwssd_epi32((__m256i)acc, (__m256i)codes, (__m256i)w);
}

// The pairs (t, t + 1) of 16 integers of 16-bit range, x tokens 0..7 and y tokens 8..15: lane i holds tokens 2i and
// 2i + 1 (low, high half).
static inline v8i pack_pairs(v8i x, v8i y) {
  const v8i even = SHUFFLE8(x, y, 0, 2, 4, 6, 8, 10, 12, 14), odd = SHUFFLE8(x, y, 1, 3, 5, 7, 9, 11, 13, 15);
  return even | (odd << 16);
}

// Row r's w = p * vs (NG, n8), its zero terms sum_t p * vz, and w rounded to 16 bits (kWScale at its largest) as
// token pairs; a row whose w is all 0 gets pairs of 0, a row with a NaN (or inf) is marked poisoned.
static void row_weights(const float* pr, int n8, Pv16Scratch& S, int r) {
  const int NG = S.NG;
  float* zt = S.zero_term.data() + r * NG;
  v8f wmax{}, wsum{};
  for (int g = 0; g < NG; ++g) {
    v8f zs{};
    for (int t = 0; t < n8; t += 8) {
      const v8f pt = load8(pr + t), w = pt * load8(S.vs_t.data() + g * kBlock + t);
      store8(S.w.data() + g * kBlock + t, w);
      wmax = w > wmax ? w : wmax;
      wsum += w;
      zs += pt * load8(S.vz_t.data() + g * kBlock + t);
    }
    zt[g] = hsum(zs);
  }
  const float top = hmax(wmax);
  bool finite = std::isfinite(hsum(wsum));
  for (int g = 0; g < NG; ++g) finite = finite && std::isfinite(zt[g]);
  S.poisoned[r] = !finite;
  const float scale = finite && top > 0.0f ? kWScale / top : 0.0f;
  S.inv[r] = finite && top > 0.0f ? top / kWScale : 0.0f;
  const v8f sv = bcast(scale);
  int32_t* wq = S.wq_row(r);
  for (int g = 0; g < NG; ++g)
    for (int t = 0; t < n8; t += 16) {  // w >= 0: round half up by truncation of w * scale + 0.5
      const float* wg = S.w.data() + g * kBlock + t;
      const v8i x = __builtin_convertvector(load8(wg) * sv + 0.5f, v8i);
      const v8i y = t + 8 < n8 ? __builtin_convertvector(load8(wg + 8) * sv + 0.5f, v8i) : v8i{};
      const v8i pairs = pack_pairs(x, y);
      std::memcpy(wq + g * (kBlock / 2) + t / 2, &pairs, sizeof(pairs));
    }
}

// acc rows r0 .. r0 + RR - 1 (each D) += the 16-bit P.V over pairs j < np for the NV tile vectors from v0 (rows
// inner: each tile vector is loaded once for the RR rows); STEP consecutive vectors share a group (STEP divides vpg).
template <int RR, int NV, int STEP>
static inline void pv16_slice(const int32_t* tile, Pv16Scratch& S, int r0, int np, int D, int v0, int vpg,
                              float* acc) {
  v8i a[RR][NV] = {};
  const int32_t* wq[RR][NV / STEP];  // each row's pairs of the group of vectors u * STEP ...
  for (int i = 0; i < RR; ++i)
    for (int u = 0; u < NV / STEP; ++u) wq[i][u] = S.wq_row(r0 + i) + (v0 + u * STEP) / vpg * (kBlock / 2);
  for (int j = 0; j < np; ++j) {  // (unrolled by hand-set pragmas: GCC keeps the accumulators in registers only then)
    const int32_t* tj = tile + static_cast<int64_t>(j) * D + 8 * v0;
#pragma GCC unroll 8
    for (int u = 0; u < NV; u += STEP) {
      v8i c[STEP];
#pragma GCC unroll 8
      for (int k = 0; k < STEP; ++k) c[k] = *reinterpret_cast<const v8i_u*>(tj + 8 * (u + k));
#pragma GCC unroll 4
      for (int i = 0; i < RR; ++i) {
        const v8i w = v8i{} + wq[i][u / STEP][j];
#pragma GCC unroll 8
        for (int k = 0; k < STEP; ++k) a[i][u + k] = dot_pairs(a[i][u + k], c[k], w);
      }
    }
  }
  for (int i = 0; i < RR; ++i) {
    const v8f scale = bcast(S.inv[r0 + i]);
    const float* zt = S.zero_term.data() + (r0 + i) * S.NG;
    for (int k = 0; k < NV; ++k) {
      float* ak = acc + static_cast<int64_t>(r0 + i) * D + 8 * (v0 + k);
      store8(ak, load8(ak) + __builtin_convertvector(a[i][k], v8f) * scale + zt[(v0 + k) / vpg]);
    }
  }
}

// Rows r0 .. r0 + RR - 1: the slices of 8 tile vectors (by the group run length), then single vectors.
template <int RR>
static void pv16_rows(const int32_t* tile, Pv16Scratch& S, int r0, int np, int D, int vpg, float* acc) {
  const int nvec = D / 8;
  int v0 = 0;
  for (; v0 + 8 <= nvec; v0 += 8) {
    if (vpg >= 4)  // (4, not 8: 3 x 8 accumulators, 4 code vectors and a broadcast fit the 32 registers)
      pv16_slice<RR, 8, 4>(tile, S, r0, np, D, v0, vpg, acc);
    else
      pv16_slice<RR, 8, 2>(tile, S, r0, np, D, v0, vpg, acc);
  }
  for (; v0 < nvec; ++v0) pv16_slice<RR, 1, 1>(tile, S, r0, np, D, v0, vpg, acc);
}

// x (n, NG) -> dst (NG, kBlock) for tokens < n8, 0 past n (one or two groups by vectors, more one by one).
static void group_major(const float* x, int n, int n8, int NG, float* dst) {
  int t = 0;
  if (NG == 1) {
    std::memcpy(dst, x, n * sizeof(float));
    t = n;
  } else if (NG == 2) {
    for (; t + 8 <= n; t += 8) {
      const v8f a = load8(x + 2 * t), b = load8(x + 2 * t + 8);
      store8(dst + t, SHUFFLE8(a, b, 0, 2, 4, 6, 8, 10, 12, 14));
      store8(dst + kBlock + t, SHUFFLE8(a, b, 1, 3, 5, 7, 9, 11, 13, 15));
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int u = t; u < n8; ++u) dst[g * kBlock + u] = u < n ? x[u * NG + g] : 0.0f;
}

// acc (rows, D) += P.V of one block of n tokens: p (rows, kBlock) probabilities (0 at [n, n8)), the codes as pairs
// in tile (unpack_value_pairs), vs / vz (n, NG) the tokens' value scales and zeros, vpg tile vectors per group (a
// power of two >= 2).
static void block_pv16(const float* p, int rows, int n, int D, int vpg, const float* vs, const float* vz,
                       const int32_t* tile, float* acc, Pv16Scratch& S) {
  const int NG = S.NG, n8 = (n + 7) & ~7, np = n8 / 2;
  group_major(vs, n, n8, NG, S.vs_t.data());
  group_major(vz, n, n8, NG, S.vz_t.data());
  for (int r = 0; r < rows; ++r) row_weights(p + r * kBlock, n8, S, r);
  int r0 = 0;  // rows three at a time: 24 accumulators of the 32 vector registers
  for (; r0 + 3 <= rows; r0 += 3) pv16_rows<3>(tile, S, r0, np, D, vpg, acc);
  if (rows - r0 == 2) pv16_rows<2>(tile, S, r0, np, D, vpg, acc);
  if (rows - r0 == 1) pv16_rows<1>(tile, S, r0, np, D, vpg, acc);
  for (int r = 0; r < rows; ++r)  // a NaN probability (or an inf) poisons its row, as the fp32 path's products do
    if (S.poisoned[r]) std::fill(acc + static_cast<int64_t>(r) * D, acc + static_cast<int64_t>(r + 1) * D, NAN);
}
