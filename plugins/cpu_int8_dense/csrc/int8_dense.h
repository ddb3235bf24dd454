// quantreg-cpu-int8-dense: declarations shared by the int8 GEMV kernels and their dispatcher.
//
// Plain C-style code only (no standard-library templates) in the files with target attributes:
// an inline template instantiated there could be merged by the linker with a baseline copy (ODR),
// putting AVX-512 instructions on the AVX2 path.
//
// Numerics (issue 54): block-scaled int8 as llama.cpp's Q8_0 -- weights AND activations rounded to
// int8 with one scale per block of kBlock = 32 values along K. Per (row, block) the int8 dot product
// is exact in int32; it is converted to float and accumulated in fp32 as
//   acc = fma(float(dot_b), wscale[r][b] * xscale[t][b], acc)      (b in order 0, 1, ...)
// with the same operations lane by lane on both ISA paths, so they agree to the last bit.
#pragma once
#include <cstdint>

namespace quantreg_cpu_int8_dense {

// Weight layout ("16-row interleave", made once at load by qr8_pack): an int8 weight W [N, K]
// (symmetric per (row, 32-block), values in [-127, 127]; -128 is refused) is stored as Np =
// roundup(N, 16) rows by Kp = roundup(K, 32) columns, zero-padded, by groups of 16 rows:
//   group g at byte g * 16 * Kp; inside, k-step s (4 columns) at s * 64; inside, row r at r * 4:
//   bytes W[16g + r][4s .. 4s + 3].
// So one 64-byte line holds 4 columns of 16 rows: an AVX-512 lane (an AVX2 lane for each half)
// is one output row, a GEMV reads one sequential stream, and there is no horizontal sum. A 32-block
// is 8 consecutive lines (512 bytes).
// The VNNI path offsets each line by 128 in a register (xor 0x80: w + 128 as uint8, since vpdpbusd
// multiplies u8 x s8): the dot is then sum(w x) + 128 * sum(x), and sum(x) per (token, block) is
// computed once when the activations are quantised -- no per-(row, block) correction is stored and
// read. (The xor is on the VNNI path, which has slack at one token; the AVX2 path, whose sign trick
// takes more instructions per line, reads w as it is.)
//
// Weight scales: fp16 (as GGUF stores Q8_0's), [groups][Kp / 32][16]: the 16 rows' scales of one
// block are 32 contiguous bytes (one vcvtph2ps on AVX-512, two on AVX2). Padding rows: scale 0.
constexpr int64_t kRows = 16;
constexpr int64_t kBlock = 32;
constexpr int64_t kColAlign = kBlock;
constexpr int64_t kStepBytes = 64;
constexpr int64_t kStepsPerBlock = kBlock / 4;

// Activations, per token and 32-block, quantised symmetrically: q = round(x * (127 / amax)),
// s = amax / 127 (fp32), q in [-127, 127]; 128 x the block's sum of q (int32) for the VNNI path. Kp bytes
// per token (zero padding, scale 0, sum 0).
//
// A tile: one 16-row group times M tokens (M <= 8 on AVX-512, <= 4 on AVX2) over all Kp columns,
// writing the fp32 accumulations out[m * 16 + r] (before the bias).
struct Tile {
  const int8_t* w;         // the group's first line
  const uint16_t* wscale;  // the group's fp16 scales [Kp / 32][16]
  int64_t kp;
  const int8_t* act;     // token 0 of the tile; token m at act + m * kp
  const float* xscale;   // token 0's block scales; token m at xscale + m * (kp / 32)
  const int32_t* xsum;   // token 0's block sums of q times 128 (the VNNI offset's share; same layout)
};

typedef void (*TileFn)(const Tile& t, int m, float* out);

void tile_avx2(const Tile& t, int m, float* out);
void tile_avx512(const Tile& t, int m, float* out);

constexpr int kTileAvx2 = 4;
constexpr int kTileAvx512 = 8;

#define QR8_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QR8_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define QR8_INLINE __attribute__((always_inline)) inline

// Software prefetch distance in the weight stream (bytes ahead); the address is formed in integer
// arithmetic (it may lie past the end; a prefetch never faults).
constexpr int64_t kAhead = 4096;
#define QR8_PREFETCH(base, offset)                                                                   \
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) +                     \
                                             static_cast<uintptr_t>(offset)),                        \
               _MM_HINT_T0)

}  // namespace quantreg_cpu_int8_dense
