// quantreg-cpu-mxfp4: the MoE forward over packed MXFP4 experts (torch op + Python module).
//
// moe_forward(x, topk_ids, topk_weights, w13, w13_scale, w13_bias?, w2, w2_scale, w2_bias?,
//             activation, alpha, limit, isa) -> out
//
// Steps (all in this file, threaded with at::parallel_for = torch's intra-op threads):
//  1. group the (token, slot) pairs by local expert (counting sort; ids outside [0, E) dropped);
//  2. quantise every token's x to Q8 blocks (gemv.h), once per token;
//  3. w13 GEMV over (expert, row block) jobs, only the routed experts' bytes are read;
//  4. bias + activation per routed pair, the result quantised to Q8 again;
//  5. w2 GEMV the same way;
//  6. per token, sum_k weight_k * (y_k + b2_e) in slot order (deterministic), to x's dtype.
// Prefill: an expert with >= gemm_min_tokens routed tokens skips the Q8 GEMVs (compute-bound
// there) and takes steps 3 and 5 as bf16 GEMMs instead: (expert, 256-row tile) jobs, each decodes
// its tile to bf16 exactly (decode_bf16.cpp) into a scratch tensor freed after the job (weights
// stay packed) and calls at::mm (oneDNN: AMX / AVX-512 BF16 where present) on the expert's
// tokens in bf16; its activation is kept in bf16, not Q8. Error: that of bf16 activations and
// bf16 GEMM outputs, like mxfp4_reference's.
// Jobs are handed out by an atomic counter inside one parallel region, so experts with more
// tokens do not leave the other threads idle.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "gemv.h"

namespace quantreg_cpu_mxfp4 {
namespace {

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

bool cpu_supports(const std::string& isa) {
  if (isa == "avx2") return cpu_has_avx2();
  if (isa == "avx512") return cpu_has_avx512();
  TORCH_CHECK(false, "quantreg_cpu_mxfp4: unknown ISA '", isa, "' (expected 'avx2' or 'avx512')");
}

// Run fn(job) for job in [0, njobs) on torch's intra-op threads, jobs taken in order from a
// shared counter (dynamic balance; jobs must be independent).
template <class Fn>
void run_jobs(int64_t njobs, const Fn& fn) {
  if (njobs <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), njobs);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (;;) {
      const int64_t job = next.fetch_add(1, std::memory_order_relaxed);
      if (job >= njobs) break;
      fn(job);
    }
  });
}

// x (K floats) -> Q8 blocks (gemv.h). Per block of 32: d = amax / 127, q = round(x / d) in
// [-127, 127]. A block with a non-finite value gets scale NaN (its outputs become NaN, as in
// float math).
void quantize_q8(const float* x, int64_t k, uint8_t* dst) {
  const int64_t nb = k / 32;
  for (int64_t b = 0; b < nb; ++b) {
    const float* v = x + b * 32;
    float amax = 0.f;
    bool finite = true;
    for (int i = 0; i < 32; ++i) {
      finite = finite && std::isfinite(v[i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    int8_t q[32] = {};
    float scale = 0.f;
    if (!finite) {
      scale = std::numeric_limits<float>::quiet_NaN();
    } else if (amax > 0.f) {
      scale = amax / 127.f;
      const float inv = 127.f / amax;
      for (int i = 0; i < 32; ++i)
        q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(v[i] * inv))));
    }
    uint8_t* blk = dst + b * kQ8BlockBytes;
    int32_t sum = 0;
    for (int d = 0; d < 4; ++d)
      for (int i = 0; i < 4; ++i) {
        blk[8 * d + i] = static_cast<uint8_t>(q[8 * d + 2 * i]);
        blk[8 * d + 4 + i] = static_cast<uint8_t>(q[8 * d + 2 * i + 1]);
      }
    for (int i = 0; i < 32; ++i) sum += q[i];
    const int32_t corr = -12 * sum;
    const float half = scale * 0.5f;
    std::memcpy(blk + 32, &corr, 4);
    std::memcpy(blk + 36, &half, 4);
  }
}

// Element i of block b of a Q8 row, as the int8 stored for it (the inverse of the order above).
inline int8_t q8_element(const uint8_t* blk, int i) {
  const int d = i / 8, j = i % 8;
  return static_cast<int8_t>(blk[8 * d + (j % 2) * 4 + j / 2]);
}

// Q8 with a residual ("q8x2"): dst_hi = Q8(x), dst_lo = Q8(x - dequant(dst_hi)). The GEMV runs
// both as two activation rows and adds the results: the residual's per-element error is
// 1/254 of plain Q8's, at no extra weight traffic (the weights are decoded once per token tile).
void quantize_q8x2(const float* x, int64_t k, uint8_t* dst_hi, uint8_t* dst_lo, float* scratch) {
  quantize_q8(x, k, dst_hi);
  for (int64_t b = 0; b < k / 32; ++b) {
    const uint8_t* blk = dst_hi + b * kQ8BlockBytes;
    float half_scale;
    std::memcpy(&half_scale, blk + 36, sizeof half_scale);
    const float d = half_scale * 2.f;
    for (int i = 0; i < 32; ++i) scratch[b * 32 + i] = x[b * 32 + i] - d * static_cast<float>(q8_element(blk, i));
  }
  quantize_q8(scratch, k, dst_lo);
}

// The rows of an expert past its last whole 16-row group (row-major, fewer than 16; gemv.h):
// plain C, any ISA, the same integer arithmetic as the SIMD kernels.
void gemv_tail(const GemvJob& job) {
  const int64_t nb = job.k / 32;
  for (int64_t row = job.row_begin; row < job.row_end; ++row) {
    const uint8_t* w = job.blocks + row * (job.k / 2);
    const uint8_t* s = job.scales + row * nb;
    for (int64_t m = 0; m < job.m; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* a = job.act[m] + b * kQ8BlockBytes;
        int32_t dot;
        std::memcpy(&dot, a + 32, 4);
        for (int d = 0; d < 4; ++d)
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = w[b * 16 + 4 * d + i];
            dot += kCodeTable[byte & 15] * static_cast<int8_t>(a[8 * d + i]) +
                   kCodeTable[byte >> 4] * static_cast<int8_t>(a[8 * d + 4 + i]);
          }
        const uint32_t bits = static_cast<uint32_t>(s[b]) << 23;  // 2^(e-127); 0 -> 0, 255 -> inf
        float ws, as;
        std::memcpy(&ws, &bits, 4);
        std::memcpy(&as, a + 36, 4);
        acc += static_cast<float>(dot) * (ws * as);
      }
      job.out[m][row] = acc;
    }
  }
}

inline float load_float(const void* base, at::ScalarType dtype, int64_t i) {
  switch (dtype) {
    case at::kBFloat16: return static_cast<float>(static_cast<const c10::BFloat16*>(base)[i]);
    case at::kHalf: return static_cast<float>(static_cast<const c10::Half*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf,
              "quantreg_cpu_mxfp4: ", name, " must be bfloat16, float16 or float32, got ", t.scalar_type());
}

struct Stack {
  const uint8_t* blocks;
  const uint8_t* scales;
  int64_t e, n, k;
};

Stack check_stack(const at::Tensor& blocks, const at::Tensor& scales, const char* name) {
  TORCH_CHECK(blocks.device().is_cpu() && scales.device().is_cpu(), "quantreg_cpu_mxfp4: ", name,
              " must be on the CPU");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && scales.scalar_type() == at::kByte, "quantreg_cpu_mxfp4: ", name,
              " blocks and scales must be uint8, got ", blocks.scalar_type(), " and ", scales.scalar_type());
  TORCH_CHECK(blocks.dim() == 3 && scales.dim() == 3, "quantreg_cpu_mxfp4: ", name,
              " blocks must be [E, N, K/2] and scales [E, N, K/32], got ", blocks.sizes(), " and ", scales.sizes());
  TORCH_CHECK(blocks.is_contiguous() && scales.is_contiguous(), "quantreg_cpu_mxfp4: ", name,
              " blocks and scales must be contiguous");
  const int64_t e = blocks.size(0), n = blocks.size(1), k = blocks.size(2) * 2;
  TORCH_CHECK(k % 32 == 0 && k > 0, "quantreg_cpu_mxfp4: ", name, " K = ", k, " must be a positive multiple of 32");
  TORCH_CHECK(scales.size(0) == e && scales.size(1) == n && scales.size(2) == k / 32, "quantreg_cpu_mxfp4: ", name,
              " scales ", scales.sizes(), " do not match blocks ", blocks.sizes(), " (expected [", e, ", ", n, ", ",
              k / 32, "])");
  return {blocks.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), e, n, k};
}

void check_bias(const std::optional<at::Tensor>& bias, int64_t e, int64_t n, const char* name) {
  if (!bias.has_value()) return;
  check_float(*bias, name);
  TORCH_CHECK(bias->device().is_cpu() && bias->is_contiguous(), "quantreg_cpu_mxfp4: ", name,
              " must be a contiguous CPU tensor");
  TORCH_CHECK(bias->dim() == 2 && bias->size(0) == e && bias->size(1) == n, "quantreg_cpu_mxfp4: ", name,
              " must be [", e, ", ", n, "], got ", bias->sizes());
}

// The routed pairs [begin, end) of one local expert e (pairs are stored in expert order).
struct Group {
  int64_t e, begin, end;
};

// Rows per GEMV job (16 groups of 16; one sequential stream of 368 KB at K=2880): 1 token over 4
// GPT-OSS-20B experts still gives 92 + 48 jobs for the threads to balance. Measured at 1 token,
// 1 thread, against 64 rows (interleaved, load ~3): 3-7 % faster (fewer stream restarts).
constexpr int64_t kRowsPerJob = 256;

// Job `block` (rows [block * kRowsPerJob, +kRowsPerJob)) of one expert group's GEMV. act/out hold
// `per` activation rows per routed pair (1 for Q8, 2 for q8x2), pairs in expert order.
void gemv_one(void (*gemv)(const GemvJob&), const Stack& w, const Group& grp, int64_t block,
              const uint8_t* const* act, float* const* out, int64_t per) {
  const int64_t row_bytes = w.k / 2, row_scales = w.k / 32, body = w.n - w.n % kRowGroup;
  GemvJob g;
  g.blocks = w.blocks + grp.e * w.n * row_bytes;
  g.scales = w.scales + grp.e * w.n * row_scales;
  g.k = w.k;
  g.act = act + per * grp.begin;
  g.out = out + per * grp.begin;
  g.m = per * (grp.end - grp.begin);
  const int64_t begin = block * kRowsPerJob, end = std::min(w.n, begin + kRowsPerJob);
  g.row_begin = begin;
  g.row_end = std::min(end, body);  // whole 16-row groups: the SIMD kernel
  if (g.row_begin < g.row_end) gemv(g);
  g.row_begin = std::max(begin, body);
  g.row_end = end;  // the row-major tail
  if (g.row_begin < g.row_end) gemv_tail(g);
}

int64_t jobs_per_expert(const Stack& w) { return (w.n + kRowsPerJob - 1) / kRowsPerJob; }

void run_gemv(void (*gemv)(const GemvJob&), const Stack& w, const std::vector<Group>& groups,
              const std::vector<const uint8_t*>& act, const std::vector<float*>& out, int64_t per) {
  const int64_t bpe = jobs_per_expert(w);
  run_jobs(static_cast<int64_t>(groups.size()) * bpe, [&](int64_t job) {
    gemv_one(gemv, w, groups[static_cast<size_t>(job / bpe)], job % bpe, act.data(), out.data(), per);
  });
}

// Rows per prefill GEMM job: a 256 x 2880 bf16 tile is 1.4 MiB (stays in L2/LLC between its
// decode and the GEMM that reads it) and GPT-OSS-20B's 5760 / 2880 rows give 23 / 12 jobs per
// expert, enough to balance the threads.
constexpr int64_t kGemmRows = 256;

// out[r * w.n + row] = sum_k W_e[row, k] * in[r, k] for the pairs r of every group, W decoded
// tile by tile to bf16; in: bf16 [routed, K]. at::mm inside the parallel region runs on the
// calling thread (ATen and oneDNN do not nest), so the jobs are the only parallelism.
void run_gemm(const Stack& w, const std::vector<Group>& groups, const at::Tensor& in, float* out) {
  const int64_t tiles = (w.n + kGemmRows - 1) / kGemmRows;
  const int64_t njobs = static_cast<int64_t>(groups.size()) * tiles;
  run_jobs(njobs, [&](int64_t job) {
    const Group& grp = groups[static_cast<size_t>(job / tiles)];
    const int64_t row0 = (job % tiles) * kGemmRows, rows = std::min(kGemmRows, w.n - row0);
    at::Tensor tile = at::empty({rows, w.k}, in.options());
    decode_rows_bf16_avx2(w.blocks + grp.e * w.n * (w.k / 2), w.scales + grp.e * w.n * (w.k / 32), w.n, row0, rows,
                          w.k, reinterpret_cast<uint16_t*>(tile.data_ptr<c10::BFloat16>()));
    const at::Tensor res = at::mm(in.narrow(0, grp.begin, grp.end - grp.begin), tile.t()).contiguous();
    const c10::BFloat16* rp = res.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < grp.end - grp.begin; ++i)
      for (int64_t j = 0; j < rows; ++j)
        out[(grp.begin + i) * w.n + row0 + j] = static_cast<float>(rp[i * rows + j]);
  });
}

at::Tensor moe_forward(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const at::Tensor& w13, const at::Tensor& w13_scale, const std::optional<at::Tensor>& w13_bias,
                       const at::Tensor& w2, const at::Tensor& w2_scale, const std::optional<at::Tensor>& w2_bias,
                       const std::string& activation, double alpha, double limit, const std::string& isa,
                       const std::string& precision, int64_t gemm_min_tokens) {
  TORCH_CHECK(precision == "q8" || precision == "q8x2", "quantreg_cpu_mxfp4: precision must be 'q8' or 'q8x2', "
              "got '", precision, "'");
  const int64_t per = precision == "q8x2" ? 2 : 1;
  TORCH_CHECK(activation == "swigluoai" || activation == "silu", "quantreg_cpu_mxfp4: activation must be "
              "'swigluoai' or 'silu', got '", activation, "'");
  TORCH_CHECK(cpu_supports(isa), "quantreg_cpu_mxfp4: this CPU does not support the '", isa, "' path");
  void (*gemv)(const GemvJob&) = isa == "avx512" ? gemv_avx512 : gemv_avx2;
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "quantreg_cpu_mxfp4: x must be a contiguous "
              "CPU tensor [T, H], got ", x.sizes());
  check_float(x, "x");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) && topk_ids.is_contiguous() &&
              (topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong),
              "quantreg_cpu_mxfp4: topk_ids must be contiguous int32/int64 [T, k] with T = ", x.size(0), ", got ",
              topk_ids.scalar_type(), " ", topk_ids.sizes());
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "quantreg_cpu_mxfp4: topk_weights ", topk_weights.sizes(),
              " must match topk_ids ", topk_ids.sizes());
  check_float(topk_weights, "topk_weights");
  const Stack s13 = check_stack(w13, w13_scale, "w13");
  const Stack s2 = check_stack(w2, w2_scale, "w2");
  const int64_t T = x.size(0), H = x.size(1), topk = topk_ids.size(1), E = s13.e;
  TORCH_CHECK(s2.e == E, "quantreg_cpu_mxfp4: w13 has ", E, " experts, w2 ", s2.e);
  TORCH_CHECK(s13.k == H, "quantreg_cpu_mxfp4: w13 K = ", s13.k, " must equal x's hidden size ", H);
  TORCH_CHECK(s13.n % 2 == 0 && s13.n / 2 == s2.k, "quantreg_cpu_mxfp4: w13 rows (", s13.n,
              ") must be 2 x w2's K (", s2.k, ")");
  TORCH_CHECK(s2.n == H, "quantreg_cpu_mxfp4: w2 rows (", s2.n, ") must equal the hidden size ", H);
  check_bias(w13_bias, E, s13.n, "w13_bias");
  check_bias(w2_bias, E, s2.n, "w2_bias");
  const int64_t I = s2.k, N1 = s13.n;

  at::Tensor out = at::zeros({T, H}, x.options());
  if (T == 0 || topk == 0 || E == 0) return out;
  at::Tensor weights_f = topk_weights.to(at::kFloat).contiguous();
  const float* wts = weights_f.data_ptr<float>();

  // 1. Group (token, slot) pairs by expert: counting sort, stable in token order.
  const int64_t pairs = T * topk;
  std::vector<int64_t> local(static_cast<size_t>(pairs));
  if (topk_ids.scalar_type() == at::kInt) {
    const int32_t* p = topk_ids.data_ptr<int32_t>();
    for (int64_t i = 0; i < pairs; ++i) local[static_cast<size_t>(i)] = p[i];
  } else {
    const int64_t* p = topk_ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < pairs; ++i) local[static_cast<size_t>(i)] = p[i];
  }
  std::vector<int64_t> count(static_cast<size_t>(E) + 1, 0);
  for (int64_t id : local)
    if (id >= 0 && id < E) ++count[static_cast<size_t>(id)];
  std::vector<int64_t> experts, offsets{0};
  std::vector<int64_t> start(static_cast<size_t>(E), 0);
  for (int64_t e = 0; e < E; ++e) {
    if (count[static_cast<size_t>(e)] == 0) continue;
    start[static_cast<size_t>(e)] = offsets.back();
    experts.push_back(e);
    offsets.push_back(offsets.back() + count[static_cast<size_t>(e)]);
  }
  const int64_t routed = offsets.back();
  if (routed == 0) return out;
  // Which experts take the GEMM path (gemm_min_tokens <= 0: none).
  std::vector<Group> small, big;
  std::vector<char> big_pair(static_cast<size_t>(routed), 0);
  for (size_t i = 0; i < experts.size(); ++i) {
    const Group g{experts[i], offsets[i], offsets[i + 1]};
    if (gemm_min_tokens > 0 && g.end - g.begin >= gemm_min_tokens) {
      big.push_back(g);
      std::fill(big_pair.begin() + g.begin, big_pair.begin() + g.end, 1);
    } else {
      small.push_back(g);
    }
  }
  std::vector<int64_t> pair_of(static_cast<size_t>(routed));   // routed index -> t * topk + slot
  std::vector<int64_t> routed_of(static_cast<size_t>(pairs), -1);  // t * topk + slot -> routed index
  std::vector<int64_t> expert_of(static_cast<size_t>(routed));
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t id = local[static_cast<size_t>(i)];
    if (id < 0 || id >= E) continue;
    const int64_t r = start[static_cast<size_t>(id)]++;
    pair_of[static_cast<size_t>(r)] = i;
    routed_of[static_cast<size_t>(i)] = r;
    expert_of[static_cast<size_t>(r)] = id;
  }

  // 2. Q8 of every token's x.
  const int64_t q1 = (H / 32) * kQ8BlockBytes, q2 = (I / 32) * kQ8BlockBytes;
  std::vector<uint8_t> qx(static_cast<size_t>(per * T * q1));
  const void* xp = x.data_ptr();
  const at::ScalarType xdt = x.scalar_type();
  run_jobs(T, [&](int64_t t) {
    std::vector<float> row(static_cast<size_t>(2 * H));
    for (int64_t h = 0; h < H; ++h) row[static_cast<size_t>(h)] = load_float(xp, xdt, t * H + h);
    if (per == 2) {
      quantize_q8x2(row.data(), H, qx.data() + 2 * t * q1, qx.data() + (2 * t + 1) * q1, row.data() + H);
    } else {
      quantize_q8(row.data(), H, qx.data() + t * q1);
    }
  });

  // 3. w13.
  // Row j of a pair's `per` rows: its Q8 part j; the residual's output goes to a second buffer.
  std::vector<float> h13(static_cast<size_t>(per * routed * N1));
  std::vector<const uint8_t*> act(static_cast<size_t>(per * routed));
  std::vector<float*> dst(static_cast<size_t>(per * routed));
  for (int64_t r = 0; r < routed; ++r) {
    const int64_t t = pair_of[static_cast<size_t>(r)] / topk;
    for (int64_t j = 0; j < per; ++j) {
      act[static_cast<size_t>(per * r + j)] = qx.data() + (per * t + j) * q1;
      dst[static_cast<size_t>(per * r + j)] = h13.data() + (j * routed + r) * N1;
    }
  }
  // The GEMM experts' tokens in bf16, one row per routed pair (rows of GEMV pairs unused).
  const at::TensorOptions bf16 = x.options().dtype(at::kBFloat16);
  at::Tensor xb = big.empty() ? at::Tensor() : at::empty({routed, H}, bf16);
  at::Tensor ab = big.empty() ? at::Tensor() : at::empty({routed, I}, bf16);
  if (!big.empty()) {
    c10::BFloat16* xbp = xb.data_ptr<c10::BFloat16>();
    run_jobs(routed, [&](int64_t r) {
      if (!big_pair[static_cast<size_t>(r)]) return;
      const int64_t t = pair_of[static_cast<size_t>(r)] / topk;
      for (int64_t h = 0; h < H; ++h) xbp[r * H + h] = c10::BFloat16(load_float(xp, xdt, t * H + h));
    });
  }

  // 4. Bias, activation, Q8.
  std::vector<uint8_t> qa(static_cast<size_t>(per * routed * q2));
  const bool oai = activation == "swigluoai";
  const float fa = static_cast<float>(alpha), fl = static_cast<float>(limit);
  const auto activate = [&](int64_t r) {
    const int64_t e = expert_of[static_cast<size_t>(r)];
    float* h = h13.data() + r * N1;
    if (per == 2) {
      const float* residual = h13.data() + (routed + r) * N1;
      for (int64_t n = 0; n < N1; ++n) h[n] += residual[n];
    }
    if (w13_bias.has_value()) {
      const void* b = w13_bias->data_ptr();
      const at::ScalarType bdt = w13_bias->scalar_type();
      for (int64_t n = 0; n < N1; ++n) h[n] += load_float(b, bdt, e * N1 + n);
    }
    std::vector<float> a(static_cast<size_t>(2 * I));
    for (int64_t i = 0; i < I; ++i) {
      if (oai) {
        const float g = h[2 * i], u = h[2 * i + 1];
        const float gate = g > fl ? fl : g;  // NaN stays NaN, as torch.clamp
        const float up = u > fl ? fl : (u < -fl ? -fl : u);
        a[static_cast<size_t>(i)] = (up + 1.f) * gate / (1.f + std::exp(-fa * gate));
      } else {
        const float g = h[i], u = h[I + i];
        a[static_cast<size_t>(i)] = g / (1.f + std::exp(-g)) * u;
      }
    }
    if (big_pair[static_cast<size_t>(r)]) {
      c10::BFloat16* abp = ab.data_ptr<c10::BFloat16>() + r * I;
      for (int64_t i = 0; i < I; ++i) abp[i] = c10::BFloat16(a[static_cast<size_t>(i)]);
    } else if (per == 2) {
      quantize_q8x2(a.data(), I, qa.data() + 2 * r * q2, qa.data() + (2 * r + 1) * q2, a.data() + I);
    } else {
      quantize_q8(a.data(), I, qa.data() + r * q2);
    }
  };

  // 5. w2 (its own buffer: routed * H <= routed * 2I is not guaranteed).
  std::vector<float> y(static_cast<size_t>(per * routed * H));
  std::vector<const uint8_t*> act2(static_cast<size_t>(per * routed));
  std::vector<float*> dst2(static_cast<size_t>(per * routed));
  for (int64_t r = 0; r < routed; ++r) {
    for (int64_t j = 0; j < per; ++j) {
      act2[static_cast<size_t>(per * r + j)] = qa.data() + (per * r + j) * q2;
      dst2[static_cast<size_t>(per * r + j)] = y.data() + (j * routed + r) * H;
    }
  }
  // Three parallel regions, not one: measured at 1 token (2 threads, interleaved, quiet), one
  // region where the thread finishing an expert's last w13 job activates it and w2 jobs wait for
  // that was 7-8 % slower than these barriers.
  run_gemv(gemv, s13, small, act, dst, per);
  if (!big.empty()) run_gemm(s13, big, xb, h13.data());
  run_jobs(routed, activate);
  run_gemv(gemv, s2, small, act2, dst2, per);
  if (!big.empty()) run_gemm(s2, big, ab, y.data());

  // 6. Weighted sum per token, slots in order.
  void* op = out.data_ptr();
  run_jobs(T, [&](int64_t t) {
    std::vector<float> acc(static_cast<size_t>(H), 0.f);
    for (int64_t s = 0; s < topk; ++s) {
      const int64_t r = routed_of[static_cast<size_t>(t * topk + s)];
      if (r < 0) continue;
      const float wk = wts[t * topk + s];
      const float* yr = y.data() + r * H;
      const float* yl = per == 2 ? y.data() + (routed + r) * H : nullptr;  // residual part
      const void* b = w2_bias.has_value() ? w2_bias->data_ptr() : nullptr;
      const at::ScalarType bdt = w2_bias.has_value() ? w2_bias->scalar_type() : at::kFloat;
      const int64_t e = expert_of[static_cast<size_t>(r)];
      for (int64_t h = 0; h < H; ++h) {
        float v = yr[h];
        if (yl != nullptr) v += yl[h];
        if (b != nullptr) v += load_float(b, bdt, e * H + h);
        acc[static_cast<size_t>(h)] += wk * v;
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      const float v = acc[static_cast<size_t>(h)];
      switch (xdt) {
        case at::kBFloat16: static_cast<c10::BFloat16*>(op)[t * H + h] = c10::BFloat16(v); break;
        case at::kHalf: static_cast<c10::Half*>(op)[t * H + h] = c10::Half(v); break;
        default: static_cast<float*>(op)[t * H + h] = v; break;
      }
    }
  });
  return out;
}

at::Tensor moe_forward_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, const std::string&, double, double,
                            const std::string&, const std::string&, int64_t) {
  return at::empty_like(x);
}

bool supports(const std::string& isa) { return cpu_supports(isa); }

// One read pass over the given tensors' bytes on torch's intra-op threads (chunks of 256 KiB):
// the MXFP4 read floor the bench compares the kernel with. Returns an XOR of the data so the
// reads cannot be optimised away.
int64_t read_pass(const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK(cpu_has_avx2(), "quantreg_cpu_mxfp4: read_pass needs avx2");
  constexpr int64_t chunk = 256 << 10;
  std::vector<std::pair<const uint8_t*, int64_t>> pieces;
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "quantreg_cpu_mxfp4: read_pass needs contiguous CPU tensors");
    const auto* p = static_cast<const uint8_t*>(t.data_ptr());
    const int64_t n = t.numel() * static_cast<int64_t>(t.element_size());
    for (int64_t i = 0; i < n; i += chunk) pieces.emplace_back(p + i, std::min(chunk, n - i));
  }
  std::atomic<uint64_t> acc{0};
  run_jobs(static_cast<int64_t>(pieces.size()), [&](int64_t i) {
    const auto& piece = pieces[static_cast<size_t>(i)];
    acc.fetch_xor(read_pass_avx2(piece.first, piece.second), std::memory_order_relaxed);
  });
  return static_cast<int64_t>(acc.load() >> 1);
}

}  // namespace
}  // namespace quantreg_cpu_mxfp4

TORCH_LIBRARY(quantreg_cpu_mxfp4, m) {
  m.def("moe_forward(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w13_scale, "
        "Tensor? w13_bias, Tensor w2, Tensor w2_scale, Tensor? w2_bias, str activation, float alpha, "
        "float limit, str isa, str precision, int gemm_min_tokens) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantreg_cpu_mxfp4, CPU, m) { m.impl("moe_forward", &quantreg_cpu_mxfp4::moe_forward); }
TORCH_LIBRARY_IMPL(quantreg_cpu_mxfp4, Meta, m) { m.impl("moe_forward", &quantreg_cpu_mxfp4::moe_forward_meta); }

// The Python module only loads the library (the op registers itself) and answers ISA questions.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_supports", &quantreg_cpu_mxfp4::supports, "Whether this CPU can run the given path ('avx2'/'avx512')");
  m.def("read_pass", &quantreg_cpu_mxfp4::read_pass, "One threaded read pass over the tensors' bytes (bench floor)");
}
