// The bfloat16 matmul kernel's problem and its weight tiles, shared by every path of cpu.cc (AMX, AVX-512
// BF16, AVX2, scalar).
//
// The tile order (matmul/cpu.py `pack`): w [K, N] as [N / 16, K / 32, 16, 32], tile (t, kb) row r holding
// the pairs (w[kb*32 + 2r, c], w[kb*32 + 2r + 1, c]) of the 16 columns c of t: one row is AMX's B operand
// row, and one `vdpbf16ps` B operand (16 float32 lanes, each the dot of one k pair). `panel` hands a unit of
// work its columns in that order: in place when the weights were packed ahead of time, else interleaved
// into a per-thread buffer.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define JP_INTERLEAVE 1
#else
#define JP_INTERLEAVE 0
#endif

namespace jp_mm {

constexpr int64_t PANEL = 128;         // columns of w a unit takes (transpose 0): 8 tiles of 16
constexpr int64_t PREFETCH_ROWS = 16;  // rows of w ahead of the interleaving that are prefetched
constexpr int64_t TILE = 512;          // bfloat16 elements of a 16 x 32 tile

struct Problem {
  const uint16_t* x;  // [M, K] (or the zero-padded copy [Mp, K] on the AMX path)
  const uint16_t* w;  // [K, N] or [N, K], or packed [N / 16, K / 32, 16, 32]
  float* out;         // [M, N]
  int64_t M, K, N;
  bool transpose;
  bool packed;  // w in the tile order of `pack` (matmul/cpu.py)
};

// Element (k, n) of w [K, N] (transpose 0), wherever its layout puts it.
inline uint16_t weight(const Problem& P, int64_t k, int64_t n) {
  if (!P.packed) return P.w[k * P.N + n];
  return P.w[((n / 16) * (P.K / 32) + k / 32) * TILE + ((k % 32) / 2) * 32 + (n % 16) * 2 + (k % 2)];
}

#if JP_INTERLEAVE
// The VNNI interleave of two rows r0, r1 of 32 bfloat16 (columns c .. c+31): the first 16 columns' pairs
// to lo, the last 16's to hi (each 16 pairs = 64 bytes, one tile row).
inline void interleave(const uint16_t* r0, const uint16_t* r1, int cols, uint16_t* lo, uint16_t* hi) {
  static const __m512i idx_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  static const __m512i idx_hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
                                                 55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  const __mmask32 m = cols >= 32 ? 0xFFFFFFFFu : (1u << cols) - 1u;
  const __m512i a = _mm512_maskz_loadu_epi16(m, r0), b = _mm512_maskz_loadu_epi16(m, r1);
  _mm512_storeu_si512(lo, _mm512_permutex2var_epi16(a, idx_lo, b));
  if (cols > 16) _mm512_storeu_si512(hi, _mm512_permutex2var_epi16(a, idx_hi, b));
}
#endif

// The nt column tiles from column n0 of w (transpose 0; K % 32 == 0, N % 16 == 0) in the tile order, tile
// t at t * (K / 32) * TILE: w itself when packed, else buf filled by reading w's rows two at a time in order
// (a few cache lines each, prefetched ahead).
inline const uint16_t* panel(const Problem& P, int64_t n0, int64_t nt, std::vector<uint16_t>& buf) {
  const int64_t K = P.K, KB = K / 32, N = P.N;
  if (P.packed) return P.w + (n0 / 16) * KB * TILE;
  buf.resize(nt * KB * TILE);
  uint16_t* b = buf.data();
  for (int64_t kb = 0; kb < KB; ++kb)
    for (int r = 0; r < 16; ++r) {
      const int64_t k = kb * 32 + 2 * r;
      const uint16_t* r0 = P.w + k * N + n0;
      if (k + PREFETCH_ROWS + 1 < K)
        for (int64_t j = 0; j < nt * 16; j += 32) {
          __builtin_prefetch(r0 + PREFETCH_ROWS * N + j);
          __builtin_prefetch(r0 + (PREFETCH_ROWS + 1) * N + j);
        }
#if JP_INTERLEAVE
      for (int64_t t = 0; t < nt; t += 2)
        interleave(r0 + t * 16, r0 + N + t * 16, static_cast<int>(std::min<int64_t>(2, nt - t) * 16),
                   b + (t * KB + kb) * TILE + r * 32, b + ((t + 1) * KB + kb) * TILE + r * 32);
#else
      for (int64_t t = 0; t < nt; ++t)
        for (int c = 0; c < 16; ++c) {
          uint16_t* d = b + (t * KB + kb) * TILE + r * 32 + 2 * c;
          d[0] = r0[t * 16 + c], d[1] = r0[N + t * 16 + c];
        }
#endif
    }
  return b;
}

}  // namespace jp_mm
