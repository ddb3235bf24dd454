// AVX2 + FMA tile: one 16-row group (bf16_dense.h layout) times up to 4 tokens, fp32 dots.
//
// bf16 -> fp32 is a 16-bit shift: a 32-bit lane holds the pair (W[r][2s], W[r][2s+1]), so
// `lane << 16` is the even column as fp32 and `lane & 0xFFFF0000` the odd one -- exact, no
// rounding. Activations arrive as fp32 (bf16 activations widened exactly by the dispatcher), so
// each product w * x of two bf16 values is exact in fp32 (8 + 8 significant bits <= 24) and the
// FMA rounds once, on the add: the same fp32 arithmetic, in the same order (bf16_dense.h), as one
// step of vdpbf16ps on the AVX-512 path. With an fp32 activation the FMA still forms the exact
// product and rounds once.
// The 64-byte line is two vectors: rows 0-7 and rows 8-15, one fp32 lane per row.
#include <immintrin.h>

#include "bf16_dense.h"

namespace quantreg_cpu_bf16_dense {
namespace {

template <int M, int A>
QRB_AVX2 void tile(const uint16_t* w, int64_t kp, const float* act, int64_t stride, float* out) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 acc[M][A][2];
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int a = 0; a < A; ++a) acc[m][a][0] = acc[m][a][1] = _mm256_setzero_ps();
  const int64_t steps = kp / 2;  // a multiple of 4 (kColAlign = 8)
  for (int64_t s0 = 0; s0 < steps; s0 += A) {
#pragma GCC unroll 4
    for (int a = 0; a < A; ++a) {
      const int64_t s = s0 + a;
      const uint16_t* line = w + s * kLineElems;
      QRB_PREFETCH(line, kAhead);
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 16));
      const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(l0, 16));
      const __m256 odd0 = _mm256_castsi256_ps(_mm256_and_si256(l0, hi));
      const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(l1, 16));
      const __m256 odd1 = _mm256_castsi256_ps(_mm256_and_si256(l1, hi));
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        const __m256 xo = _mm256_broadcast_ss(act + m * stride + 2 * s + 1);
        const __m256 xe = _mm256_broadcast_ss(act + m * stride + 2 * s);
        acc[m][a][0] = _mm256_fmadd_ps(odd0, xo, acc[m][a][0]);
        acc[m][a][1] = _mm256_fmadd_ps(odd1, xo, acc[m][a][1]);
        acc[m][a][0] = _mm256_fmadd_ps(even0, xe, acc[m][a][0]);
        acc[m][a][1] = _mm256_fmadd_ps(even1, xe, acc[m][a][1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256 sum = acc[m][0][h];
      if (A == 2) sum = _mm256_add_ps(acc[m][0][h], acc[m][1 % A][h]);
      if (A == 4)
        sum = _mm256_add_ps(_mm256_add_ps(acc[m][0][h], acc[m][1 % A][h]),
                            _mm256_add_ps(acc[m][2 % A][h], acc[m][3 % A][h]));
      _mm256_storeu_ps(out + m * kRows + 8 * h, sum);
    }
  }
}

}  // namespace

QRB_AVX2 void tile_avx2(const uint16_t* w, int64_t kp, const float* act, int64_t stride, int m, int acc, float* out) {
  switch (acc == 1 ? m : 10 * acc + m) {
    case 41: tile<1, 4>(w, kp, act, stride, out); break;
    case 22: tile<2, 2>(w, kp, act, stride, out); break;
    case 1: tile<1, 1>(w, kp, act, stride, out); break;
    case 2: tile<2, 1>(w, kp, act, stride, out); break;
    case 3: tile<3, 1>(w, kp, act, stride, out); break;
    case 4: tile<4, 1>(w, kp, act, stride, out); break;
    default: break;
  }
}

}  // namespace quantreg_cpu_bf16_dense
