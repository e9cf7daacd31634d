// Fused split-precision decode attention over a full-precision part and packed INT4 / INT2 segments, on CPU.
// 8-bit scales / zeros (their uint8 codes and per-chunk blocks) and an int8 full part (codes and per-token scales) are
// read as stored and decoded on the way; with rotated storage the query is rotated in and the output rotated back here.
//
// Q.K and P.V are computed straight from the packed codes, block by block (one pass per segment, online softmax in
// base 2); no dequantized copy of the cache is formed, only a (32 tokens x D) tile per block that stays in L1:
//   keys (per channel within a chunk C): q . k_t = sum_d (q_d * s_cd) * code_td + sum_d q_d * z_cd, so the scales
//     multiply the query once per chunk and the key tile holds the bare codes;
//   values (per token, groups of G): the tile holds code * vs + vz (one FMA per 8 channels and token, shared by all
//     n_rep * L_q query rows), then P.V; the AVX-512 VNNI build instead keeps the codes as 16-bit pairs of tokens and
//     rounds p * vs to 16 bits (kernel_int16.h), where every vector of a tile is in one value group.
// Work items are token ranges of one (sequence, kv head, source); they run on ATen's (OpenMP) thread pool and their
// partial (max, sum, output) are merged by log-sum-exp, like flash decoding. The Python launcher
// (cpu_ops/attention.py) checks shapes and dtypes; this file only checks the offsets it will index with.
//
// (not <torch/extension.h>: these few headers halve the first-use compile time)
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>

#include "quantize.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
#define SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, v8i{__VA_ARGS__})
#endif

namespace {

constexpr int kBlock = 32;                   // tokens per inner block
constexpr int64_t kMinTokensPerWorker = 2048;  // (token, kv head) pairs per thread worth a parallel region

enum class DType { F32, BF16, F16 };

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    default: TORCH_CHECK_VALUE(false, "cpu_ops: unsupported dtype ", t.scalar_type());
  }
  return DType::F32;
}

struct Segment {  // one packed segment; shapes as in cpu_ops.split_precision_attention's docstring
  int bits, vbits, C, G;  // bits: the keys' code width; vbits: the values' (<= bits)
  int64_t N, M;  // tokens and chunks (per kv head)
  const uint8_t *k_codes, *v_codes;
  const void *k_scale, *k_zero, *v_scale, *v_zero;
  DType s_dtype;
  const int32_t *tok_off, *chunk_off;
  // 8-bit scales and zeros (hf_cocktail.params8): k_scale ... v_zero hold uint8 codes, decoded in the inner loop as
  // scale = s_max * table[code], zero = z_lo + code * z_step from the chunk's block (H_kv, M, 3) of b_dtype numbers
  const void *k_block, *v_block;  // null: the scales and zeros are numbers of s_dtype
  DType b_dtype;
  const float* table;  // (256,) fp32: 2 ** (-code / 16)
  // outlier key channels (hf_cocktail.key_outliers): per token the low-width codes of the first D - n_out stored
  // positions, then n_out 8-bit codes; k_scale / k_zero in the stored order; position p of head h is channel
  // key_channels[h * D + p]. n_out 0: none (key_channels null)
  int n_out;
  const int32_t* key_channels;
};

struct Problem {
  int B, H_kv, n_rep, L_q, D, rows;  // rows = n_rep * L_q query rows per kv head
  const float* q;                    // (B, H_kv, rows, D), pre-scaled by scaling * log2(e)
  const void *fk, *fv;               // full part (B, H_kv, R, D), element strides below
  DType f_dtype;
  int64_t R, f_sb, f_sh, f_st;
  // 8-bit full part (hf_cocktail.full_part.Int8FullPart): fk, fv hold int8 codes, token t's row times its scale
  bool f_int8;
  const void *fks, *fvs;  // with f_int8: their scales (B, H_kv, R, 1) of fs_dtype
  DType fs_dtype;
  int64_t fs_sb, fs_sh, fs_st;
  // rotated storage: per kv head, the query is multiplied by rot_q[h] (q . R) and the output by rot_o[h]^T
  const float *rot_q, *rot_o;  // (H_kv, D, D) fp32 each, or null
  // an 8-bit full part whose keys have a basis of their own (hf_cocktail.full_part.Int8FullPart.key_basis F): its
  // scores read these query rows, q . F from the unrotated query (B, H_kv, rows, D), pre-scaled as q; or null (q)
  const float* qf;
  // the full part's exact head (hf_cocktail.storage.exact_head): sequence b's tokens [f_start[b], f_start[b] + S_head)
  // read from fhk / fhv (B, H_kv, S_head, D) contiguous, of fh_dtype, instead of fk / fv; S_head 0: none
  const void *fhk, *fhv;
  DType fh_dtype;
  int64_t S_head;
  const int32_t* f_start;
  // gpt-oss attention sinks: query head hq's softmax denominator gains 2**sinks2[hq] (base 2), no value; or null
  const float* sinks2;
  // Gemma 2 soft-capping, base 2: a score s becomes softcap2 * tanh(s / softcap2) before the mask; 0: none
  float softcap2;
  int n_seg;
  Segment seg[2];
};

struct WorkItem {
  int b, h, src;  // src 0: full part, 1 + i: segment i
  int64_t lo, hi;  // token range: absolute indices into the full part's dim 2, or into the segment's token axis
};

}  // namespace

// The same computation compiled three times: for the baseline target, for AVX2 + FMA + F16C, and for that plus
// AVX-512 VNNI (packed values' P.V in 16-bit integers: kernel_int16.h), chosen at run time, so a build runs on any
// x86-64 CPU (and on other architectures, or with clang, as the baseline build alone).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define CPU_OPS_AVX2 1
namespace avx2 {
#include "kernel.h"
}  // namespace avx2
#undef CPU_OPS_AVX2
#pragma GCC pop_options
// AVX-512 VNNI (on 256-bit vectors, with AVX-512VL's 32 registers): the AVX2 build plus P.V of packed values in
// 16-bit integers (kernel_int16.h)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#define CPU_OPS_AVX2 1
#define CPU_OPS_VNNI 1
namespace vnni {
#include "kernel.h"
}  // namespace vnni
#undef CPU_OPS_VNNI
#undef CPU_OPS_AVX2
#pragma GCC pop_options
#define HAVE_AVX2_PATH 1
#endif
namespace base {
#include "kernel.h"
}  // namespace base

namespace {

struct Kernel {  // the build of kernel.h this CPU runs
  const char* target;
  void (*to_float)(const void*, DType, int64_t, int64_t, float*);
  void (*times_matrix)(const float*, const float*, int, bool, float*);
  void (*run_all)(const Problem&, const std::vector<WorkItem>&, const std::vector<int64_t>&, int64_t, void*, DType);
};

enum class Isa { Auto = 0, Baseline = 1, Avx2 = 2 };  // cpu_ops.attention's isa argument

// The build for `isa`: auto takes the fastest this CPU runs (vnni, else avx2, else baseline); avx2 never the 16-bit
// integer P.V.
const Kernel& kernel(Isa isa = Isa::Auto) {
  static const Kernel base_k{"baseline", base::to_float, base::times_matrix, base::run_all};
#ifdef HAVE_AVX2_PATH
  static const Kernel avx2_k{"avx2+fma+f16c", avx2::to_float, avx2::times_matrix, avx2::run_all};
  static const Kernel vnni_k{"avx512vnni", vnni::to_float, vnni::times_matrix, vnni::run_all};
  static const bool has_avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  static const bool has_vnni = has_avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  if (has_vnni && isa == Isa::Auto) return vnni_k;
  if (has_avx2 && isa != Isa::Baseline) return avx2_k;
#endif
  return base_k;
}

// Offsets are read here once; anything that would index out of bounds is refused (ValueError).
void check_offsets(const at::Tensor& off, int B, int64_t limit, const char* what, int i) {
  const int32_t* o = off.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(o[0] >= 0, "segments[", i, "]: ", what, "[0] must be >= 0, got ", o[0]);
  for (int b = 0; b < B; ++b)
    TORCH_CHECK_VALUE(o[b + 1] >= o[b], "segments[", i, "]: ", what, " must be non-decreasing, got ", o[b], " then ",
                      o[b + 1], " at b=", b);
  TORCH_CHECK_VALUE(o[B] <= limit, "segments[", i, "]: ", what, "[B]=", o[B], " exceeds the segment's size ", limit);
}

}  // namespace

// query (B, H_q, L_q, D) and full_keys / full_values (B, H_kv, R, D), unit last strides; full_start int32 (B,);
// seg_tensors: per segment k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, tok_off, chunk_off, k_block, v_block,
// key_channels (contiguous; k_block, v_block (H_kv, M, 3) with 8-bit scales and zeros (then k_scale ... v_zero are
// their uint8 codes), else empty; key_channels int32 (H_kv, D) with outlier key channels, else empty);
// seg_ints: per segment key bits, value bits, chunk_size, group_size, outlier key channels n_out; isa: 0 auto, 1
// the baseline build, 2 the avx2 build (fp32 arithmetic only) where the CPU has it;
// full_key_scales, full_value_scales: (B, H_kv, R, 1) for an int8 full part (full_keys / full_values its codes), else
// empty; rot_q, rot_o: (H_kv, D, D) fp32 or empty (rotated storage); rot_f: (H_kv, D, D) fp32 or empty (the full
// part's keys in a basis of their own: its scores use q . rot_f[h]); full_head_keys, full_head_values: (B, H_kv, S, D)
// contiguous, one float dtype, or empty (the full part's exact head); scale_table: (256,) fp32 or empty;
// sinks: (H_q,) fp32 attention-sink logits or empty; softcap: the logit soft-cap (> 0) or 0 for none.
// Returns (B, H_q, L_q, D) in query's dtype.
at::Tensor split_attention(const at::Tensor& query, const at::Tensor& full_keys, const at::Tensor& full_values,
                           const at::Tensor& full_start, const std::vector<at::Tensor>& seg_tensors,
                           const std::vector<int64_t>& seg_ints, double scaling, int64_t tokens_per_item,
                           int64_t isa, const at::Tensor& full_key_scales, const at::Tensor& full_value_scales,
                           const at::Tensor& rot_q, const at::Tensor& rot_o, const at::Tensor& rot_f,
                           const at::Tensor& full_head_keys, const at::Tensor& full_head_values,
                           const at::Tensor& scale_table,
                           const at::Tensor& sinks, double softcap) {
  TORCH_CHECK_VALUE(isa >= 0 && isa <= 2, "isa must be 0 (auto), 1 (baseline) or 2 (avx2), got ", isa);
  const Kernel& K = kernel(static_cast<Isa>(isa));
  Problem P{};
  P.B = static_cast<int>(query.size(0));
  P.H_kv = static_cast<int>(full_keys.size(1));
  P.n_rep = static_cast<int>(query.size(1) / P.H_kv);
  P.L_q = static_cast<int>(query.size(2));
  P.D = static_cast<int>(query.size(3));
  P.rows = P.n_rep * P.L_q;
  // the queries, pre-scaled by scaling * log2(e) (the softmax runs in base 2), as (B, H_kv, rows, D) fp32
  // (rotated storage: each row times its kv head's rot_q, q . R, first)
  // (the full part's keys in a basis of their own: a second copy, each row times rot_f instead)
  const size_t q_size = static_cast<size_t>(P.B) * P.H_kv * P.rows * P.D;
  std::vector<float> q(q_size), qf(rot_f.numel() ? q_size : 0), raw(P.D);
  const DType q_dtype = dtype_of(query);
  const float qscale = static_cast<float>(scaling * 1.4426950408889634);
  P.rot_q = rot_q.numel() ? rot_q.data_ptr<float>() : nullptr;
  P.rot_o = rot_o.numel() ? rot_o.data_ptr<float>() : nullptr;
  const float* rot_full = rot_f.numel() ? rot_f.data_ptr<float>() : nullptr;
  for (int64_t b = 0, row = 0; b < P.B; ++b)
    for (int64_t hq = 0; hq < query.size(1); ++hq)
      for (int64_t i = 0; i < P.L_q; ++i, ++row) {
        float* dst = q.data() + row * P.D;
        const int64_t mat = (hq / P.n_rep) * P.D * P.D;
        K.to_float(query.data_ptr(), q_dtype, b * query.stride(0) + hq * query.stride(1) + i * query.stride(2), P.D,
                   raw.data());
        if (P.rot_q)
          K.times_matrix(raw.data(), P.rot_q + mat, P.D, false, dst);
        else
          std::copy(raw.begin(), raw.end(), dst);
        for (int d = 0; d < P.D; ++d) dst[d] *= qscale;
        if (rot_full) {
          float* fdst = qf.data() + row * P.D;
          K.times_matrix(raw.data(), rot_full + mat, P.D, false, fdst);
          for (int d = 0; d < P.D; ++d) fdst[d] *= qscale;
        }
      }
  P.q = q.data();
  P.qf = rot_full ? qf.data() : nullptr;
  P.fk = full_keys.data_ptr();
  P.fv = full_values.data_ptr();
  P.f_int8 = full_keys.scalar_type() == at::kChar;
  P.f_dtype = P.f_int8 ? DType::F32 : dtype_of(full_keys);  // (int8 codes: read with their scales)
  P.R = full_keys.size(2);
  P.f_sb = full_keys.stride(0), P.f_sh = full_keys.stride(1), P.f_st = full_keys.stride(2);
  TORCH_CHECK_VALUE(full_values.strides() == full_keys.strides(),
                    "full_values must have the strides of full_keys, got ", full_values.strides(), " and ",
                    full_keys.strides());
  if (P.f_int8) {
    TORCH_CHECK_VALUE(full_key_scales.dim() == 4 && full_key_scales.size(2) == P.R,
                      "an int8 full part needs full_key_scales (B, H_kv, R, 1)");
    P.fks = full_key_scales.data_ptr(), P.fvs = full_value_scales.data_ptr();
    TORCH_CHECK_VALUE(full_value_scales.strides() == full_key_scales.strides(),
                      "full_value_scales must have the strides of full_key_scales");
    P.fs_dtype = dtype_of(full_key_scales);
    P.fs_sb = full_key_scales.stride(0), P.fs_sh = full_key_scales.stride(1), P.fs_st = full_key_scales.stride(2);
  }
  P.S_head = full_head_keys.numel() ? full_head_keys.size(2) : 0;
  if (P.S_head) {
    TORCH_CHECK_VALUE(full_head_keys.dim() == 4 && full_head_keys.size(0) == P.B && full_head_keys.size(1) == P.H_kv &&
                          full_head_keys.size(3) == P.D && full_head_keys.is_contiguous() &&
                          full_head_values.sizes() == full_head_keys.sizes() && full_head_values.is_contiguous() &&
                          full_head_values.scalar_type() == full_head_keys.scalar_type(),
                      "full_head keys and values must be contiguous (B, H_kv, S, D) of one dtype, got ",
                      full_head_keys.sizes(), " and ", full_head_values.sizes());
    P.fhk = full_head_keys.data_ptr(), P.fhv = full_head_values.data_ptr();
    P.fh_dtype = dtype_of(full_head_keys);
  }
  P.f_start = full_start.data_ptr<int32_t>();
  std::vector<float> sinks2(sinks.numel());  // in base 2, as the scores
  TORCH_CHECK_VALUE(sinks.numel() == 0 || sinks.numel() == query.size(1), "sinks must have H_q=", query.size(1),
                    " elements, got ", sinks.numel());
  for (int64_t i = 0; i < sinks.numel(); ++i) sinks2[i] = sinks.data_ptr<float>()[i] * 1.4426950408889634f;
  P.sinks2 = sinks.numel() ? sinks2.data() : nullptr;
  TORCH_CHECK_VALUE(softcap >= 0.0 && std::isfinite(softcap), "softcap must be > 0 (or 0: none), got ", softcap);
  P.softcap2 = static_cast<float>(softcap * 1.4426950408889634);
  for (int b = 0; b < P.B; ++b)
    TORCH_CHECK_VALUE(P.f_start[b] >= 0 && P.f_start[b] <= P.R - P.S_head, "full_start[", b, "] must be in [0, R=",
                      P.R, P.S_head ? " minus the exact head's tokens" : "", "], got ", P.f_start[b]);
  P.n_seg = static_cast<int>(seg_ints.size() / 5);
  for (int i = 0; i < P.n_seg; ++i) {
    const at::Tensor* t = seg_tensors.data() + 11 * i;
    Segment& g = P.seg[i];
    g.bits = static_cast<int>(seg_ints[5 * i]);
    g.vbits = static_cast<int>(seg_ints[5 * i + 1]);
    g.C = static_cast<int>(seg_ints[5 * i + 2]);
    g.G = static_cast<int>(seg_ints[5 * i + 3]);
    g.n_out = static_cast<int>(seg_ints[5 * i + 4]);
    TORCH_CHECK_VALUE(g.n_out == 0 || (t[10].numel() == static_cast<int64_t>(P.H_kv) * P.D && !t[8].numel()),
                      "segments[", i, "]: outlier key channels need channels (H_kv, D) and 16-bit scales");
    g.key_channels = g.n_out ? t[10].data_ptr<int32_t>() : nullptr;
    g.N = t[0].size(1), g.M = t[1].size(1);
    g.k_codes = t[0].data_ptr<uint8_t>(), g.v_codes = t[3].data_ptr<uint8_t>();
    g.k_scale = t[1].data_ptr(), g.k_zero = t[2].data_ptr(), g.v_scale = t[4].data_ptr(), g.v_zero = t[5].data_ptr();
    g.k_block = t[8].numel() ? t[8].data_ptr() : nullptr;
    g.v_block = t[9].numel() ? t[9].data_ptr() : nullptr;
    if (g.k_block) {
      TORCH_CHECK_VALUE(scale_table.numel() == 256, "segments[", i, "]: 8-bit scales and zeros need scale_table");
      g.b_dtype = dtype_of(t[8]);
      g.table = scale_table.data_ptr<float>();
    } else {
      g.s_dtype = dtype_of(t[1]);
    }
    g.tok_off = t[6].data_ptr<int32_t>(), g.chunk_off = t[7].data_ptr<int32_t>();
    check_offsets(t[6], P.B, g.N, "tok_off", i);
    check_offsets(t[7], P.B, g.M, "chunk_off", i);
    for (int b = 0; b < P.B; ++b) {
      const int64_t n = g.tok_off[b + 1] - g.tok_off[b], need = (n + g.C - 1) / g.C;
      TORCH_CHECK_VALUE(g.chunk_off[b + 1] - g.chunk_off[b] >= need, "segments[", i, "]: sequence ", b, " owns ", n,
                        " tokens (", need, " chunks of ", g.C, ") but only ", g.chunk_off[b + 1] - g.chunk_off[b],
                        " chunks in chunk_off");
    }
  }

  // work items: every (sequence, kv head, source) cut into ranges of at most tokens_per_item tokens
  std::vector<WorkItem> items;
  std::vector<int64_t> first_item;
  for (int b = 0; b < P.B; ++b)
    for (int h = 0; h < P.H_kv; ++h) {
      first_item.push_back(static_cast<int64_t>(items.size()));
      for (int src = 0; src <= P.n_seg; ++src) {
        const int64_t lo = src == 0 ? P.f_start[b] : P.seg[src - 1].tok_off[b];
        const int64_t hi = src == 0 ? P.R : P.seg[src - 1].tok_off[b + 1];
        for (int64_t a = lo; a < hi; a += tokens_per_item)
          items.push_back({b, h, src, a, std::min(hi, a + tokens_per_item)});
      }
    }
  first_item.push_back(static_cast<int64_t>(items.size()));

  // workers: enough threads that each gets >= kMinTokensPerWorker tokens (small problems run inline, no parallel
  // region), at most one per item
  int64_t tokens = 0;
  for (const WorkItem& w : items) tokens += w.hi - w.lo;
  const int64_t workers = std::max<int64_t>(
      1, std::min<int64_t>({at::get_num_threads(), static_cast<int64_t>(items.size()), tokens / kMinTokensPerWorker}));
  at::Tensor out = at::empty({P.B, P.H_kv * P.n_rep, P.L_q, P.D}, query.options());
  K.run_all(P, items, first_item, workers, out.data_ptr(), q_dtype);
  return out;
}

std::string kernel_target() { return kernel().target; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("split_attention", &split_attention, "fused split-precision decode attention (see cpu_ops/attention.py)",
        py::call_guard<py::gil_scoped_release>());
  m.def("kernel_target", &kernel_target, "instruction set the kernel runs with on this CPU");
  m.def("quantize_keys", &cpu_ops_quant::quantize_keys, "fused key quantization (see cpu_ops/quantize.py)",
        py::call_guard<py::gil_scoped_release>());
  m.def("quantize_values", &cpu_ops_quant::quantize_values, "fused value quantization (see cpu_ops/quantize.py)",
        py::call_guard<py::gil_scoped_release>());
  m.def("append_tokens8", &cpu_ops_quant::append_tokens8, "fused 8-bit full-part append (see cpu_ops/quantize.py)",
        py::call_guard<py::gil_scoped_release>());
  m.def("append_tokens", &cpu_ops_quant::append_tokens, "fused full-part append (see cpu_ops/quantize.py)",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_params8", &cpu_ops_quant::decode_params8, "8-bit scales and zeros -> numbers (cpu_ops/quantize.py)",
        py::call_guard<py::gil_scoped_release>());
}
