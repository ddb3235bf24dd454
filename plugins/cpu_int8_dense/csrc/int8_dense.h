// quantreg-cpu-int8-dense: declarations shared by the int8 GEMV kernels and their dispatcher.
//
// Plain C-style code only (no standard-library templates) in the files with target attributes:
// an inline template instantiated there could be merged by the linker with a baseline copy (ODR),
// putting AVX-512 instructions on the AVX2 path.
#pragma once
#include <cstdint>

namespace quantreg_cpu_int8_dense {

// Weight layout ("16-row interleave", made once at load by qr8_pack): an int8 weight W [N, K]
// (per-output-channel symmetric, values in [-127, 127]; -128 is refused) is stored as
// Np = roundup(N, 16) rows by Kp = roundup(K, 16) columns, zero-padded, by groups of 16 rows:
//   group g at byte g * 16 * Kp; inside, k-step s (4 columns) at s * 64; inside, row r at r * 4:
//   bytes W[16g + r][4s .. 4s + 3].
// So one 64-byte line holds 4 columns of 16 rows: an AVX-512 lane (an AVX2 lane for each half)
// is one output row, a GEMV reads one sequential stream, and there is no horizontal sum.
constexpr int64_t kRows = 16;
constexpr int64_t kColAlign = 16;
constexpr int64_t kStepBytes = 64;

// Activations, per token, quantised symmetrically: q = round(x / s), s = max|x| / 127, q in
// [-127, 127], Kp bytes per token (zero padding). The AVX2 path reads q as int8; the VNNI path
// reads q + 128 as uint8 (vpdpbusd multiplies u8 x s8) and subtracts 128 * rowsum(W) after.
//
// A tile: one 16-row group times M tokens (M <= 8 on AVX-512, <= 4 on AVX2) over all Kp columns,
// writing the exact int32 dot products out[m * 16 + r] (without the VNNI correction).
typedef void (*TileFn)(const int8_t* w, int64_t kp, const uint8_t* act, int64_t act_stride, int m, int32_t* out);

void tile_avx2(const int8_t* w, int64_t kp, const uint8_t* act, int64_t act_stride, int m, int32_t* out);
void tile_avx512(const int8_t* w, int64_t kp, const uint8_t* act, int64_t act_stride, int m, int32_t* out);

constexpr int kTileAvx2 = 4;
constexpr int kTileAvx512 = 8;

#define QR8_AVX2 __attribute__((target("avx2,fma")))
#define QR8_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))
#define QR8_INLINE __attribute__((always_inline)) inline

// Software prefetch distance in the weight stream (bytes ahead); the address is formed in integer
// arithmetic (it may lie past the end; a prefetch never faults).
constexpr int64_t kAhead = 4096;
#define QR8_PREFETCH(base, offset)                                                                   \
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) +                     \
                                             static_cast<uintptr_t>(offset)),                        \
               _MM_HINT_T0)

}  // namespace quantreg_cpu_int8_dense
