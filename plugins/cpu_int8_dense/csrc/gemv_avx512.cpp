// AVX-512 VNNI tile: one 16-row group (int8_dense.h layout) times up to 8 tokens, exact int32 dots.
//
// Per k-step (4 columns, one 64-byte line = 16 rows x 4 bytes) and token: one vpdpbusd of the
// token's 4 activation bytes (q + 128, uint8, broadcast) against the line (int8): lane r gets
// sum_j (q_j + 128) * W[r][j] added in int32. vpdpbusd adds the four 16-bit-exact products
// straight into the int32 lane, with no saturating intermediate (only vpdpbusds saturates, and
// only the final int32): |sum| <= Kp * 255 * 127 < 2^31 for Kp < 66,000. The +128 bias is removed
// by the caller (128 * rowsum(W)). Compiled with a target attribute, never -m flags: the
// dispatcher calls it only after __builtin_cpu_supports said yes.
#include <immintrin.h>

#include <cstring>

#include "int8_dense.h"

namespace quantreg_cpu_int8_dense {
namespace {

QR8_AVX512 QR8_INLINE __m512i bcast32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// M tokens, C independent accumulator chains per token (vpdpbusd's latency hidden at small M).
template <int M, int C>
QR8_AVX512 void tile(const int8_t* w, int64_t kp, const uint8_t* act, int64_t stride, int32_t* out) {
  __m512i acc[M][C];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_si512();
  const int64_t steps = kp / 4;  // kp is a multiple of 16: steps a multiple of 4
  for (int64_t s = 0; s < steps; s += 4) {
    const int8_t* line = w + s * kStepBytes;
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      QR8_PREFETCH(line, kAhead + i * kStepBytes);
      const __m512i wv = _mm512_loadu_si512(line + i * kStepBytes);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m)
        acc[m][i % C] = _mm512_dpbusd_epi32(acc[m][i % C], bcast32(act + m * stride + 4 * (s + i)), wv);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    __m512i sum = acc[m][0];
#pragma GCC unroll 4
    for (int c = 1; c < C; ++c) sum = _mm512_add_epi32(sum, acc[m][c]);
    _mm512_storeu_si512(out + m * kRows, sum);
  }
}

}  // namespace

QR8_AVX512 void tile_avx512(const int8_t* w, int64_t kp, const uint8_t* act, int64_t stride, int m, int32_t* out) {
  switch (m) {
    case 1: tile<1, 4>(w, kp, act, stride, out); break;
    case 2: tile<2, 2>(w, kp, act, stride, out); break;
    case 3: tile<3, 2>(w, kp, act, stride, out); break;
    case 4: tile<4, 1>(w, kp, act, stride, out); break;
    case 5: tile<5, 1>(w, kp, act, stride, out); break;
    case 6: tile<6, 1>(w, kp, act, stride, out); break;
    case 7: tile<7, 1>(w, kp, act, stride, out); break;
    case 8: tile<8, 1>(w, kp, act, stride, out); break;
    default: break;
  }
}

}  // namespace quantreg_cpu_int8_dense
