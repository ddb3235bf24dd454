// AVX-512 (F/BW/VL/VNNI) MXFP4 x Q8 GEMV. Compiled with a target attribute, never with -m flags,
// so the same binary runs on AVX2-only hosts (the dispatcher only calls this after checking
// __builtin_cpu_supports). See gemv.h for the activation layout.
//
// Per group of 4 blocks (128 weights = 64 packed bytes of one row) and token:
//   one 512-bit load of the row's bytes; low / high nibbles -> two vectors of codes;
//   vpshufb through a 16-entry table of 12 + 2*E2M1 (0..24, unsigned: vpdpbusd wants u8 x s8);
//   two vpdpbusd against the even / odd activation bytes, starting from the -12*sum correction;
//   int32 -> fp32, times (2^(e-127) per block) * (activation scale / 2), FMA into the row's sum.
// Weights are decoded once per group and reused for every token of the tile.
#include <immintrin.h>

#include <cstring>

#include "gemv.h"

#define QR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

namespace quantreg_cpu_mxfp4 {
namespace {

#define QR_INLINE __attribute__((always_inline)) inline

constexpr int64_t kPrefetchRows = 8;

// Dword lanes 4b..4b+3 of the result = fp32 2^(e_b - 127) for the group's 4 E8M0 bytes
// (packed little-endian in one uint32; missing blocks are byte 0).
QR_AVX512 QR_INLINE __m512 weight_scales(uint32_t packed) {
  // Within 128-bit lane L (= block L), every dword takes byte L of the broadcast, others zero.
  const __m512i pattern = _mm512_set_epi32(
      static_cast<int>(0x80808003), static_cast<int>(0x80808003), static_cast<int>(0x80808003),
      static_cast<int>(0x80808003), static_cast<int>(0x80808002), static_cast<int>(0x80808002),
      static_cast<int>(0x80808002), static_cast<int>(0x80808002), static_cast<int>(0x80808001),
      static_cast<int>(0x80808001), static_cast<int>(0x80808001), static_cast<int>(0x80808001),
      static_cast<int>(0x80808000), static_cast<int>(0x80808000), static_cast<int>(0x80808000),
      static_cast<int>(0x80808000));
  const __m512i bytes = _mm512_shuffle_epi8(_mm512_set1_epi32(static_cast<int>(packed)), pattern);
  // E8M0 byte b -> fp32 bits b << 23 = 2^(b-127) for b in 1..254; b=0 -> +0 (2^-127 dropped,
  // documented), b=255 -> +inf (so the output becomes non-finite, as NaN scales should).
  return _mm512_castsi512_ps(_mm512_slli_epi32(bytes, 23));
}

QR_AVX512 QR_INLINE float hsum(__m512 v) {
  const __m512 folded = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));  // lanes 0-7 += 8-15
  const __m256 a = _mm512_castps512_ps256(folded);
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

// One group (4 blocks = 128 weights per row) for R rows x M tokens. kTail: the last, partial
// group (valid < 4 blocks): masked loads, so nothing past the row is read.
template <int R, int M, bool kTail>
QR_AVX512 QR_INLINE void group_step(const uint8_t* const* wrow, const uint8_t* const* srow,
                                    const uint8_t* const* act, int64_t g, int valid, int64_t ahead,
                                    __m512 (&acc)[R][M]) {
  const __m512i lut = _mm512_broadcast_i32x4(
      _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512i lo[R], hi[R];
  __m512 ws[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    __m512i w;
    uint32_t packed = 0;
    if (kTail) {
      w = _mm512_maskz_loadu_epi8((1ULL << (16 * valid)) - 1, wrow[r] + g * 64);
      for (int i = 0; i < valid; ++i) packed |= static_cast<uint32_t>(srow[r][g * kGroupBlocks + i]) << (8 * i);
    } else {
      // Software prefetch of the same bytes kPrefetchRows rows further on (2 quads ahead, ~11 KB
      // at K=2880): rows are contiguous, so each quad is one region, fetched in full while the
      // quad before it is computed. (Prefetches never fault, so running past the end is safe.)
      QR_PREFETCH(wrow[r], ahead + g * 64);
      w = _mm512_loadu_si512(wrow[r] + g * 64);
      std::memcpy(&packed, srow[r] + g * kGroupBlocks, 4);
    }
    lo[r] = _mm512_shuffle_epi8(lut, _mm512_and_si512(w, nib));
    hi[r] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(w, 4), nib));
    ws[r] = weight_scales(packed);
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    const uint8_t* a = act[m] + g * kGroupBytes;
    const __m512i even = _mm512_loadu_si512(a);
    const __m512i odd = _mm512_loadu_si512(a + 64);
    const __m512i corr = _mm512_loadu_si512(a + 128);
    const __m512 as = _mm512_loadu_ps(reinterpret_cast<const float*>(a + 192));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(corr, lo[r], even), hi[r], odd);
      acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws[r], as), acc[r][m]);
    }
  }
}

template <int R, int M>
QR_AVX512 void tile(const uint8_t* const* wrow, const uint8_t* const* srow, int64_t nb,
                    const uint8_t* const* act, float* const* out, int64_t row) {
  __m512 acc[R][M];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t full = nb / kGroupBlocks;
  const int64_t ahead = kPrefetchRows * nb * 16;  // bytes of kPrefetchRows rows
  // The scales of the quad kPrefetchRows rows on: 4 * nb contiguous bytes.
  for (int64_t i = 0; i < 4 * nb; i += 64)
    QR_PREFETCH(srow[0], kPrefetchRows * nb + i);
  for (int64_t g = 0; g < full; ++g) group_step<R, M, false>(wrow, srow, act, g, kGroupBlocks, ahead, acc);
  const int rest = static_cast<int>(nb - full * kGroupBlocks);
  if (rest) group_step<R, M, true>(wrow, srow, act, full, rest, ahead, acc);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) out[m][row + r] = hsum(acc[r][m]);
}

template <int R>
QR_AVX512 void rows_tile(const uint8_t* const* wrow, const uint8_t* const* srow, int64_t nb,
                         const uint8_t* const* act, float* const* out, int64_t row, int64_t m) {
  int64_t t = 0;
  for (; t + 4 <= m; t += 4) tile<R, 4>(wrow, srow, nb, act + t, out + t, row);
  switch (m - t) {
    case 3: tile<R, 3>(wrow, srow, nb, act + t, out + t, row); break;
    case 2: tile<R, 2>(wrow, srow, nb, act + t, out + t, row); break;
    case 1: tile<R, 1>(wrow, srow, nb, act + t, out + t, row); break;
    default: break;
  }
}

}  // namespace

QR_AVX512 void gemv_avx512(const GemvJob& job) {
  const int64_t nb = job.k / 32;
  const int64_t row_bytes = job.k / 2;
  // Token chunks keep the chunk's activations (2 bytes per element) within L2 while the job's
  // rows are swept; each 4-row quad's bytes stay in L1 across the chunk's token tiles.
  const int64_t chunk = 32;
  for (int64_t t0 = 0; t0 < job.m; t0 += chunk) {
    const int64_t mt = job.m - t0 < chunk ? job.m - t0 : chunk;
    const uint8_t* const* act = job.act + t0;
    float* const* out = job.out + t0;
    int64_t row = job.row_begin;
    for (; row < job.row_end; row += 4) {
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
