// MXFP4 rows -> bf16, exactly: the prefill path's weight decode (AVX2, every x86-64 host this
// plugin runs on). Every E2M1 value times 2^(e-127) is a bf16 (3 significant bits, exponent in
// range), so the fp32 product's top 16 bits are the bf16 value: a shift, no rounding.
//
// Per 32-block: vpshufb through a table of doubled E2M1 values (int8), interleave the low/high
// nibbles back into element order, widen to fp32, multiply by 2^(e-128) (halving the table's
// doubling), keep the high halves. Byte 0 scales to 0 and 255 to NaN, like the GEMV kernels.
#include <immintrin.h>

// builtins, not <cmath>: no inline library code compiled for AVX2 here (see gemv.h)

#include "gemv.h"

namespace quantreg_cpu_mxfp4 {
namespace {

QR_AVX2 inline void store_bf16x16(uint16_t* dst, __m256 a, __m256 b) {
  const __m256i ia = _mm256_srli_epi32(_mm256_castps_si256(a), 16);
  const __m256i ib = _mm256_srli_epi32(_mm256_castps_si256(b), 16);
  // packus works per 128-bit lane: [a0..3 b0..3 | a4..7 b4..7] -> reorder the 64-bit quarters.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(ia, ib), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
}

// The 16 packed bytes of (row, block b) in vLLM's order, from the 16-row interleave (gemv.h).
QR_AVX2 inline __m128i row_block(const uint8_t* blocks, const uint8_t* scales, int64_t n, int64_t row, int64_t b,
                                 int64_t k, uint8_t* scale) {
  const int64_t body = n - n % kRowGroup;
  if (row >= body) {  // the row-major tail
    *scale = scales[row * (k / 32) + b];
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks + row * (k / 2) + b * 16));
  }
  const int64_t g = row / kRowGroup, r = row % kRowGroup;
  const uint8_t* p = blocks + g * kRowGroup * (k / 2) + b * kGroupBlockBytes + r * 4;
  *scale = scales[g * kRowGroup * (k / 32) + b * kRowGroup + r];
  int32_t d[4];
  for (int i = 0; i < 4; ++i) __builtin_memcpy(&d[i], p + 64 * i, 4);
  return _mm_setr_epi32(d[0], d[1], d[2], d[3]);
}

}  // namespace

QR_AVX2 void decode_rows_bf16_avx2(const uint8_t* blocks, const uint8_t* scales, int64_t n, int64_t row0,
                                   int64_t rows, int64_t k, uint16_t* dst) {
  float scale_of[256];
  scale_of[0] = 0.f;
  for (int s = 1; s < 255; ++s) scale_of[s] = __builtin_ldexpf(1.f, s - 128);
  scale_of[255] = __builtin_nanf("");
  const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i nib = _mm_set1_epi8(0x0F);
  const int64_t nb = k / 32;
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* out = dst + r * k;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t sb;
      const __m128i w = row_block(blocks, scales, n, row0 + r, b, k, &sb);
      const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(w, nib));
      const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(w, 4), nib));
      const __m128i e0 = _mm_unpacklo_epi8(lo, hi);  // elements 0..15
      const __m128i e1 = _mm_unpackhi_epi8(lo, hi);  // elements 16..31
      const __m256 sc = _mm256_set1_ps(scale_of[sb]);
      const __m256 f0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e0)), sc);
      const __m256 f1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e0, 8))), sc);
      const __m256 f2 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e1)), sc);
      const __m256 f3 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e1, 8))), sc);
      store_bf16x16(out + b * 32, f0, f1);
      store_bf16x16(out + b * 32 + 16, f2, f3);
    }
  }
}

}  // namespace quantreg_cpu_mxfp4
