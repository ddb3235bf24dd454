// Shared declarations of the ISA-specific MXFP4 x Q8 GEMV kernels.
//
// This header (and the kernel files that include it) must stay free of torch and of any C++
// standard-library template: the kernel files carry __attribute__((target(...))) functions, and
// an inline template instantiated there could be merged by the linker with the baseline copy
// (ODR), putting AVX-512 instructions on the AVX2 path. Plain C-style code only.
#pragma once
#include <cstdint>

namespace quantreg_cpu_mxfp4 {

// Quantised activation layout ("Q8 groups"), the same for every ISA path. A row of K elements is
// nb = K/32 blocks, grouped by 4 into ng = ceil(nb/4) groups of kGroupBytes bytes each:
//   bytes   0..63  : int8, the even elements (0,2,..,30) of blocks 0..3, 16 per block in order
//   bytes  64..127 : int8, the odd elements of blocks 0..3, same order
//   bytes 128..191 : int32 x16, lane l = -12 * (sum of even and odd bytes 4l..4l+3): the
//                    correction for the +12 offset that makes the weight codes unsigned
//   bytes 192..255 : fp32 x16, lane l = (scale of block l/4) * 0.5 (the weight LUT holds
//                    doubled E2M1 values)
// Missing blocks of the last group are zero (int8 0, scale 0). Lane l of a dpbusd/maddubs+madd
// over bytes 4l..4l+3 therefore belongs to block l/4, in both halves, for both ISAs.
constexpr int kGroupBlocks = 4;
constexpr int64_t kGroupBytes = 256;

// Prefetch base + offset. The address is formed in integer arithmetic: it may lie past the end of
// the tensor (the last quads prefetch rows that do not exist), where pointer arithmetic would be
// undefined; a prefetch instruction never faults.
#define QR_PREFETCH(base, offset)                                                                    \
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) +                     \
                                             static_cast<uintptr_t>(offset)),                        \
               _MM_HINT_T0)

inline int64_t q8_groups(int64_t k) { return (k / 32 + kGroupBlocks - 1) / kGroupBlocks; }

// One GEMV job: rows [row_begin, row_end) of one expert's MXFP4 weight ([N, K/2] blocks,
// [N, K/32] E8M0 scales, rows contiguous) times M quantised activations; writes
// out[m][row] = sum_k W[row, k] * act_m[k] (fp32, no bias).
struct GemvJob {
  const uint8_t* blocks;
  const uint8_t* scales;
  int64_t k;
  int64_t row_begin;
  int64_t row_end;
  const uint8_t* const* act;  // M pointers to Q8 groups
  float* const* out;          // M pointers to output rows (indexed by row)
  int64_t m;
};

void gemv_avx2(const GemvJob& job);
void gemv_avx512(const GemvJob& job);

// Rows [0, rows) of one expert's MXFP4 weight ([rows, K/2] blocks, [rows, K/32] scales) -> bf16
// bit patterns [rows, K], exactly (decode_bf16.cpp; the prefill path's scratch tile).
void decode_rows_bf16_avx2(const uint8_t* blocks, const uint8_t* scales, int64_t rows, int64_t k, uint16_t* dst);

// XOR-reduce of n bytes with 256-bit loads: one read pass at full speed (the bench's floor).
uint64_t read_pass_avx2(const uint8_t* p, int64_t n);

}  // namespace quantreg_cpu_mxfp4
