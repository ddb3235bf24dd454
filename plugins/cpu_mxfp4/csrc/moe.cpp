// quantreg-cpu-mxfp4: the MoE forward over packed MXFP4 experts, as a plain C ABI.
//
// Why a C ABI (extern "C" functions on raw pointers and sizes, loaded by ctypes) and not a torch
// extension: a torch C++ extension is tied to the exact torch (and its C++ ABI) it was compiled
// against, so a wheel built under torch 2.13 fails to load under 2.14, and building it needs torch
// at build time (pip's isolated build would download a second torch). This library includes no
// torch header and links no torch library: it builds with a bare C++ compiler, and one built file
// loads under any torch. Python (kernel.py) checks shapes and dtypes, hands over data_ptr()s, and
// does the one step that wants torch's GEMM (the prefill path's bf16 matmul) through a callback.
//
// qr_moe_forward(args) computes, for x [T, H] and top-k routing:
//  1. group the (token, slot) pairs by local expert (counting sort; ids outside [0, E) dropped);
//  2. quantise every token's x to Q8 blocks (gemv.h), once per token;
//  3. w13 GEMV over (expert, row block) jobs, only the routed experts' bytes are read;
//  4. bias + activation per routed pair, the result quantised to Q8 again;
//  5. w2 GEMV the same way;
//  6. per token, sum_k weight_k * (y_k + b2_e) in slot order (deterministic), to x's dtype.
// Prefill: an expert with >= gemm_min_tokens routed tokens skips the Q8 GEMVs (compute-bound
// there) and takes steps 3 and 5 as GEMMs instead: tile by tile (gemm_rows rows of one expert),
// the tile is decoded exactly into a K-major scratch buffer (decode_tile.cpp; weights stay
// packed), then the caller's gemm callback multiplies the expert's tokens by it (kernel.py:
// torch.mm) and writes fp32 results; the activation is kept in the GEMM's dtype, not Q8. The
// dtype follows the CPU: bf16 where the avx512 path runs on a CPU with AVX-512 BF16 (oneDNN:
// AMX / AVX-512 BF16; error that of bf16 activations and outputs, like mxfp4_reference's), fp32
// elsewhere (AVX2 hosts, where torch's bf16 GEMM is emulated and ~6x slower than its fp32 SGEMM;
// error that of fp32 accumulation).
//
// Threads: OpenMP regions of `threads` workers (the caller passes torch.get_num_threads()). Loaded
// after torch, this library's libgomp.so.1 dependency resolves to the libgomp torch already loaded
// (same soname), so kernel and torch ops share one thread pool, as at::parallel_for did. Jobs are
// handed out by an atomic counter inside one region, so experts with more tokens do not leave the
// other threads idle.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <new>
#include <vector>

#include "gemv.h"

extern "C" {

// dtype codes shared with kernel.py (_DTYPES).
enum QrDtype : int32_t { QR_F32 = 0, QR_BF16 = 1, QR_F16 = 2 };

// out[i * ldc + j] = sum_kk a[i * k + kk] * b[kk * n + j] for i < m, j < n: a [m, k] (the tokens) and
// b [k, n] (the K-major weight tile), row-major, both fp32 (dtype QR_F32) or both bf16 bit patterns
// (QR_BF16: the product rounded to bf16, as torch.mm gives it). Returns kQrGemmDone once c is written; anything else aborts
// the forward. Why a magic value and not 0: the callback is Python (ctypes), and an exception raised
// as it is entered, before its own try (a signal handler's KeyboardInterrupt), is printed by ctypes
// and swallowed, leaving the return slot uninitialised -- 0 there would pass unwritten rows as output.
constexpr int32_t kQrGemmDone = 0x51524f4b;  // "QROK"; kernel.py's GEMM_DONE
typedef int32_t (*qr_gemm_fn)(const void* a, int64_t m, int64_t k, const void* b, int64_t n, float* c,
                              int64_t ldc, int32_t dtype);

// Everything qr_moe_forward reads (kernel.py's _MoeArgs mirrors it field by field). Every array
// is contiguous, row-major; kernel.py has checked shapes, dtypes and devices.
struct QrMoeArgs {
  const void* x;              // [t, h], x_dtype
  int32_t x_dtype;
  int64_t t, h;
  const void* topk_ids;       // [t, topk] int32 (ids_bits 32) or int64 (64)
  int32_t ids_bits;
  int64_t topk;
  const float* topk_weights;  // [t, topk] fp32
  const uint8_t* w13_blocks;  // [e, n13, h/2], 16-row interleave (gemv.h)
  const uint8_t* w13_scales;  // [e, n13, h/32]
  const void* w13_bias;       // [e, n13] or null
  int32_t w13_bias_dtype;
  const uint8_t* w2_blocks;   // [e, h, i/2]
  const uint8_t* w2_scales;   // [e, h, i/32]
  const void* w2_bias;        // [e, h] or null
  int32_t w2_bias_dtype;
  int64_t e, i;               // experts; intermediate size (n13 = 2i)
  int32_t activation;         // 0 swigluoai (rows interleaved), 1 silu ([gate; up])
  float alpha, limit;
  int32_t isa;                // 0 avx2, 1 avx512
  int32_t per;                // 1 q8, 2 q8x2
  int64_t gemm_min_tokens;    // <= 0: no prefill path
  int64_t gemm_rows;          // rows per prefill tile (a multiple of 16)
  int32_t threads;
  void* out;                  // [t, h], x_dtype, written entirely
  qr_gemm_fn gemm;            // required when gemm_min_tokens > 0
};

}  // extern "C"

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

// AVX-512 BF16 (also on every AMX host): torch's bf16 GEMM runs natively, ~2.4x its fp32 GEMM here
// (measured, AMD EPYC Zen 4, m = 64, K = 2880: ~400 against ~165 GFLOP/s). Without it torch's
// bf16 GEMM is emulated and far slower than fp32 (AVX2 host, issue 44: 21 against 132 GFLOP/s).
bool cpu_has_avx512bf16() {
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
}

// Workers of the current forward (set on the calling thread at entry).
thread_local int tl_threads = 1;

// Run fn(job) for job in [0, njobs) on tl_threads OpenMP threads, jobs taken in order from a
// shared counter (dynamic balance; jobs must be independent and must not throw).
template <class Fn>
void run_jobs(int64_t njobs, const Fn& fn) {
  if (njobs <= 0) return;
  const int64_t workers = std::min<int64_t>(tl_threads, njobs);
  if (workers <= 1 || omp_in_parallel()) {
    for (int64_t job = 0; job < njobs; ++job) fn(job);
    return;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(static_cast<int>(workers))
  {
    for (;;) {
      const int64_t job = next.fetch_add(1, std::memory_order_relaxed);
      if (job >= njobs) break;
      fn(job);
    }
  }
}

// bf16 / fp16 <-> fp32 by bit patterns, rounding to nearest even (what c10::BFloat16 / c10::Half
// do), so the outputs match the torch extension this library replaced bit for bit.
inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t bias = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + bias) >> 16);
}

inline float fp32_from_bits(uint32_t w) {
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

inline uint32_t fp32_to_bits(float f) {
  uint32_t w;
  std::memcpy(&w, &f, 4);
  return w;
}

// IEEE half -> float (the FP16 library's branch-free form, as c10::detail::fp16_ieee_to_fp32_value).
inline float half_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float exp_scale = fp32_from_bits(0x7800000u);
  const float normalized = fp32_from_bits((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = 126u << 23;
  const float magic_bias = 0.5f;
  const float denormalized = fp32_from_bits((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? fp32_to_bits(denormalized) : fp32_to_bits(normalized));
  return fp32_from_bits(result);
}

// float -> IEEE half, round to nearest even (as c10::detail::fp16_ieee_from_fp32_value).
inline uint16_t float_to_half(float f) {
  const float scale_to_inf = fp32_from_bits(0x77800000u);
  const float scale_to_zero = fp32_from_bits(0x08800000u);
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = fp32_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = fp32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = fp32_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

inline float load_float(const void* base, int32_t dtype, int64_t i) {
  switch (dtype) {
    case QR_BF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case QR_F16: return half_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

inline void store_float(void* base, int32_t dtype, int64_t i, float v) {
  switch (dtype) {
    case QR_BF16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); break;
    case QR_F16: static_cast<uint16_t*>(base)[i] = float_to_half(v); break;
    default: static_cast<float*>(base)[i] = v; break;
  }
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

// One row of k floats (followed by k floats of scratch) -> its `per` Q8 parts at q, q + q_bytes:
// q8x2 (per 2: the row, then its residual) or plain q8 (per 1). Stages 2 and 4 of the forward.
void quantize_row(float* row, int64_t k, int64_t per, uint8_t* q, int64_t q_bytes) {
  if (per == 2) {
    quantize_q8x2(row, k, q, q + q_bytes, row + k);
  } else {
    quantize_q8(row, k, q);
  }
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

struct Stack {
  const uint8_t* blocks;
  const uint8_t* scales;
  int64_t e, n, k;
};

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


// out[r * w.n + row] = sum_k W_e[row, k] * in[r, k] for the pairs r of every group: W decoded tile
// by tile (gemm_rows rows of one expert, in parallel by 16-row groups) into the K-major scratch
// `tile` (fp32, or bf16 when `bf16`), then multiplied by the caller's gemm (torch's threads).
// in: [routed, K] in the tile's dtype. Returns false if the callback failed.
bool run_gemm(const Stack& w, const std::vector<Group>& groups, const void* in, float* out, int64_t tile_rows,
              qr_gemm_fn gemm, bool avx512, bool bf16, std::vector<uint8_t>& tile) {
  const int64_t esize = bf16 ? 2 : 4;
  const int64_t body = w.n - w.n % kRowGroup, nb = w.k / 32;
  tile.resize(static_cast<size_t>(tile_rows * w.k * esize));
  void* tp = tile.data();
  for (const Group& grp : groups) {
    const uint8_t* blocks = w.blocks + grp.e * w.n * (w.k / 2);
    const uint8_t* scales = w.scales + grp.e * w.n * nb;
    for (int64_t row0 = 0; row0 < w.n; row0 += tile_rows) {
      const int64_t rows = std::min(tile_rows, w.n - row0);
      const int64_t whole = std::max<int64_t>(0, std::min(rows, body - row0));  // rows in 16-row groups
      run_jobs((whole + kRowGroup - 1) / kRowGroup + (whole < rows ? 1 : 0), [&](int64_t j) {
        const int64_t r = j * kRowGroup;
        if (r < whole) {
          if (avx512) {
            decode_tile_avx512(blocks, scales, row0 + r, kRowGroup, w.k, tp, rows, r, bf16 ? 1 : 0);
          } else {
            decode_tile_avx2(blocks, scales, row0 + r, kRowGroup, w.k, static_cast<float*>(tp), rows, r);
          }
          return;
        }
        for (int64_t c = whole; c < rows; ++c) {  // the row-major tail (< 16 rows): plain C
          const int64_t row = row0 + c;
          for (int64_t kk = 0; kk < w.k; ++kk) {
            const uint8_t byte = blocks[row * (w.k / 2) + kk / 2];
            const uint32_t bits = static_cast<uint32_t>(scales[row * nb + kk / 32]) << 23;
            float scale;
            std::memcpy(&scale, &bits, 4);
            const float v = 0.5f * static_cast<float>(static_cast<int>(kCodeTable[kk % 2 ? byte >> 4 : byte & 15]) - 12)
                            * scale;
            if (bf16) {
              static_cast<uint16_t*>(tp)[kk * rows + c] = static_cast<uint16_t>(fp32_to_bits(v) >> 16);
            } else {
              static_cast<float*>(tp)[kk * rows + c] = v;
            }
          }
        }
      });
      const uint8_t* a = static_cast<const uint8_t*>(in) + grp.begin * w.k * esize;
      if (gemm(a, grp.end - grp.begin, w.k, tp, rows, out + grp.begin * w.n + row0, w.n, bf16 ? QR_BF16 : QR_F32) !=
          kQrGemmDone)
        return false;
    }
  }
  return true;
}

// The forward (file comment). Returns an empty string, or why it stopped.
const char* forward(const QrMoeArgs& a) {
  const int64_t per = a.per == 2 ? 2 : 1;
  void (*gemv)(const GemvJob&) = a.isa == 1 ? gemv_avx512 : gemv_avx2;
  if (a.isa == 1 ? !cpu_has_avx512() : !cpu_has_avx2()) return "this CPU does not support the requested ISA path";
  if (a.gemm_min_tokens > 0 && (a.gemm == nullptr || a.gemm_rows <= 0 || a.gemm_rows % kRowGroup != 0))
    return "the prefill path needs a gemm callback and gemm_rows a positive multiple of 16";
  tl_threads = std::max<int32_t>(1, a.threads);
  const int64_t T = a.t, H = a.h, topk = a.topk, E = a.e, I = a.i, N1 = 2 * a.i;
  const Stack s13{a.w13_blocks, a.w13_scales, E, N1, H};
  const Stack s2{a.w2_blocks, a.w2_scales, E, H, I};
  const int32_t xdt = a.x_dtype;
  void* op = a.out;
  {
    const int64_t bytes = xdt == QR_F32 ? 4 : 2;
    std::memset(op, 0, static_cast<size_t>(T * H * bytes));  // +0.0 in every dtype
  }
  if (T == 0 || topk == 0 || E == 0) return "";
  const float* wts = a.topk_weights;
  const void* xp = a.x;

  // 1. Group (token, slot) pairs by expert: counting sort, stable in token order.
  const int64_t pairs = T * topk;
  std::vector<int64_t> local(static_cast<size_t>(pairs));
  if (a.ids_bits == 32) {
    const int32_t* p = static_cast<const int32_t*>(a.topk_ids);
    for (int64_t i = 0; i < pairs; ++i) local[static_cast<size_t>(i)] = p[i];
  } else {
    const int64_t* p = static_cast<const int64_t*>(a.topk_ids);
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
  if (routed == 0) return "";
  // Which experts take the GEMM path (gemm_min_tokens <= 0: none).
  std::vector<Group> small, big;
  std::vector<char> big_pair(static_cast<size_t>(routed), 0);
  for (size_t i = 0; i < experts.size(); ++i) {
    const Group g{experts[i], offsets[i], offsets[i + 1]};
    if (a.gemm_min_tokens > 0 && g.end - g.begin >= a.gemm_min_tokens) {
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
  run_jobs(T, [&](int64_t t) {
    std::vector<float> row(static_cast<size_t>(2 * H));
    for (int64_t h = 0; h < H; ++h) row[static_cast<size_t>(h)] = load_float(xp, xdt, t * H + h);
    quantize_row(row.data(), H, per, qx.data() + per * t * q1, q1);
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
  // The GEMM experts' tokens in the GEMM's dtype (bf16 where the CPU has AVX-512 BF16 and the ISA
  // path is avx512, else fp32), one row per routed pair (rows of GEMV pairs unused).
  const bool gemm_bf16 = a.isa == 1 && cpu_has_avx512bf16();
  const int32_t gdt = gemm_bf16 ? QR_BF16 : QR_F32;
  const int64_t gsize = gemm_bf16 ? 2 : 4;
  std::vector<uint8_t> xb(big.empty() ? 0 : static_cast<size_t>(routed * H * gsize));
  std::vector<uint8_t> ab(big.empty() ? 0 : static_cast<size_t>(routed * I * gsize));
  if (!big.empty()) {
    void* xbp = xb.data();
    run_jobs(routed, [&](int64_t r) {
      if (!big_pair[static_cast<size_t>(r)]) return;
      const int64_t t = pair_of[static_cast<size_t>(r)] / topk;
      for (int64_t h = 0; h < H; ++h) store_float(xbp, gdt, r * H + h, load_float(xp, xdt, t * H + h));
    });
  }

  // 4. Bias, activation, Q8.
  std::vector<uint8_t> qa(static_cast<size_t>(per * routed * q2));
  const bool oai = a.activation == 0;
  const float fa = a.alpha, fl = a.limit;
  const auto activate = [&](int64_t r) {
    const int64_t e = expert_of[static_cast<size_t>(r)];
    float* h = h13.data() + r * N1;
    if (per == 2) {
      const float* residual = h13.data() + (routed + r) * N1;
      for (int64_t n = 0; n < N1; ++n) h[n] += residual[n];
    }
    if (a.w13_bias != nullptr) {
      const void* b = a.w13_bias;
      const int32_t bdt = a.w13_bias_dtype;
      for (int64_t n = 0; n < N1; ++n) h[n] += load_float(b, bdt, e * N1 + n);
    }
    std::vector<float> act_row(static_cast<size_t>(2 * I));
    for (int64_t i = 0; i < I; ++i) {
      if (oai) {
        const float g = h[2 * i], u = h[2 * i + 1];
        const float gate = g > fl ? fl : g;  // NaN stays NaN, as torch.clamp
        const float up = u > fl ? fl : (u < -fl ? -fl : u);
        act_row[static_cast<size_t>(i)] = (up + 1.f) * gate / (1.f + std::exp(-fa * gate));
      } else {
        const float g = h[i], u = h[I + i];
        act_row[static_cast<size_t>(i)] = g / (1.f + std::exp(-g)) * u;
      }
    }
    if (big_pair[static_cast<size_t>(r)]) {
      for (int64_t i = 0; i < I; ++i) store_float(ab.data(), gdt, r * I + i, act_row[static_cast<size_t>(i)]);
    } else {
      quantize_row(act_row.data(), I, per, qa.data() + per * r * q2, q2);
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
  std::vector<uint8_t> tile;
  const char* const gemm_failed = "the prefill gemm callback failed (it did not report its rows written)";
  run_gemv(gemv, s13, small, act, dst, per);
  if (!big.empty() && !run_gemm(s13, big, xb.data(), h13.data(), a.gemm_rows, a.gemm, a.isa == 1, gemm_bf16, tile)) return gemm_failed;
  run_jobs(routed, activate);
  run_gemv(gemv, s2, small, act2, dst2, per);
  if (!big.empty() && !run_gemm(s2, big, ab.data(), y.data(), a.gemm_rows, a.gemm, a.isa == 1, gemm_bf16, tile)) return gemm_failed;

  // 6. Weighted sum per token, slots in order.
  run_jobs(T, [&](int64_t t) {
    std::vector<float> acc(static_cast<size_t>(H), 0.f);
    for (int64_t s = 0; s < topk; ++s) {
      const int64_t r = routed_of[static_cast<size_t>(t * topk + s)];
      if (r < 0) continue;
      const float wk = wts[t * topk + s];
      const float* yr = y.data() + r * H;
      const float* yl = per == 2 ? y.data() + (routed + r) * H : nullptr;  // residual part
      const void* b = a.w2_bias;
      const int32_t bdt = a.w2_bias_dtype;
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
      store_float(op, xdt, t * H + h, v);
    }
  });
  return "";
}


}  // namespace
}  // namespace quantreg_cpu_mxfp4

extern "C" {

// 1 if this CPU can run the path ("avx2": AVX2+FMA; "avx512": AVX-512 F/BW/VL/VNNI too), or has the
// feature ("avx512_bf16": the avx512 path's prefill GEMM runs in bf16, else fp32), else 0.
__attribute__((visibility("default"))) int32_t qr_cpu_supports(const char* isa) {
  if (isa == nullptr) return 0;
  if (std::strcmp(isa, "avx2") == 0) return quantreg_cpu_mxfp4::cpu_has_avx2() ? 1 : 0;
  if (std::strcmp(isa, "avx512") == 0) return quantreg_cpu_mxfp4::cpu_has_avx512() ? 1 : 0;
  if (std::strcmp(isa, "avx512_bf16") == 0) return quantreg_cpu_mxfp4::cpu_has_avx512bf16() ? 1 : 0;
  return 0;
}

// The MoE forward (file comment). Returns 0, or 1 with a message in err (NUL-terminated, at most
// errlen bytes): no C++ exception ever crosses this boundary.
__attribute__((visibility("default"))) int32_t qr_moe_forward(const QrMoeArgs* args, char* err, int64_t errlen) {
  const char* why = nullptr;
  try {
    why = quantreg_cpu_mxfp4::forward(*args);
  } catch (const std::bad_alloc&) {
    why = "out of memory";
  } catch (const std::exception& exc) {
    why = exc.what();
  } catch (...) {
    why = "unknown C++ exception";
  }
  if (why == nullptr || why[0] == '\0') return 0;
  if (err != nullptr && errlen > 0) std::snprintf(err, static_cast<size_t>(errlen), "%s", why);
  return 1;
}

// The ABI version kernel.py checks before use: bump it whenever QrMoeArgs or a signature changes.
__attribute__((visibility("default"))) int32_t qr_abi_version() { return 3; }

}  // extern "C"
