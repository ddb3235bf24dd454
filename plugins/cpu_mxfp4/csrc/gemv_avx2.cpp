// AVX2+FMA MXFP4 x Q8 GEMV over the 16-row interleave (gemv.h): the baseline every x86-64 host
// with AVX2 runs. Compiled with a target attribute (see gemv_avx512.cpp); the same layouts, a
// 16-row group processed as two 256-bit halves (lane r = row r of rows 0-7 / 8-15).
//
// Per 32-block, half and token: vpshufb through the 12 + 2*E2M1 table (unsigned), vpmaddubsw of
// the low / high nibble codes against the block's activation dwords broadcast from memory
// (|pair| <= 2*24*127 = 6096, so the int16 sum of 4 of them, <= 24384, never saturates), one
// vpmaddwd by 1 per 2 dwords -> the rows' int32 dot products, plus the -12*sum correction; to
// fp32, times weight scale * activation scale, FMA. No horizontal sums (lanes are rows).
#include <immintrin.h>

#include "gemv.h"

namespace quantreg_cpu_mxfp4 {
namespace {

QR_AVX2 QR_INLINE __m256i bcast32(const uint8_t* p) { return _mm256_set1_epi32(load_i32(p)); }

// One 16-row group times M (1 or 2) tokens -> out[m][row .. row + 15].
template <int M>
QR_AVX2 void group_tile(const uint8_t* w, const uint8_t* s, int64_t nb, const uint8_t* const* act,
                        float* const* out, int64_t row) {
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kCodeTable)));
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2][M];
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h)
#pragma GCC unroll 2
    for (int m = 0; m < M; ++m) acc[h][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * kGroupBlockBytes;
    const uint8_t* a[M];
#pragma GCC unroll 2
    for (int m = 0; m < M; ++m) a[m] = act[m] + b * kQ8BlockBytes;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256i dot[M];
#pragma GCC unroll 2
      for (int m = 0; m < M; ++m) dot[m] = bcast32(a[m] + 32);  // the correction
#pragma GCC unroll 2
      for (int dd = 0; dd < 4; dd += 2) {
        __m256i pair[M];
#pragma GCC unroll 2
        for (int d = dd; d < dd + 2; ++d) {
          if (h == 0) QR_PREFETCH(wb, kAhead + 64 * d);
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * d + 32 * h));
          const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(x, nib));
          const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(x, 4), nib));
#pragma GCC unroll 2
          for (int m = 0; m < M; ++m) {
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast32(a[m] + 8 * d)),
                                               _mm256_maddubs_epi16(hi, bcast32(a[m] + 8 * d + 4)));
            pair[m] = d == dd ? p : _mm256_add_epi16(pair[m], p);
          }
        }
#pragma GCC unroll 2
        for (int m = 0; m < M; ++m) dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(pair[m], ones));
      }
      // E8M0 -> 2^(e-127) (byte 0 -> +0, 255 -> +inf; see gemv_avx512) for this half's 8 rows.
      const __m256 ws = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 16 * b + 8 * h))), 23));
#pragma GCC unroll 2
      for (int m = 0; m < M; ++m) {
        const float as = load_f32(a[m] + 36);
        acc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_mul_ps(ws, _mm256_set1_ps(as)), acc[h][m]);
      }
    }
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h)
#pragma GCC unroll 2
    for (int m = 0; m < M; ++m) _mm256_storeu_ps(out[m] + row + 8 * h, acc[h][m]);
}

}  // namespace

QR_AVX2 void gemv_avx2(const GemvJob& job) {
  const int64_t nb = job.k / 32;
  for (int64_t row = job.row_begin; row < job.row_end; row += kRowGroup) {
    const RowGroup group = row_group(job.blocks, job.scales, job.k, row);
    const uint8_t *w = group.w, *s = group.s;
    int64_t t = 0;
    for (; t + 2 <= job.m; t += 2) group_tile<2>(w, s, nb, job.act + t, job.out + t, row);
    if (job.m - t == 1) group_tile<1>(w, s, nb, job.act + t, job.out + t, row);
  }
}

}  // namespace quantreg_cpu_mxfp4
