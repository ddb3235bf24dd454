// AVX-512 BF16 tile: one 16-row group (bf16_dense.h layout) times up to 8 tokens, fp32 dots, with
// vdpbf16ps: one instruction multiplies a line's 16 bf16 pairs by a token's broadcast pair.
//
// Why it is as faithful as the AVX2 path (Intel SDM, VDPBF16PS): per fp32 lane it does
//     acc += w[2s+1] * x[2s+1];  acc += w[2s] * x[2s]
// with round-to-nearest-even on each add, MXCSR neither consulted nor updated. The products of two
// bf16 values are exact in fp32 (8 + 8 significant bits), so this is the AVX2 path's pair of FMAs in
// the same order (bf16_dense.h) -- fp32 products, fp32 accumulation. One difference: it treats
// denormal inputs as zero and flushes denormal results to zero (DAZ / FTZ). A bf16 denormal has
// magnitude < 2^-126 (~1.2e-38), so a flushed input or partial sum moves a dot by less than
// 2^-126 per step: invisible at bf16 rounding of any output above ~1e-33, and the tests check that
// both paths give the same bits on data without denormals.
#include <immintrin.h>

#include <cstring>

#include "bf16_dense.h"

namespace quantreg_cpu_bf16_dense {
namespace {

template <int M, int A>
QRB_AVX512 void tile(const uint16_t* w, int64_t kp, const uint16_t* act, int64_t stride, float* out) {
  __m512 acc[M][A];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_ps();
  const int64_t steps = kp / 2;  // a multiple of 4 (kColAlign = 8)
  for (int64_t s0 = 0; s0 < steps; s0 += A) {
#pragma GCC unroll 4
    for (int a = 0; a < A; ++a) {
      const int64_t s = s0 + a;
      const uint16_t* line = w + s * kLineElems;
      QRB_PREFETCH(line, kAhead);
      const __m512bh wl = (__m512bh)_mm512_loadu_si512(line);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        int32_t pair;
        std::memcpy(&pair, act + m * stride + 2 * s, 4);
        acc[m][a] = _mm512_dpbf16_ps(acc[m][a], wl, (__m512bh)_mm512_set1_epi32(pair));
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    __m512 sum = acc[m][0];
    if (A == 2) sum = _mm512_add_ps(acc[m][0], acc[m][1 % A]);
    if (A == 4) sum = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1 % A]), _mm512_add_ps(acc[m][2 % A], acc[m][3 % A]));
    _mm512_storeu_ps(out + m * kRows, sum);
  }
}

}  // namespace

QRB_AVX512 void tile_avx512(const uint16_t* w, int64_t kp, const uint16_t* act, int64_t stride, int m, int acc, float* out) {
  switch (acc == 1 ? m : 10 * acc + m) {
    case 41: tile<1, 4>(w, kp, act, stride, out); break;
    case 22: tile<2, 2>(w, kp, act, stride, out); break;
    case 1: tile<1, 1>(w, kp, act, stride, out); break;
    case 2: tile<2, 1>(w, kp, act, stride, out); break;
    case 3: tile<3, 1>(w, kp, act, stride, out); break;
    case 4: tile<4, 1>(w, kp, act, stride, out); break;
    case 5: tile<5, 1>(w, kp, act, stride, out); break;
    case 6: tile<6, 1>(w, kp, act, stride, out); break;
    case 7: tile<7, 1>(w, kp, act, stride, out); break;
    case 8: tile<8, 1>(w, kp, act, stride, out); break;
    default: break;
  }
}

}  // namespace quantreg_cpu_bf16_dense
