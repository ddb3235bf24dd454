// Shared declarations of the ISA-specific MXFP4 x Q8 GEMV kernels, and the two layouts they read.
//
// This header (and the kernel files that include it) must stay free of torch and of any C++
// standard-library template: the kernel files carry __attribute__((target(...))) functions, and
// an inline template instantiated there could be merged by the linker with the baseline copy
// (ODR), putting AVX-512 instructions on the AVX2 path. Plain C-style code only.
#pragma once
#include <cstdint>
#include <cstring>

namespace quantreg_cpu_mxfp4 {

// Weight layout ("16-row interleave", made once at load by kernel.PackedExperts.from_vllm; the
// same byte count as vLLM's row-major [N, K/2] blocks + [N, K/32] scales, in the same two
// tensors). Why: at 1 token the GEMV is bound by instructions per weight byte and by how well
// the hardware prefetcher follows the reads. In row-major order every 32-block of every row needs
// its own scale conversion and horizontal reduction; interleaved, one vector lane is one row,
// so a job reads one sequential stream and each 32-block of 16 rows costs one scale conversion
// and no horizontal sum (the ggml/llama.cpp "repack" idea, here 16 rows x 4 bytes).
// Per expert, rows [0, body) with body = N - N % 16 are stored by groups of 16 rows:
//   blocks: group G at byte G * 16 * K/2; inside, 32-block b at b * 256; inside, dword d
//           (0..3) at d * 64; inside, row r (0..15) at r * 4: bytes 4d..4d+3 of row 16G + r's
//           block b (element 2j = low nibble of byte j, as in vLLM's layout);
//   scales: group G at byte G * 16 * K/32; inside, block b at b * 16, row r at r.
// Rows [body, N) (fewer than 16) stay row-major right after (row n at n * K/2 / n * K/32),
// which is where the row-major layout has them too.
constexpr int64_t kRowGroup = 16;
constexpr int64_t kGroupBlockBytes = 256;  // one 32-block of 16 rows

// Quantised activation layout ("Q8 blocks"), the same for every ISA path. A row of K elements
// is nb = K/32 blocks of kQ8BlockBytes bytes each:
//   bytes  0..31: int8 q, for d = 0..3: bytes 8d..8d+3 = elements 8d+0, 8d+2, 8d+4, 8d+6 (the
//                 low nibbles of the weights' dword d), bytes 8d+4..8d+7 = elements 8d+1, +3,
//                 +5, +7 (the high nibbles);
//   bytes 32..35: int32, -12 * (sum of the 32 q): the correction for the +12 offset that makes
//                 the weight codes unsigned (u8 x s8 dot products);
//   bytes 36..39: fp32, the block's scale * 0.5 (the weight table holds doubled E2M1 values).
constexpr int64_t kQ8BlockBytes = 40;

// The 16-entry table both kernels and the scalar tail use: code c -> 12 + 2 * E2M1(c), 0..24.
constexpr uint8_t kCodeTable[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// The target attributes of the ISA paths (one definition each, used by every kernel file): never
// -m flags, so the same shared library runs on every x86-64 host and the dispatcher
// (qr_cpu_supports in moe.cpp) only calls a path after __builtin_cpu_supports says it can.
#define QR_AVX2 __attribute__((target("avx2,fma")))
#define QR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))
#define QR_INLINE __attribute__((always_inline)) inline

// The 16-row group holding `row` (a multiple of 16, inside the body) of one expert's weight: its
// first block byte and first scale in the layout above. The GEMV kernels and the tile decode of
// both ISA paths walk the body group by group with it.
struct RowGroup {
  const uint8_t* w;
  const uint8_t* s;
};
QR_INLINE RowGroup row_group(const uint8_t* blocks, const uint8_t* scales, int64_t k, int64_t row) {
  const int64_t group = row / kRowGroup;
  return {blocks + group * kRowGroup * (k / 2), scales + group * kRowGroup * (k / 32)};
}

// 4 bytes of a Q8 block read at any alignment (memcpy: one plain load): an activation dword, which
// the GEMV kernels broadcast to every lane, and the block's fp32 scale (bytes 36..39).
QR_INLINE int32_t load_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
QR_INLINE float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// Software prefetch distance, bytes ahead in the weight stream (16 blocks of 16 rows), both GEMV
// paths. Measured at 1 token, 1 thread (AVX-512 path, interleaved): none 15-20 % slower than
// 4 KB; 1 KB and 16 KB slower too.
constexpr int64_t kAhead = 16 * kGroupBlockBytes;

// Prefetch base + offset. The address is formed in integer arithmetic: it may lie past the end of
// the tensor, where pointer arithmetic would be undefined; a prefetch instruction never faults.
#define QR_PREFETCH(base, offset)                                                                    \
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) +                     \
                                             static_cast<uintptr_t>(offset)),                        \
               _MM_HINT_T0)

// One GEMV job: rows [row_begin, row_end) of one expert's MXFP4 weight (the layout above; the
// SIMD kernels take only whole 16-row groups, row_begin and row_end multiples of 16) times M
// quantised activations; writes out[m][row] = sum_k W[row, k] * act_m[k] (fp32, no bias).
struct GemvJob {
  const uint8_t* blocks;  // the expert's first byte
  const uint8_t* scales;  // the expert's first scale
  int64_t k;
  int64_t row_begin;
  int64_t row_end;
  const uint8_t* const* act;  // M pointers to Q8 blocks
  float* const* out;          // M pointers to output rows (indexed by row)
  int64_t m;
};

void gemv_avx2(const GemvJob& job);
void gemv_avx512(const GemvJob& job);

// Whole 16-row groups [row0, row0 + rows) of one expert's MXFP4 weight (the layout above, row0 and
// rows multiples of 16, inside the body) -> a K-major tile, exactly: dst[k * ldd + col0 + r] =
// W[row0 + r, k] (decode_tile.cpp; the prefill path's scratch tile). The AVX-512 variant writes
// fp32 or (bf16 != 0) bf16 bit patterns, the AVX2 one fp32.
void decode_tile_avx512(const uint8_t* blocks, const uint8_t* scales, int64_t row0, int64_t rows, int64_t k,
                        void* dst, int64_t ldd, int64_t col0, int32_t bf16);
void decode_tile_avx2(const uint8_t* blocks, const uint8_t* scales, int64_t row0, int64_t rows, int64_t k,
                      float* dst, int64_t ldd, int64_t col0);

}  // namespace quantreg_cpu_mxfp4
