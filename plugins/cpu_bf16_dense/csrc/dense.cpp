// quantreg-cpu-bf16-dense: y = x W^T (+ bias) for a bf16 weight W, fp32 products and accumulation,
// as a plain C ABI (extern "C" on raw pointers and sizes, loaded by ctypes).
//
// Why a C ABI and not a torch extension: the library includes no torch header and links no torch
// library, so it builds with a bare C++ compiler (no torch at build time) and one built wheel loads
// under every torch.
//
// qrb_pack: W bf16 [N, K] row-major -> the 16-row pair interleave (bf16_dense.h), once at load.
// qrb_unpack: rows [row0, row0 + rows) of the packed weight back to fp32 [rows, K] (exact; for
//   tests and tools).
// qrb_linear, per call (any token count: a GEMV at 1-8 tokens, a blocked GEMM beyond):
//   1. the activations are laid out for the path: fp32 (AVX2 tile; bf16 widened exactly) or bf16
//      (AVX-512 BF16 tile), zero padded to Kp;
//   2. per (16-row group, tile of tokens): the tile's fp32 dots, + bias[n] in fp32, then written in
//      the output dtype (fp32, or bf16 rounded to nearest even -- the one rounding of the result).
// Threads: one OpenMP region of `threads` workers taking chunks of 64 output rows as they come.
// Loaded after torch, the libgomp.so.1 this library
// needs is the one torch loaded (one pool).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <vector>

#include "bf16_dense.h"

namespace quantreg_cpu_bf16_dense {
namespace {

enum Dtype : int32_t { F32 = 0, BF16 = 1 };
enum Isa : int32_t { ISA_AVX2 = 0, ISA_AVX512 = 1 };
constexpr int64_t kTokenBlock = 32;
constexpr int64_t kChunkGroups = 4;

bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool has_avx512() {
  __builtin_cpu_init();
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
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
  bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even (an overflow carries into inf)
  return static_cast<uint16_t>(bits >> 16);
}

inline float load(const void* p, int32_t dtype, int64_t i) {
  return dtype == BF16 ? bf16_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

struct Args {
  const void* x;
  int32_t x_dtype;
  int64_t m, k;
  const uint16_t* packed;
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
  if (a.isa == ISA_AVX512 ? !has_avx512() : !has_avx2())
    return a.isa == ISA_AVX512 ? "this CPU lacks AVX-512 BF16" : "this CPU lacks AVX2+FMA";
  // vdpbf16ps multiplies bf16 by bf16: an fp32 activation takes the AVX2 tile (exact FMA products).
  const bool bf16_tile = a.isa == ISA_AVX512 && a.x_dtype == BF16;
  const int tile_m = bf16_tile ? kTileAvx512 : kTileAvx2;
  const int acc = accumulators(a.m);
  const int threads = std::max<int32_t>(1, a.threads);

  std::vector<float> xf;
  std::vector<uint16_t> xb;
  if (bf16_tile) {
    xb.assign(static_cast<size_t>(a.m * a.kp), 0);
    for (int64_t t = 0; t < a.m; ++t)
      std::memcpy(xb.data() + t * a.kp, static_cast<const uint16_t*>(a.x) + t * a.k, static_cast<size_t>(a.k) * 2);
  } else {
    xf.assign(static_cast<size_t>(a.m * a.kp), 0.0f);
    for (int64_t t = 0; t < a.m; ++t)
      for (int64_t i = 0; i < a.k; ++i) xf[t * a.kp + i] = load(a.x, a.x_dtype, t * a.k + i);
  }

  // One parallel region, no barrier inside: the threads take chunks of kChunkGroups 16-row groups
  // (64 rows: 368 KB of weight at K = 2880, one sequential stream) as they come -- dynamic, so on a
  // shared host a thread that is descheduled leaves its share to the one that runs, instead of the
  // call waiting for it -- and, per chunk, every block of kTokenBlock tokens -- the chunk (4 x 16 rows x Kp bf16, 368 KB at
  // K = 2880) and the block's activations (<= 32 x Kp fp32, 368 KB) stay in L2, the weight is read
  // from memory once per call. At 1-8 tokens this is a plain GEMV over the chunks.
  const int64_t groups = (a.n + kRows - 1) / kRows;
  const int64_t chunks = (groups + kChunkGroups - 1) / kChunkGroups;
  const int cthreads = static_cast<int>(std::min<int64_t>(threads, chunks));
#pragma omp parallel for num_threads(cthreads) schedule(dynamic, 1) if (cthreads > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    float dots[kTileAvx512 * kRows];
    const int64_t g1 = std::min<int64_t>(groups, (c + 1) * kChunkGroups);
    for (int64_t b0 = 0; b0 < a.m; b0 += kTokenBlock) {
      const int64_t b1 = std::min<int64_t>(a.m, b0 + kTokenBlock);
      for (int64_t g = c * kChunkGroups; g < g1; ++g) {
        const uint16_t* w = a.packed + g * kRows * a.kp;
        const int64_t row0 = g * kRows, rows = std::min<int64_t>(kRows, a.n - row0);
        for (int64_t t0 = b0; t0 < b1; t0 += tile_m) {
          const int mt = static_cast<int>(std::min<int64_t>(tile_m, b1 - t0));
          if (bf16_tile)
            tile_avx512(w, a.kp, xb.data() + t0 * a.kp, a.kp, mt, acc, dots);
          else
            tile_avx2(w, a.kp, xf.data() + t0 * a.kp, a.kp, mt, acc, dots);
          for (int j = 0; j < mt; ++j) {
            for (int64_t r = 0; r < rows; ++r) {
              const int64_t n = row0 + r;
              float y = dots[j * kRows + r];
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
    }
  }
  return nullptr;
}

const char* guarded(const Args& a) {
  try {
    return linear(a);
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
}  // namespace quantreg_cpu_bf16_dense

using quantreg_cpu_bf16_dense::Args;

extern "C" {

// What the no-load probe looks for in the file (probe.py): the ABI version as bytes.
__attribute__((visibility("default"), used)) extern const char qrb_abi_marker[] = "quantreg-cpu-bf16-dense ABI 1;";

// The ABI version kernel.py checks after loading: bump it (and the marker) whenever a signature or
// the argument struct changes.
__attribute__((visibility("default"))) int32_t qrb_abi_version() { return 1; }

// 1 if this CPU can run the path ("avx2": AVX2+FMA; "avx512": AVX-512 F/BW/VL/BF16 too), else 0.
__attribute__((visibility("default"))) int32_t qrb_cpu_supports(const char* isa) {
  if (isa == nullptr) return 0;
  if (std::strcmp(isa, "avx2") == 0) return quantreg_cpu_bf16_dense::has_avx2() ? 1 : 0;
  if (std::strcmp(isa, "avx512") == 0) return quantreg_cpu_bf16_dense::has_avx512() ? 1 : 0;
  return 0;
}

// W bf16 [n, k] row-major -> packed [roundup(n, 16) * kp] (the pair interleave, zero padded).
__attribute__((visibility("default"))) int32_t qrb_pack(const uint16_t* w, int64_t n, int64_t k, int64_t kp,
                                                         uint16_t* packed, int32_t threads, char* err,
                                                         int64_t errlen) {
  using namespace quantreg_cpu_bf16_dense;
  if (n <= 0 || k <= 0 || kp < k || kp % kColAlign != 0) return report("bad n / k / padded k", err, errlen);
  const int64_t groups = (n + kRows - 1) / kRows;
#pragma omp parallel for num_threads(std::max<int32_t>(1, threads)) schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    uint16_t* group = packed + g * kRows * kp;
    std::memset(group, 0, static_cast<size_t>(kRows * kp) * 2);
    for (int64_t r = 0; r < kRows && g * kRows + r < n; ++r) {
      const uint16_t* src = w + (g * kRows + r) * k;
      for (int64_t c = 0; c < k; ++c) group[(c / 2) * kLineElems + 2 * r + c % 2] = src[c];
    }
  }
  return 0;
}

// Rows [row0, row0 + rows) of the packed weight -> fp32 out [rows, k] (exact: bf16 -> fp32).
__attribute__((visibility("default"))) int32_t qrb_unpack(const uint16_t* packed, int64_t n, int64_t k, int64_t kp,
                                                           int64_t row0, int64_t rows, float* out, int32_t threads,
                                                           char* err, int64_t errlen) {
  using namespace quantreg_cpu_bf16_dense;
  if (row0 < 0 || rows < 0 || row0 + rows > n || kp < k || kp % kColAlign != 0)
    return report("bad row range or padded k", err, errlen);
#pragma omp parallel for num_threads(std::max<int32_t>(1, threads)) schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t row = row0 + i;
    const uint16_t* group = packed + (row / kRows) * kRows * kp + 2 * (row % kRows);
    float* dst = out + i * k;
    for (int64_t c = 0; c < k; ++c) dst[c] = bf16_to_float(group[(c / 2) * kLineElems + c % 2]);
  }
  return 0;
}

// The GEMV (file comment). Returns 0, or 1 with a message in err: no C++ exception crosses here.
__attribute__((visibility("default"))) int32_t qrb_linear(const Args* args, char* err, int64_t errlen) {
  using namespace quantreg_cpu_bf16_dense;
  return report(guarded(*args), err, errlen);
}

}  // extern "C"
