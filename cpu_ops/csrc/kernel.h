// The computation of cpu_ops' fused split-precision decode attention. split_attention.cpp includes this file twice,
// into namespace `base` (the compiler's baseline target) and into namespace `avx2` (under #pragma GCC target
// "avx2,fma,f16c"), and picks one at run time; so there is no include guard. The types (Problem, Segment, WorkItem,
// DType), kBlock and the SHUFFLE8 macro come from that file. The vector helpers are in kernel_simd.h, the unpacking
// of packed segments into tiles in kernel_unpack.h (included here, in this order).
//
// Notation: rows = n_rep * L_q query rows of one kv head (row r = rep * L_q + i), D head dim (a multiple of 8),
// G value group size, NG = D / G. Per work item the tokens go in blocks of at most kBlock tokens (a block never
// crosses a key chunk); a block's keys and values are unpacked into two small (kBlock, D) fp32 tiles that stay in L1.

#include "kernel_simd.h"
#include "kernel_unpack.h"
#ifdef CPU_OPS_VNNI
#include "kernel_int16.h"
#endif

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

// Soft-capping (Gemma 2) of the scores s (rows x n8, base 2): s = c * tanh(s / c) lane-wise, with tanh(y) =
// sign(y) (1 - e) / (1 + e), e = 2**(-2 log2(e) |y|) (exp2_neg; absolute error of s below c * 3e-7).
static inline void soft_cap(float* s, int rows, int n8, float c) {
  const v8f inv = bcast(1.0f / c), cv = bcast(c), zero{}, one = bcast(1.0f);
  for (int r = 0; r < rows; ++r)
    for (int t = 0; t < n8; t += 8) {
      const v8f y = load8(s + r * kBlock + t) * inv;
      const v8f a = y < zero ? -y : y;
      const v8f e = exp2_neg(a * -2.8853900817779268f);
      const v8f th = (one - e) / (one + e);
      store8(s + r * kBlock + t, (y < zero ? -th : th) * cv);
    }
}

// One online-softmax step (base 2) over a block: scores s (rows x n8, -inf where masked) become probabilities
// 2**(s - m_new); the running max m, sum l and output acc (rows x D) of each row are rescaled by 2**(m_old - m_new).
static inline void softmax_step(float* s, int rows, int n8, int D, float* m, float* l, float* acc) {
  for (int r = 0; r < rows; ++r) {
    float* sr = s + r * kBlock;
    v8f mv = bcast(-INFINITY);  // lane-wise max (a NaN score is never greater: skipped here, as below)
    for (int t = 0; t < n8; t += 8) {
      const v8f x = load8(sr + t);
      mv = x > mv ? x : mv;
    }
    const float mb = hmax(mv);
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

// AVX2: slices of 64 channels first, 8 independent accumulator chains keep both FMA ports busy (4 chains wait on
// the FMA latency); the baseline build keeps 32 (its 8-float vectors are register pairs: 8 would spill).
static inline void block_pv(const float* p, const float* v, int rows, int n, int D, float* acc) {
  int d0 = 0;
#ifdef CPU_OPS_AVX2
  for (; d0 + 64 <= D; d0 += 64) pv_slice<8>(p, v, rows, n, D, d0, acc);
#endif
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
  // (rows, D), pre-scaled; the full part's keys in a basis of their own: its codes' own query rows
  const int64_t q_off = (static_cast<int64_t>(w.b) * P.H_kv + w.h) * rows * D;
  const float* q = P.q + q_off;
  // a block of n tokens is computed as n8 (n rounded up to 8): tile rows [n, n8) are zero, their scores -inf
  auto softmax_block = [&](int n) {  // the block's scores -> probabilities (running max, sum and acc rescaled)
    const int n8 = (n + 7) & ~7;
    for (int r = 0; r < rows; ++r)
      for (int t = n; t < n8; ++t) s[r * kBlock + t] = -INFINITY;
    softmax_step(s.data(), rows, n8, D, m, l, acc);
  };
  auto clear_tail = [&](int n) {
    const int n8 = (n + 7) & ~7;
    std::memset(kt.data() + static_cast<int64_t>(n) * D, 0, static_cast<size_t>(n8 - n) * D * sizeof(float));
    std::memset(vt.data() + static_cast<int64_t>(n) * D, 0, static_cast<size_t>(n8 - n) * D * sizeof(float));
    return n8;
  };

  if (w.src == 0) {  // full-precision part: key t is visible to row r iff t <= R - L_q + r % L_q
    const int64_t base = w.b * P.f_sb + w.h * P.f_sh, first = P.f_start[w.b];
    // its exact head (tokens [first, first + S_head), model precision, the layer's basis) before the rest
    const int64_t head_end = std::max(w.lo, std::min<int64_t>(w.hi, first + P.S_head));
    const int64_t head_base = (static_cast<int64_t>(w.b) * P.H_kv + w.h) * P.S_head * D;
    for (int64_t a = w.lo, step = 0; a < w.hi; a += step) {
      const bool head = a < head_end;  // a block of head tokens only: they are scored with q
      const int n = static_cast<int>(std::min<int64_t>(kBlock, (head ? head_end : w.hi) - a));
      step = n;
      for (int t = 0; t < n; ++t) {
        if (head) {
          to_float(P.fhk, P.fh_dtype, head_base + (a + t - first) * D, D, kt.data() + t * D);
          to_float(P.fhv, P.fh_dtype, head_base + (a + t - first) * D, D, vt.data() + t * D);
        } else if (P.f_int8) {
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
      const int n8 = clear_tail(n);
      block_scores(!head && P.qf ? P.qf + q_off : q, bias.data(), kt.data(), rows, n8, D, s.data());
      if (P.softcap2 > 0.0f) soft_cap(s.data(), rows, n8, P.softcap2);
      if (a + n > P.R - P.L_q + 1) {  // the block reaches the queries' own tokens
        for (int r = 0; r < rows; ++r)
          for (int t = 0; t < n; ++t)
            if (a + t > P.R - P.L_q + r % P.L_q) s[r * kBlock + t] = -INFINITY;
      }
      softmax_block(n);
      block_pv(s.data(), vt.data(), rows, n, D, acc);
    }
    return;
  }

  const Segment& g = P.seg[w.src - 1];
  const int Dr = D - g.n_out, kDp = Dr * g.bits / 8 + g.n_out, vDp = D * g.vbits / 8, NG = D / g.G;
  const int64_t t0 = g.tok_off[w.b], c0 = g.chunk_off[w.b];
  // keys and values each in the tile order of their code width (INT3 orders as INT2)
  // (keys with outlier channels: kperm holds stored positions, then the outliers'; kch maps them to channels)
  std::vector<int> kperm = g.bits == 4 ? tile_order<4>(Dr) : tile_order<2>(Dr);
  for (int p = Dr; p < D; ++p) kperm.push_back(p);
  const int32_t* kch = g.n_out ? g.key_channels + static_cast<int64_t>(w.h) * D : nullptr;
  const std::vector<int> vperm = g.vbits == 4 ? tile_order<4>(D) : tile_order<2>(D);
  std::vector<int> lane_g(D), vgroup(D / 8);
  bool uniform = true;  // every 8 tile lanes in one value group (G >= 8 * PER, the usual case)
  for (int p = 0; p < D; ++p) {
    lane_g[p] = vperm[p] / g.G;
    uniform = uniform && lane_g[p] == lane_g[p & ~7];
    if (p % 8 == 0) vgroup[p / 8] = lane_g[p];
  }
  // runs: vector v in group v / vpg, every code byte in a whole group of 8 (unpack_value_runs)
  const int vper = g.vbits == 3 ? 4 : 8 / g.vbits, vpg_try = g.G / 8;
  bool runs = uniform && vpg_try % vper == 0 && (g.vbits == 3 ? D / 4 : vDp) % 8 == 0;
  for (int v = 0; runs && v < D / 8; ++v) runs = vgroup[v] == v / vpg_try;
  const int vpg = runs ? vpg_try : 0;
  std::vector<float> qp(static_cast<size_t>(rows) * D), qs(qp.size()), kscale(D), kzero(D), ks_tile(D),
      vsc(static_cast<size_t>(kBlock) * NG), vze(vsc.size()), lane_s(D), lane_z(D);
  std::vector<float> qz(kch ? static_cast<size_t>(rows) * D : 0);  // outlier channels: the queries in stored order
  for (int r = 0; r < rows; ++r)  // the queries in tile order
    for (int p = 0; p < D; ++p) {
      qp[r * D + p] = q[static_cast<int64_t>(r) * D + (kch ? kch[kperm[p]] : kperm[p])];
      if (kch) qz[r * D + p] = q[static_cast<int64_t>(r) * D + kch[p]];
    }
  const float* qzero = kch ? qz.data() : q;  // the queries as the zeros are ordered
  const uint8_t* kc = g.k_codes + static_cast<int64_t>(w.h) * g.N * kDp;
  const uint8_t* vc = g.v_codes + static_cast<int64_t>(w.h) * g.N * vDp;
  auto unpack_keys = g.bits == 2 ? unpack_key_block<2> : g.bits == 3 ? unpack_key_block<3> : unpack_key_block<4>;
  auto unpack_outliers = g.bits == 2   ? unpack_key_block_outliers<2>
                         : g.bits == 3 ? unpack_key_block_outliers<3>
                                       : unpack_key_block_outliers<4>;
  auto unpack_values = g.vbits == 2   ? unpack_value_block<2>
                       : g.vbits == 3 ? unpack_value_block<3>
                                      : unpack_value_block<4>;
#ifdef CPU_OPS_VNNI  // values in runs: P.V in 16-bit integers (kernel_int16.h)
  const bool pv16 = vpg != 0;
  std::vector<int32_t> vt16(pv16 ? static_cast<size_t>(kBlock / 2) * D : 0);
  Pv16Scratch pv16_scratch(pv16 ? rows : 0, pv16 ? NG : 0);
  auto unpack_pairs = g.vbits == 2   ? unpack_value_pairs<2>
                      : g.vbits == 3 ? unpack_value_pairs<3>
                                     : unpack_value_pairs<4>;
#endif
  int64_t chunk = -1;
  for (int64_t a = w.lo; a < w.hi;) {
    const int64_t c = c0 + (a - t0) / g.C;  // the chunk of token a; the block ends at the chunk's end
    const int n = static_cast<int>(std::min<int64_t>({kBlock, w.hi - a, t0 + (c - c0 + 1) * g.C - a}));
    if (c != chunk) {  // keys: q . k_t = sum_d (q_d * s_cd) * code_td + sum_d q_d * z_cd, scales once per chunk
      chunk = c;
      const int64_t blk = static_cast<int64_t>(w.h) * g.M + c;
      load_params(g, g.k_scale, g.k_zero, g.k_block, blk * D, blk, D, kscale.data(), kzero.data());
      for (int p = 0; p < D; ++p) ks_tile[p] = kscale[kperm[p]];
      for (int r = 0; r < rows; ++r) {
        v8f bz{};
        for (int d = 0; d < D; d += 8) {
          store8(qs.data() + r * D + d, load8(qp.data() + r * D + d) * load8(ks_tile.data() + d));
          bz += load8(qzero + static_cast<int64_t>(r) * D + d) * load8(kzero.data() + d);
        }
        bias[r] = hsum(bz);
      }
    }
    // values: code * vs + vz per token and group of G channels, dequantized into the tile (shared by all rows)
    const int64_t voff = (static_cast<int64_t>(w.h) * g.N + a) * NG;  // (the values' blocks: one per chunk too)
    load_params(g, g.v_scale, g.v_zero, g.v_block, voff, static_cast<int64_t>(w.h) * g.M + c,
                static_cast<int64_t>(n) * NG, vsc.data(), vze.data());
    if (kch)
      unpack_outliers(kc + a * kDp, n, D, g.n_out, kt.data());
    else
      unpack_keys(kc + a * kDp, n, D, kt.data());
#ifdef CPU_OPS_VNNI
    if (pv16)
      unpack_pairs(vc + a * vDp, n, D, vt16.data());
    else
#endif
      unpack_values(vc + a * vDp, n, D, NG, vsc.data(), vze.data(), vpg, uniform ? vgroup.data() : nullptr,
                    lane_g.data(), vt.data(), lane_s.data(), lane_z.data());
    const int n8 = clear_tail(n);
    block_scores(qs.data(), bias.data(), kt.data(), rows, n8, D, s.data());
    if (P.softcap2 > 0.0f) soft_cap(s.data(), rows, n8, P.softcap2);
    softmax_block(n);
#ifdef CPU_OPS_VNNI
    if (pv16)
      block_pv16(s.data(), rows, n, D, vpg, vsc.data(), vze.data(), vt16.data(), acc, pv16_scratch);
    else
#endif
      block_pv(s.data(), vt.data(), rows, n, D, acc);
    a += n;
  }
  for (int r = 0; r < rows; ++r) {  // the output back in channel order
    float* ar = acc + static_cast<int64_t>(r) * D;
    std::copy(ar, ar + D, lane_s.begin());
    for (int p = 0; p < D; ++p) ar[vperm[p]] = lane_s[p];
  }
}

// Runs every work item on `workers` threads of ATen's pool (dynamic scheduling; inline when workers is 1), then
// merges the partials of each (sequence, kv head) with a log-sum-exp reduction (and the row's sink, if any); out (B, H_q, L_q, D) contiguous, in
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
      // the sink of query head (h, rep): one more logit in the denominator, no value
      const float sink = P.sinks2 ? P.sinks2[(bh % P.H_kv) * P.n_rep + r / P.L_q] : -INFINITY;
      float mx = sink;
      for (int64_t i = first_item[bh]; i < first_item[bh + 1]; ++i) mx = std::max(mx, pm[i * rows + r]);
      std::fill(o.begin(), o.end(), 0.0f);
      float sum = sink == -INFINITY ? 0.0f : std::exp2(sink - mx);
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
