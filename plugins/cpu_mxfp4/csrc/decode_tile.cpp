// MXFP4 rows -> a K-major tile of fp32 or bf16, exactly: the prefill path's weight decode.
//
// The tile is what the prefill GEMM multiplies the expert's tokens by: tile[k * ldd + r] = W[row0 + r, k]
// (K-major, "B" of C = A @ B with A the tokens [m, K]). Why K-major: in the 16-row interleave
// (gemv.h) one 64-byte load holds dword d of 16 rows side by side, and nibble j of every lane is
// element 8d + j of that lane's row (element 2i = low nibble of byte i). So one shift and one
// 16-entry table lookup (vpermps: the lane's low 4 bits pick an fp32 E2M1 value) give element k of
// 16 rows at once, and one multiply by the 16 rows' scales (2^(e-127), one vector per block: lane =
// row) finishes them: 3 instructions and a 64-byte store per 16 values, no transposition. (The
// row-major decode this replaced gathered 4 dwords per row and block and broadcast each row's
// scale: about 3x the instructions.)
//
// Exactness: every E2M1 value times 2^(e-127) is an fp32 and a bf16 (3 significant bits, exponent
// in range), so bf16 output is the fp32 value's top half, no rounding. E8M0 byte 0 scales to +0,
// 255 to +inf (non-finite outputs for the rows that use it, as on the GEMV path).
#include <immintrin.h>

#include "gemv.h"

namespace quantreg_cpu_mxfp4 {
namespace {

// E2M1 code -> value (codes 8..15 are the negatives; 8 = -0).
constexpr float kE2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

}  // namespace

// Groups of 16 rows [row0, row0 + rows) (whole groups of the body) -> tile columns [col0, col0 + rows).
QR_AVX512 void decode_tile_avx512(const uint8_t* blocks, const uint8_t* scales, int64_t row0, int64_t rows, int64_t k,
                                  void* dst, int64_t ldd, int64_t col0, int32_t bf16) {
  const __m512 table = _mm512_loadu_ps(kE2M1);
  const int64_t nb = k / 32;
  for (int64_t g = 0; g < rows; g += kRowGroup) {
    const RowGroup group = row_group(blocks, scales, k, row0 + g);
    const uint8_t *w = group.w, *s = group.s;
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 ws = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16 * b))), 23));
#pragma GCC unroll 4
      for (int d = 0; d < 4; ++d) {
        const __m512i x = _mm512_loadu_si512(w + b * kGroupBlockBytes + 64 * d);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(x, 4 * j), table), ws);
          const int64_t at = (32 * b + 8 * d + j) * ldd + col0 + g;
          if (bf16) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(dst) + at),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
          } else {
            _mm512_storeu_ps(static_cast<float*>(dst) + at, v);
          }
        }
      }
    }
  }
}

// The same with 256-bit vectors (a 16-row group as two halves of 8 rows), fp32 only: vpermps has 8
// entries here, so the table holds the magnitudes and the code's bit 3 becomes the sign bit.
QR_AVX2 void decode_tile_avx2(const uint8_t* blocks, const uint8_t* scales, int64_t row0, int64_t rows, int64_t k,
                              float* dst, int64_t ldd, int64_t col0) {
  const __m256 table = _mm256_loadu_ps(kE2M1);
  const __m256i sign = _mm256_set1_epi32(static_cast<int32_t>(0x80000000u));
  const int64_t nb = k / 32;
  for (int64_t g = 0; g < rows; g += kRowGroup) {
    const RowGroup group = row_group(blocks, scales, k, row0 + g);
    const uint8_t *w = group.w, *s = group.s;
    for (int64_t b = 0; b < nb; ++b) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256 ws = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 16 * b + 8 * h))), 23));
#pragma GCC unroll 4
        for (int d = 0; d < 4; ++d) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kGroupBlockBytes + 64 * d + 32 * h));
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) {
            const __m256i code = _mm256_srli_epi32(x, 4 * j);
            const __m256 mag = _mm256_permutevar8x32_ps(table, code);
            const __m256 neg = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(code, 28), sign));
            _mm256_storeu_ps(dst + (32 * b + 8 * d + j) * ldd + col0 + g + 8 * h,
                             _mm256_mul_ps(_mm256_or_ps(mag, neg), ws));
          }
        }
      }
    }
  }
}

}  // namespace quantreg_cpu_mxfp4
