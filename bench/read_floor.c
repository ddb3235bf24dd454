/* The MXFP4 read floor of bench/cpu_mxfp4_bench.py: one read pass over the given byte ranges,
 * 256-bit loads XOR-reduced, the ranges cut into 256 KiB chunks shared by OpenMP threads. Built by
 * the bench itself (read_floor.py), not part of the plugin: production code carries no bench
 * helper. Returns the XOR so the reads cannot be optimised away. */
#include <immintrin.h>
#include <stdint.h>

static uint64_t pass(const uint8_t* p, int64_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    a0 = _mm256_xor_si256(a0, _mm256_loadu_si256((const __m256i*)(p + i)));
    a1 = _mm256_xor_si256(a1, _mm256_loadu_si256((const __m256i*)(p + i + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_loadu_si256((const __m256i*)(p + i + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_loadu_si256((const __m256i*)(p + i + 96)));
  }
  const __m256i a = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
  uint64_t lanes[4];
  _mm256_storeu_si256((__m256i*)lanes, a);
  uint64_t out = lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
  for (; i < n; ++i) out ^= p[i];
  return out;
}

/* chunks: count (pointer, length) pairs. */
uint64_t read_pass(const uint8_t* const* ptrs, const int64_t* lens, int64_t count, int threads) {
  uint64_t acc = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(^ : acc)
  for (int64_t i = 0; i < count; ++i) acc ^= pass(ptrs[i], lens[i]);
  return acc;
}
