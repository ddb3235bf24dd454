// AVX2 tile: one 16-row group (int8_dense.h layout) times up to 4 tokens, block-scaled, with no
// saturating step.
//
// Why this needs care: AVX2 has no int8 dot product into int32. Its u8 x s8 instruction,
// vpmaddubsw, adds each PAIR of products into a SATURATING int16. With unsigned operands up to 255
// (what oneDNN's int8 GEMM feeds it without VNNI) a pair reaches 2 * 255 * 127 = 64,770 > 32,767
// and is clipped: the 0.11-0.14 relative error measured for vLLM's oneDNN int8 GEMM on AVX2
// (issue 46).
//
// Here the "sign trick" (as llama.cpp's AVX2 q8_0 dot product): vpmaddubsw(|w|, sign(q, w)), where sign(q, w) is q negated where w < 0 and
// zeroed where w == 0 (vpsignb), so each product is |w| * q * sign(w) = w * q. No pair saturates:
// the weights are in [-127, 127] (qr8_pack refuses -128, so |w| <= 127 fits the unsigned operand)
// and the activations are in [-127, 127] (the quantiser clamps), so |product| <= 127 * 127 = 16,129
// and |pair| <= 32,258 < 32,767. vpmaddwd with ones widens the pairs into int32 lanes (exact), added
// into int32 accumulators over one 32-block. Per block the exact int32 dot is converted to float and
// accumulated as fma(dot, wscale * xscale, acc), lane by lane the operations of the AVX-512 path
// (gemv_avx512.cpp): the two paths agree bit for bit. The 64-byte line is two vectors: rows 0-7
// and rows 8-15, one lane per row.
#include <immintrin.h>

#include <cstring>

#include "int8_dense.h"

namespace quantreg_cpu_int8_dense {
namespace {

template <int M>
QR8_AVX2 void tile(const Tile& t, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t blocks = t.kp / kBlock;
  __m256 facc[M][2];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) facc[m][0] = facc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* block = t.w + b * kStepsPerBlock * kStepBytes;
    __m256i acc[M][2];
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
    for (int i = 0; i < kStepsPerBlock; ++i) {
      const int8_t* line = block + i * kStepBytes;
      QR8_PREFETCH(line, kAhead);
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32));
      const __m256i a0 = _mm256_sign_epi8(w0, w0);  // |w| (w != -128)
      const __m256i a1 = _mm256_sign_epi8(w1, w1);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        int32_t q4;
        std::memcpy(&q4, t.act + m * t.kp + b * kBlock + 4 * i, 4);
        const __m256i x = _mm256_set1_epi32(q4);
        const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(x, w0));
        const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(x, w1));
        acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(p0, ones));
        acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(p1, ones));
      }
    }
    const __m128i* sp = reinterpret_cast<const __m128i*>(t.wscale + b * kRows);
    const __m256 ws0 = _mm256_cvtph_ps(_mm_loadu_si128(sp));
    const __m256 ws1 = _mm256_cvtph_ps(_mm_loadu_si128(sp + 1));
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const __m256 xs = _mm256_set1_ps(t.xscale[m * blocks + b]);
      facc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][0]), _mm256_mul_ps(ws0, xs), facc[m][0]);
      facc[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][1]), _mm256_mul_ps(ws1, xs), facc[m][1]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    _mm256_storeu_ps(out + m * kRows, facc[m][0]);
    _mm256_storeu_ps(out + m * kRows + 8, facc[m][1]);
  }
}

}  // namespace

QR8_AVX2 void tile_avx2(const Tile& t, int m, float* out) {
  switch (m) {
    case 1: tile<1>(t, out); break;
    case 2: tile<2>(t, out); break;
    case 3: tile<3>(t, out); break;
    case 4: tile<4>(t, out); break;
    default: break;
  }
}

}  // namespace quantreg_cpu_int8_dense
