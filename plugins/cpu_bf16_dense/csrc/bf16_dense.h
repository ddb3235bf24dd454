// quantreg-cpu-bf16-dense: declarations shared by the bf16 GEMV tiles and their dispatcher.
//
// Plain C-style code only in the files with target attributes: an inline template instantiated
// there could be merged by the linker with a baseline copy (ODR), putting AVX-512 instructions on
// the AVX2 path.
#pragma once
#include <cstdint>

namespace quantreg_cpu_bf16_dense {

// Weight layout ("16-row pair interleave", made once at load by qrb_pack): a bf16 weight W [N, K]
// is stored as Np = roundup(N, 16) rows by Kp = roundup(K, 8) columns, zero padded, by groups of
// 16 rows: group g at element g * 16 * Kp; inside, line s (columns 2s, 2s + 1) at element s * 32;
// inside, row r at element 2r: W[16g + r][2s], W[16g + r][2s + 1] (one 32-bit lane, the even
// column in its low half). One 64-byte line = 2 columns of 16 rows: one AVX-512 lane (one AVX2
// lane for each half) per output row, a GEMV reads one sequential stream, no horizontal sum; and
// the lane is exactly the bf16 pair vdpbf16ps multiplies.
constexpr int64_t kRows = 16;
constexpr int64_t kColAlign = 8;
constexpr int64_t kLineElems = 32;

// The accumulation order, the same on both paths so that they give the same bits (up to
// vdpbf16ps's flushing of denormals, see gemv_avx512.cpp): per output row and token there are
// A = accumulators(M) fp32 partial sums; line s goes into sum s % A as
//     sum += w[2s+1] * x[2s+1];  sum += w[2s] * x[2s]      (each product exact, one rounding per add)
// and the row's dot is (S0 + S1) + (S2 + S3) (A = 4), S0 + S1 (A = 2) or S0 (A = 1). A depends on
// the call's token count (not a tile's), so both paths, whatever their tile sizes, add in one order.
inline int accumulators(int64_t m) { return m == 1 ? 4 : (m == 2 ? 2 : 1); }

// A tile: one 16-row group times M tokens with A = acc partial sums (M <= 8 on AVX-512, <= 4 on AVX2) over all Kp columns,
// writing the fp32 dots out[m * 16 + r]. The AVX2 tile reads activations as fp32 (act_stride
// floats a token), the AVX-512 tile as bf16 (act_stride uint16 a token); both zero padded to Kp.
typedef void (*TileAvx2)(const uint16_t* w, int64_t kp, const float* act, int64_t act_stride, int m, int acc, float* out);
typedef void (*TileAvx512)(const uint16_t* w, int64_t kp, const uint16_t* act, int64_t act_stride, int m, int acc, float* out);

void tile_avx2(const uint16_t* w, int64_t kp, const float* act, int64_t act_stride, int m, int acc, float* out);
void tile_avx512(const uint16_t* w, int64_t kp, const uint16_t* act, int64_t act_stride, int m, int acc, float* out);

constexpr int kTileAvx2 = 4;
constexpr int kTileAvx512 = 8;

#define QRB_AVX2 __attribute__((target("avx2,fma")))
#define QRB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

// Software prefetch distance in the weight stream (bytes ahead); the address is formed in integer
// arithmetic (it may lie past the end; a prefetch never faults).
constexpr int64_t kAhead = 4096;
#define QRB_PREFETCH(base, offset)                                                                   \
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) +                     \
                                             static_cast<uintptr_t>(offset)),                        \
               _MM_HINT_T0)

}  // namespace quantreg_cpu_bf16_dense
