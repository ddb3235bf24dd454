// AVX-512 (F/BW/VL/VNNI) MXFP4 x Q8 GEMV over the 16-row interleave (gemv.h). Compiled with a
// target attribute, never with -m flags, so the same binary runs on AVX2-only hosts (the
// dispatcher only calls this after checking __builtin_cpu_supports).
//
// Per 32-block of a 16-row group (256 weight bytes = 4 vectors, lane r = row r):
//   low / high nibbles of each vector -> vpshufb through the 16-entry table of 12 + 2*E2M1
//   (0..24, unsigned: vpdpbusd wants u8 x s8); the 16 E8M0 bytes -> 2^(e-127) as fp32 in one
//   zero-extension and a shift (shared by the tile's tokens); per token, 8 vpdpbusd against the
//   block's activation dwords broadcast from memory, starting from the -12*sum correction, so
//   lane r ends with row r's integer dot product for the block: one int32 -> fp32 and one FMA by
//   weight scale * activation scale per 16 rows and block. No horizontal sums: the 16 lanes are
//   the 16 outputs. Weights are decoded once per block and reused for every token of the tile.
#include <immintrin.h>

#include "gemv.h"

namespace quantreg_cpu_mxfp4 {
namespace {

QR_AVX512 QR_INLINE __m512i bcast32(const uint8_t* p) { return _mm512_set1_epi32(load_i32(p)); }

// One 16-row group (its blocks and scales) times M tokens -> out[m][row .. row + 15].
template <int M>
QR_AVX512 void group_tile(const uint8_t* w, const uint8_t* s, int64_t nb, const uint8_t* const* act,
                          float* const* out, int64_t row) {
  const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kCodeTable)));
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512 acc[M];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * kGroupBlockBytes;
    __m512i lo[4], hi[4];
#pragma GCC unroll 4
    for (int d = 0; d < 4; ++d) {
      QR_PREFETCH(wb, kAhead + 64 * d);
      const __m512i x = _mm512_loadu_si512(wb + 64 * d);
      lo[d] = _mm512_shuffle_epi8(lut, _mm512_and_si512(x, nib));
      hi[d] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(x, 4), nib));
    }
    // E8M0 byte e -> fp32 bits e << 23 = 2^(e-127) for e in 1..254; 0 -> +0 (2^-127 dropped,
    // documented), 255 -> +inf (the output becomes non-finite, as NaN scales should).
    const __m512 ws = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16 * b))), 23));
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const uint8_t* a = act[m] + b * kQ8BlockBytes;
      __m512i d0 = bcast32(a + 32);  // the correction
      __m512i d1 = _mm512_setzero_si512();
      d0 = _mm512_dpbusd_epi32(d0, lo[0], bcast32(a + 0));
      d1 = _mm512_dpbusd_epi32(d1, hi[0], bcast32(a + 4));
      d0 = _mm512_dpbusd_epi32(d0, lo[1], bcast32(a + 8));
      d1 = _mm512_dpbusd_epi32(d1, hi[1], bcast32(a + 12));
      d0 = _mm512_dpbusd_epi32(d0, lo[2], bcast32(a + 16));
      d1 = _mm512_dpbusd_epi32(d1, hi[2], bcast32(a + 20));
      d0 = _mm512_dpbusd_epi32(d0, lo[3], bcast32(a + 24));
      d1 = _mm512_dpbusd_epi32(d1, hi[3], bcast32(a + 28));
      const float as = load_f32(a + 36);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)), _mm512_mul_ps(ws, _mm512_set1_ps(as)),
                               acc[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out[m] + row, acc[m]);
}

}  // namespace

QR_AVX512 void gemv_avx512(const GemvJob& job) {
  const int64_t nb = job.k / 32;
  for (int64_t row = job.row_begin; row < job.row_end; row += kRowGroup) {
    const RowGroup group = row_group(job.blocks, job.scales, job.k, row);
    const uint8_t *w = group.w, *s = group.s;
    // Token tiles of up to 8 (8 accumulators + 8 decoded vectors fit the 32 registers; measured
    // at 16 tokens, one thread, interleaved: 8-15 % faster than tiles of 4 under q8x2, 2-10 %
    // under q8): the group's weights (16 x K/2 bytes, 23 KB at K=2880) come from L1/L2 again for
    // every further tile.
    int64_t t = 0;
    for (; t + 8 <= job.m; t += 8) group_tile<8>(w, s, nb, job.act + t, job.out + t, row);
    switch (job.m - t) {
      case 7: group_tile<7>(w, s, nb, job.act + t, job.out + t, row); break;
      case 6: group_tile<6>(w, s, nb, job.act + t, job.out + t, row); break;
      case 5: group_tile<5>(w, s, nb, job.act + t, job.out + t, row); break;
      case 4: group_tile<4>(w, s, nb, job.act + t, job.out + t, row); break;
      case 3: group_tile<3>(w, s, nb, job.act + t, job.out + t, row); break;
      case 2: group_tile<2>(w, s, nb, job.act + t, job.out + t, row); break;
      case 1: group_tile<1>(w, s, nb, job.act + t, job.out + t, row); break;
      default: break;
    }
  }
}

}  // namespace quantreg_cpu_mxfp4
