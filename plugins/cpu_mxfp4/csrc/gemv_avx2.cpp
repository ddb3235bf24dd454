// AVX2+FMA MXFP4 x Q8 GEMV: the baseline every x86-64 host with AVX2 runs. Compiled with a
// target attribute (see gemv_avx512.cpp); same activation layout (gemv.h), processed as two
// 256-bit halves (2 blocks each) per group of 4 blocks.
//
// Per half and token: vpshufb through the 12 + 2*E2M1 table (unsigned), vpmaddubsw against the
// even and the odd activation bytes (|pair| <= 2*24*127 = 6096, so the int16 sum of both halves,
// <= 12192, never saturates), one vpmaddwd by 1 -> int32 lanes of 4 bytes, plus the -12*sum
// correction, to fp32, times weight scale * activation scale, FMA.
#include <immintrin.h>

#include <cstring>

#include "gemv.h"

#define QR_AVX2 __attribute__((target("avx2,fma")))

namespace quantreg_cpu_mxfp4 {
namespace {

#define QR_INLINE __attribute__((always_inline)) inline

constexpr int64_t kPrefetchRows = 8;

// Dword lanes 0..3 = 2^(e0 - 127), lanes 4..7 = 2^(e1 - 127) for the half's 2 E8M0 bytes
// (little-endian in one uint16; a missing block is byte 0). Byte 0 -> +0, 255 -> +inf (gemv_avx512).
QR_AVX2 QR_INLINE __m256 weight_scales(uint16_t packed) {
  const __m256i pattern = _mm256_setr_epi32(
      static_cast<int>(0x80808000), static_cast<int>(0x80808000), static_cast<int>(0x80808000),
      static_cast<int>(0x80808000), static_cast<int>(0x80808001), static_cast<int>(0x80808001),
      static_cast<int>(0x80808001), static_cast<int>(0x80808001));
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi16(static_cast<short>(packed)), pattern);
  return _mm256_castsi256_ps(_mm256_slli_epi32(bytes, 23));
}

// One half group (2 blocks = 64 weights per row) for R rows x M tokens; kTail: only 1 block left.
template <int R, int M, bool kTail>
QR_AVX2 QR_INLINE void half_step(const uint8_t* const* wrow, const uint8_t* const* srow,
                                 const uint8_t* const* act, int64_t h, int64_t ahead, __m256 (&acc)[R][M]) {
  const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                       12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i lo[R], hi[R];
  __m256 ws[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const uint8_t* p = wrow[r] + h * 32;
    __m256i w;
    uint16_t packed;
    if (kTail) {
      w = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      packed = srow[r][h * 2];
    } else {
      if (h % 2 == 0) QR_PREFETCH(p, ahead);  // see gemv_avx512
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      std::memcpy(&packed, srow[r] + h * 2, 2);
    }
    lo[r] = _mm256_shuffle_epi8(lut, _mm256_and_si256(w, nib));
    hi[r] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(w, 4), nib));
    ws[r] = weight_scales(packed);
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    // This half's 32 bytes of each 64-byte section of the group (gemv.h).
    const uint8_t* a = act[m] + (h / 2) * kGroupBytes + (h % 2) * 32;
    const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
    const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 64));
    const __m256i corr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 128));
    const __m256 as = _mm256_loadu_ps(reinterpret_cast<const float*>(a + 192));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[r], even), _mm256_maddubs_epi16(hi[r], odd));
      const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), corr);
      acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws[r], as), acc[r][m]);
    }
  }
}

template <int R, int M>
QR_AVX2 void tile(const uint8_t* const* wrow, const uint8_t* const* srow, int64_t nb,
                  const uint8_t* const* act, float* const* out, int64_t row) {
  __m256 acc[R][M];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  const int64_t full = nb / 2;
  const int64_t ahead = kPrefetchRows * nb * 16;  // see gemv_avx512
  for (int64_t i = 0; i < 4 * nb; i += 64)
    QR_PREFETCH(srow[0], kPrefetchRows * nb + i);
  for (int64_t h = 0; h < full; ++h) half_step<R, M, false>(wrow, srow, act, h, ahead, acc);
  if (nb % 2) half_step<R, M, true>(wrow, srow, act, full, ahead, acc);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[r][m]), _mm256_extractf128_ps(acc[r][m], 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
      out[m][row + r] = _mm_cvtss_f32(s1);
    }
}

template <int R>
QR_AVX2 void rows_tile(const uint8_t* const* wrow, const uint8_t* const* srow, int64_t nb,
                       const uint8_t* const* act, float* const* out, int64_t row, int64_t m) {
  int64_t t = 0;
  for (; t + 2 <= m; t += 2) tile<R, 2>(wrow, srow, nb, act + t, out + t, row);
  if (m - t == 1) tile<R, 1>(wrow, srow, nb, act + t, out + t, row);
}

}  // namespace

QR_AVX2 void gemv_avx2(const GemvJob& job) {
  const int64_t nb = job.k / 32;
  const int64_t row_bytes = job.k / 2;
  const int64_t chunk = 32;  // tokens per sweep of the job's rows (see gemv_avx512)
  for (int64_t t0 = 0; t0 < job.m; t0 += chunk) {
    const int64_t mt = job.m - t0 < chunk ? job.m - t0 : chunk;
    const uint8_t* const* act = job.act + t0;
    float* const* out = job.out + t0;
    for (int64_t row = job.row_begin; row < job.row_end; row += 4) {
      const int64_t rows = job.row_end - row < 4 ? job.row_end - row : 4;
      const uint8_t* w[4];
      const uint8_t* s[4];
      for (int r = 0; r < 4; ++r) {
        const int64_t rr = r < rows ? row + r : row;
        w[r] = job.blocks + rr * row_bytes;
        s[r] = job.scales + rr * nb;
      }
      switch (rows) {
        case 4: rows_tile<4>(w, s, nb, act, out, row, mt); break;
        case 3: rows_tile<3>(w, s, nb, act, out, row, mt); break;
        case 2: rows_tile<2>(w, s, nb, act, out, row, mt); break;
        default: rows_tile<1>(w, s, nb, act, out, row, mt); break;
      }
    }
  }
}

}  // namespace quantreg_cpu_mxfp4

namespace quantreg_cpu_mxfp4 {

// XOR of every 32-byte word in [p, p + n) (n any): one streaming read pass, the bench's floor.
QR_AVX2 uint64_t read_pass_avx2(const uint8_t* p, int64_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  const __m256i a = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
  uint64_t lanes[4];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), a);
  uint64_t out = lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
  for (; i < n; ++i) out ^= p[i];
  return out;
}

}  // namespace quantreg_cpu_mxfp4
