// quantreg-cpu-int8-dense: y = x W^T (+ bias) with W int8 per (row, 32-block) and x quantised to
// int8 per (token, 32-block) -- llama.cpp's Q8_0 numerics -- as a plain C ABI (extern "C" on raw
// pointers and sizes, loaded by ctypes).
//
// Why a C ABI and not a torch extension: the library includes no torch header and links no torch
// library, so it builds with a bare C++ compiler (no torch at build time) and one built wheel loads
// under every torch (plugin #2, quantreg-cpu-mxfp4, does the same for the same reason).
//
// qr8_pack: W int8 [N, K] row-major and its fp16 scales [N, Kp / 32] -> the 16-row interleave and
// the grouped scales (int8_dense.h), once.
// qr8_linear, per call:
//   1. each token's x (fp32 or bf16), per 32-block -> q = round(x * 127 / amax), s = amax / 127,
//      and the block's sum of q;
//   2. per (16-row group, tile of tokens): the ISA tile (gemv_avx2.cpp / gemv_avx512.cpp) gives
//      sum over blocks of fma(float(int32 dot), wscale * s, acc) in fp32; + bias[n], written in the
//      output dtype (fp32, or bf16 rounded to nearest even).
// A non-finite x makes its token's outputs NaN (its scales are NaN, its q zero).
// Why per 32-block (issue 54): one scale per token lets one large channel (real models' "massive
// activations") flatten every other value of the token to a few int8 steps -- 7x Q8_0's error with
// two channels at 100x the rest; per 32 values only that channel's block pays.
// Threads: one OpenMP region of `threads` workers over the 16-row groups (static split: each
// thread streams one contiguous part of the weight); the quantisation of many tokens is split too.
// Loaded after torch, the libgomp.so.1 this library needs is the one torch loaded (one pool).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <vector>

#include "int8_dense.h"

namespace quantreg_cpu_int8_dense {
namespace {

enum Dtype : int32_t { F32 = 0, BF16 = 1 };
enum Isa : int32_t { ISA_AVX2 = 0, ISA_AVX512 = 1 };

bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool has_avx512() {
  __builtin_cpu_init();
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

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
  bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

inline float load(const void* p, int32_t dtype, int64_t i) {
  return dtype == BF16 ? bf16_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

// One token: x[0..k) -> q (kp int8, zero padded) and, per 32-block, its scale and 128 x its sum of q.
void quantise_row(const void* x, int32_t dtype, int64_t k, int64_t kp, int8_t* q, float* scale, int32_t* sum) {
  bool finite = true;
  for (int64_t i = 0; i < k; ++i) finite = finite && std::isfinite(load(x, dtype, i));
  const int64_t blocks = kp / kBlock;
  if (!finite) {
    std::memset(q, 0, static_cast<size_t>(kp));
    for (int64_t b = 0; b < blocks; ++b) {
      scale[b] = std::nanf("");
      sum[b] = 0;
    }
    return;
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kBlock, hi = std::min(k, lo + kBlock);
    float amax = 0.0f;
    for (int64_t i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(load(x, dtype, i)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t s = 0;
    for (int64_t i = lo; i < hi; ++i) {
      float r = std::nearbyint(load(x, dtype, i) * inv);  // the current rounding mode: to nearest even
      r = std::min(127.0f, std::max(-127.0f, r));
      q[i] = static_cast<int8_t>(r);
      s += static_cast<int32_t>(r);
    }
    for (int64_t i = std::max(lo, hi); i < lo + kBlock; ++i) q[i] = 0;
    scale[b] = amax / 127.0f;
    sum[b] = 128 * s;  // the VNNI path's offset share, ready to subtract
  }
}

struct Args {
  const void* x;
  int32_t x_dtype;
  int64_t m, k;
  const int8_t* packed;
  const uint16_t* wscale;
  int64_t n, kp;
  const void* bias;
  int32_t bias_dtype;
  void* out;
  int32_t out_dtype;
  int32_t isa;
  int32_t threads;
};

const char* linear(const Args& a) {
  if (a.m <= 0 || a.n <= 0) return nullptr;
  if (a.kp % kColAlign != 0 || a.kp < a.k || a.k <= 0) return "bad K / padded K";
  if (a.x_dtype != F32 && a.x_dtype != BF16) return "x dtype must be fp32 or bf16";
  if (a.out_dtype != F32 && a.out_dtype != BF16) return "out dtype must be fp32 or bf16";
  const bool vnni = a.isa == ISA_AVX512;
  if (vnni ? !has_avx512() : !has_avx2()) return vnni ? "this CPU lacks AVX-512 VNNI" : "this CPU lacks AVX2+FMA+F16C";
  const TileFn fn = vnni ? tile_avx512 : tile_avx2;
  const int tile_m = vnni ? kTileAvx512 : kTileAvx2;
  const int threads = std::max<int32_t>(1, a.threads);
  const size_t elem = a.x_dtype == BF16 ? 2 : 4;
  const int64_t blocks = a.kp / kBlock;

  std::vector<int8_t> q(static_cast<size_t>(a.m * a.kp));
  std::vector<float> xs(static_cast<size_t>(a.m * blocks));
  std::vector<int32_t> xsum(static_cast<size_t>(a.m * blocks));
  const int qthreads = static_cast<int>(std::min<int64_t>(threads, a.m));
#pragma omp parallel for num_threads(qthreads) schedule(static) if (qthreads > 1)
  for (int64_t t = 0; t < a.m; ++t)
    quantise_row(static_cast<const char*>(a.x) + t * a.k * elem, a.x_dtype, a.k, a.kp, q.data() + t * a.kp,
                 xs.data() + t * blocks, xsum.data() + t * blocks);

  const int64_t groups = (a.n + kRows - 1) / kRows;
  const int gthreads = static_cast<int>(std::min<int64_t>(threads, groups));
#pragma omp parallel for num_threads(gthreads) schedule(static) if (gthreads > 1)
  for (int64_t g = 0; g < groups; ++g) {
    float acc[kTileAvx512 * kRows];
    const int64_t row0 = g * kRows, rows = std::min<int64_t>(kRows, a.n - row0);
    for (int64_t t0 = 0; t0 < a.m; t0 += tile_m) {
      const int mt = static_cast<int>(std::min<int64_t>(tile_m, a.m - t0));
      const Tile tile{a.packed + g * kRows * a.kp, a.wscale + g * blocks * kRows, a.kp,
                      q.data() + t0 * a.kp, xs.data() + t0 * blocks, xsum.data() + t0 * blocks};
      fn(tile, mt, acc);
      for (int j = 0; j < mt; ++j) {
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t n = row0 + r;
          float y = acc[j * kRows + r];
          if (a.bias != nullptr) y += load(a.bias, a.bias_dtype, n);
          const int64_t at = (t0 + j) * a.n + n;
          if (a.out_dtype == BF16)
            static_cast<uint16_t*>(a.out)[at] = float_to_bf16(y);
          else
            static_cast<float*>(a.out)[at] = y;
        }
      }
    }
  }
  return nullptr;
}

const char* guarded(const char* (*body)(const void*), const void* arg) {
  try {
    return body(arg);
  } catch (const std::bad_alloc&) {
    return "out of memory";
  } catch (const std::exception& exc) {
    static thread_local char text[256];
    std::snprintf(text, sizeof text, "%s", exc.what());
    return text;
  } catch (...) {
    return "unknown C++ exception";
  }
}

int32_t report(const char* why, char* err, int64_t errlen) {
  if (why == nullptr || why[0] == '\0') return 0;
  if (err != nullptr && errlen > 0) std::snprintf(err, static_cast<size_t>(errlen), "%s", why);
  return 1;
}

}  // namespace
}  // namespace quantreg_cpu_int8_dense

using quantreg_cpu_int8_dense::Args;

extern "C" {

// What the no-load probe looks for in the file (probe.py): the ABI version as bytes, so a library
// of another version or a file that is not this library is told apart without loading it.
__attribute__((visibility("default"), used)) extern const char qr8_abi_marker[] = "quantreg-cpu-int8-dense ABI 2;";

// The ABI version kernel.py checks after loading: bump it (and the marker) whenever a signature or
// the argument struct changes (2: block-scaled weights and activations, issue 54).
__attribute__((visibility("default"))) int32_t qr8_abi_version() { return 2; }

// 1 if this CPU can run the path ("avx2": AVX2+FMA+F16C; "avx512": AVX-512 F/BW/VL/VNNI too), else 0.
__attribute__((visibility("default"))) int32_t qr8_cpu_supports(const char* isa) {
  if (isa == nullptr) return 0;
  if (std::strcmp(isa, "avx2") == 0) return quantreg_cpu_int8_dense::has_avx2() ? 1 : 0;
  if (std::strcmp(isa, "avx512") == 0) return quantreg_cpu_int8_dense::has_avx512() ? 1 : 0;
  return 0;
}

// W int8 [n, k] row-major and scale (fp16 bits) [n, kp / 32] -> packed [roundup(n, 16) * kp] (the
// 16-row interleave, zero padded) and pscale [roundup(n, 16) / 16][kp / 32][16]
// (padding 0). kp = roundup(k, 32). Refuses a -128 (the AVX2 path's |w| must fit 7 bits).
__attribute__((visibility("default"))) int32_t qr8_pack(const int8_t* w, const uint16_t* scale, int64_t n, int64_t k,
                                                         int64_t kp, int8_t* packed, uint16_t* pscale, char* err,
                                                         int64_t errlen) {
  using namespace quantreg_cpu_int8_dense;
  if (n <= 0 || k <= 0 || kp < k || kp % kColAlign != 0) return report("bad n / k / padded k", err, errlen);
  const int64_t np = (n + kRows - 1) / kRows * kRows, blocks = kp / kBlock;
  std::memset(packed, 0, static_cast<size_t>(np * kp));
  std::memset(pscale, 0, static_cast<size_t>(np * blocks) * sizeof(uint16_t));
  for (int64_t r = 0; r < n; ++r) {
    const int8_t* src = w + r * k;
    int8_t* group = packed + (r / kRows) * kRows * kp;
    const int64_t lane = (r % kRows) * 4;
    for (int64_t c = 0; c < k; ++c) {
      if (src[c] == -128) {
        char text[160];
        std::snprintf(text, sizeof text, "weight row %lld column %lld is -128; the kernel needs [-127, 127]",
                      static_cast<long long>(r), static_cast<long long>(c));
        return report(text, err, errlen);
      }
      group[(c / 4) * kStepBytes + lane + c % 4] = src[c];
    }
    uint16_t* gs = pscale + (r / kRows) * blocks * kRows + r % kRows;
    for (int64_t b = 0; b < blocks; ++b) gs[b * kRows] = scale[r * blocks + b];
  }
  return 0;
}

// The linear (file comment). Returns 0, or 1 with a message in err: no C++ exception crosses here.
__attribute__((visibility("default"))) int32_t qr8_linear(const Args* args, char* err, int64_t errlen) {
  using namespace quantreg_cpu_int8_dense;
  const char* why = guarded([](const void* a) { return linear(*static_cast<const Args*>(a)); }, args);
  return report(why, err, errlen);
}

}  // extern "C"
