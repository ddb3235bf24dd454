// AVX-512 VNNI tile: one 16-row group (int8_dense.h layout) times up to 8 tokens, block-scaled.
//
// Per 32-block (8 lines of 64 bytes = 16 rows x 32 columns) and token: eight vpdpbusd of the
// group's line (offset in the register: w ^ 0x80 = w + 128 as uint8) against the token's 4 activation bytes (int8, broadcast): lane r
// gets sum_j (W[r][j] + 128) * q_j in int32, with no saturating intermediate (only vpdpbusds
// saturates): |sum| <= 32 * 255 * 127 per block. Then, exact in int32, the offset's share
// 128 * sum_j q_j (computed when the token was quantised) is taken away, the dot
// converted to float (exact: |dot| <= 32 * 127 * 127 < 2^24) and accumulated as
// fma(dot, wscale * xscale, acc): the same lane operations as the AVX2 path (gemv_avx2.cpp), so
// the two paths agree bit for bit. Compiled with a target attribute, never -m flags: the
// dispatcher calls it only after __builtin_cpu_supports said yes.
#include <immintrin.h>

#include <cstring>

#include "int8_dense.h"

namespace quantreg_cpu_int8_dense {
namespace {

QR8_AVX512 QR8_INLINE __m512i bcast32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// M tokens, C independent int32 chains per token inside a block (vpdpbusd's latency at small M).
template <int M, int C>
QR8_AVX512 void tile(const Tile& t, float* out) {
  const int64_t blocks = t.kp / kBlock;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 facc[M];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) facc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* line = t.w + b * kStepsPerBlock * kStepBytes;
    __m512i acc[M][C];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int i = 0; i < kStepsPerBlock; ++i) {
      QR8_PREFETCH(line, kAhead + i * kStepBytes);
      const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(line + i * kStepBytes), flip);  // w + 128
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m)
        acc[m][i % C] = _mm512_dpbusd_epi32(acc[m][i % C], wv, bcast32(t.act + m * t.kp + b * kBlock + 4 * i));
    }
    const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.wscale + b * kRows)));
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      __m512i dot = acc[m][0];
#pragma GCC unroll 4
      for (int c = 1; c < C; ++c) dot = _mm512_add_epi32(dot, acc[m][c]);
      const int64_t at = m * blocks + b;
      dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(t.xsum[at]));  // xsum holds 128 * sum(q): one broadcast
      const __m512 scale = _mm512_mul_ps(ws, _mm512_set1_ps(t.xscale[at]));
      facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, facc[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * kRows, facc[m]);
}

}  // namespace

QR8_AVX512 void tile_avx512(const Tile& t, int m, float* out) {
  switch (m) {
    case 1: tile<1, 2>(t, out); break;
    case 2: tile<2, 2>(t, out); break;
    case 3: tile<3, 2>(t, out); break;
    case 4: tile<4, 1>(t, out); break;
    case 5: tile<5, 1>(t, out); break;
    case 6: tile<6, 1>(t, out); break;
    case 7: tile<7, 1>(t, out); break;
    case 8: tile<8, 1>(t, out); break;
    default: break;
  }
}

}  // namespace quantreg_cpu_int8_dense
