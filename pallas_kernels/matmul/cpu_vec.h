// bfloat16 products on vector units, the paths cpu.cc runs without AMX (K % 32 == 0, N % 16 == 0):
//   AVX-512 BF16: one row of a weight tile (16 columns x one k pair, `panel`) is one `vdpbf16ps` B operand;
//     A is the broadcast pair x[m, k], x[m, k + 1]: 16 column sums of float32 per instruction.
//   AVX2 + FMA: the same tile rows, 8 columns per 256 bits, widened by bit operations (a pair's low half
//     shifted up 16 bits is its first bfloat16 as a float32, the high half masked its second), x widened
//     once per call; two FMAs per pair.
// transpose 0: a unit is PANEL columns of up to ROW_CHUNK rows of x (packed weights); rows of x in blocks
//   of R (8 / 4 / 1 on AVX-512, 4 / 1 on AVX2) against NT column tiles at once (2, or 4 for lone rows:
//   several weight streams in flight, the weights read at the memory's rate; blocks of 8 fetch the next
//   tiles into L2 as they go).
// transpose 1 (w [N, K] read in place): a unit is 32 rows of w; each result is the dot of a w row and an x
//   row, accumulated in 16 (8) float32 lanes of 32 (16) k per instruction pair and summed at the end, for
//   blocks of RN w rows x RM x rows (AVX-512: 4 x 4, 8 x 1; AVX2: 4 x 2, 8 x 1).
// Float32 accumulation throughout; the sums differ from a sequential sum only in their order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_tiles.h"
#include "ffi_common.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define JP_BF16 1
#else
#define JP_BF16 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define JP_AVX2 1
#else
#define JP_AVX2 0
#endif
#if JP_BF16 || JP_AVX2
#include <immintrin.h>
#endif

namespace jp_vec {

using jp_mm::PANEL;
using jp_mm::Problem;
using jp_mm::TILE;

// Rows of a transposed unit (transpose 1).
constexpr int64_t ROWS_T = 32;
// Rows of x a unit takes (transpose 0): a prefill's hundreds of rows are shared by the threads in pieces of
// this many per panel, so no thread is left alone at the end of a call with a whole panel of every row.
// A multiple of 8 (the row blocks), so the blocks and every sum are the same whatever the pieces.
constexpr int64_t ROW_CHUNK = 128;

// The pieces of x's rows of one panel: 1 for the transposed form, and for weights not packed ahead (each
// unit interleaves its panel, which pieces would repeat).
inline int64_t row_chunks(const Problem& P) {
  return P.transpose || !P.packed ? 1 : std::max<int64_t>(1, (P.M + ROW_CHUNK - 1) / ROW_CHUNK);
}

// The units of a product on the vector paths: per column panel its row pieces (transpose 0), else rows
// of w (transpose 1).
inline int64_t units(const Problem& P) {
  return P.transpose ? (P.N + ROWS_T - 1) / ROWS_T : (P.N + PANEL - 1) / PANEL * row_chunks(P);
}

#if JP_BF16
inline __m512bh pairs(int32_t v) { return (__m512bh)_mm512_set1_epi32(v); }

// out[m0 .. m0 + R, n0 .. n0 + 16 NT] = x rows @ the NT tiles at b (tile t at b + t * stride). PF: the NT
// tiles after them (the next ones this unit or the next reads) are fetched into L2 alongside, one line per
// tile per k pair, so the first rows to read a panel from memory keep 2 NT streams in flight, not NT.
template <int R, int NT, bool PF = false>
void bf16_block(const Problem& P, const uint16_t* b, int64_t stride, int64_t m0, int64_t n0) {
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  const uint16_t* x = P.x + m0 * P.K;
  for (int64_t p = 0; p < P.K / 2; ++p) {  // k pair p: row p % 16 of K tile p / 16, 32 elements each
    __m512bh w[NT];
    for (int t = 0; t < NT; ++t) w[t] = (__m512bh)_mm512_loadu_si512(b + t * stride + p * 32);
    if constexpr (PF)  // a prefetch never faults, so the tiles past the matrix's last are no harm
      for (int t = 0; t < NT; ++t) _mm_prefetch(reinterpret_cast<const char*>(b + (NT + t) * stride + p * 32), _MM_HINT_T1);
    for (int r = 0; r < R; ++r) {
      int32_t v;
      std::memcpy(&v, x + r * P.K + 2 * p, 4);
      const __m512bh xb = pairs(v);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xb, w[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(P.out + (m0 + r) * P.N + n0 + t * 16, acc[r][t]);
}

// v[16] (16 float32 lanes each) -> one vector of their 16 lane sums, lane l = the sum of v[l]: pairs
// folded by in-lane unpacks (4-byte, then 8-byte), then by 128-bit lane shuffles; 45 instructions where
// 16 horizontal sums take about 130. Every v[l] is summed in the same order, whatever l (and RM).
inline __m512 sum16(const __m512* v) {
  __m512 c[8], d[4], e[2];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: v[2k] at even positions, v[2k + 1] at odd
    c[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int q = 0; q < 4; ++q) {  // per 128-bit lane: position p holds a partial sum of v[4q + p]
    const __m512d a = _mm512_castps_pd(c[2 * q]), b = _mm512_castps_pd(c[2 * q + 1]);
    d[q] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int h = 0; h < 2; ++h)  // 128-bit lanes 0 + 1 and 2 + 3 of d[2h], then of d[2h + 1]
    e[h] = _mm512_add_ps(_mm512_shuffle_f32x4(d[2 * h], d[2 * h + 1], 0x88),
                         _mm512_shuffle_f32x4(d[2 * h], d[2 * h + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
}

// out[m0 .. m0 + RM, n0 .. n0 + RN] = x rows . w rows (transpose 1); RN * RM <= 16, RN 4 or 8.
template <int RN, int RM>
void bf16_dots(const Problem& P, int64_t n0, int64_t m0) {
  __m512 acc[RN][RM];
  for (int i = 0; i < RN; ++i)
    for (int j = 0; j < RM; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* w = P.w + n0 * P.K;
  const uint16_t* x = P.x + m0 * P.K;
  for (int64_t k = 0; k < P.K; k += 32) {
    __m512bh xs[RM];
    for (int j = 0; j < RM; ++j) xs[j] = (__m512bh)_mm512_loadu_si512(x + j * P.K + k);
    for (int i = 0; i < RN; ++i) {
      const __m512bh wi = (__m512bh)_mm512_loadu_si512(w + i * P.K + k);
      for (int j = 0; j < RM; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wi, xs[j]);
    }
  }
  static_assert(RN * RM <= 16 && (RN == 4 || RN == 8), "one sum16 of RM x rows, RN sums each");
  __m512 v[16];  // v[j * RN + i] = acc[i][j]: x row j's RN sums end up side by side
  for (int l = 0; l < 16; ++l) v[l] = l < RN * RM ? acc[l % RN][l / RN] : _mm512_setzero_ps();
  alignas(64) float s[16];
  _mm512_store_ps(s, sum16(v));
  for (int j = 0; j < RM; ++j) std::memcpy(P.out + (m0 + j) * P.N + n0, s + j * RN, RN * sizeof(float));
}
#endif

#if JP_AVX2
// A 256-bit vector of 8 bfloat16 pairs -> the pairs' first (lo) and second (hi) halves as float32.
inline void widen(__m256i v, __m256& lo, __m256& hi) {
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// Where x[m, k] lies in a row of xf, x widened for the AVX2 path: per 16 k, the 8 even k then the 8 odd,
// so one 256-bit load lines up with the halves `widen` makes of 16 consecutive bfloat16 of a w row.
inline int64_t xf_index(int64_t k) { return (k & ~int64_t{15}) + (k & 1) * 8 + ((k & 15) >> 1); }

// out[m0 .. m0 + R, n0 .. n0 + 16 NT] = x rows (xf: widened) @ the NT tiles at b (tile t at b + t * stride).
template <int R, int NT>
void avx2_block(const Problem& P, const float* xf, const uint16_t* b, int64_t stride, int64_t m0, int64_t n0) {
  __m256 acc[R][NT * 2];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < NT * 2; ++h) acc[r][h] = _mm256_setzero_ps();
  const float* x = xf + m0 * P.K;
  for (int64_t p = 0; p < P.K / 2; ++p) {  // k pair p (as in bf16_block)
    __m256 lo[NT * 2], hi[NT * 2];
    for (int h = 0; h < NT * 2; ++h)
      widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (h / 2) * stride + p * 32 + (h % 2) * 16)),
            lo[h], hi[h]);
    const int64_t e = xf_index(2 * p), o = xf_index(2 * p + 1);
    for (int r = 0; r < R; ++r) {
      const __m256 x0 = _mm256_broadcast_ss(x + r * P.K + e), x1 = _mm256_broadcast_ss(x + r * P.K + o);
      for (int h = 0; h < NT * 2; ++h) acc[r][h] = _mm256_fmadd_ps(hi[h], x1, _mm256_fmadd_ps(lo[h], x0, acc[r][h]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < NT * 2; ++h) _mm256_storeu_ps(P.out + (m0 + r) * P.N + n0 + h * 8, acc[r][h]);
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// out[m0 .. m0 + RM, n0 .. n0 + RN] = x rows (xf: widened) . w rows (transpose 1).
template <int RN, int RM>
void avx2_dots(const Problem& P, const float* xf, int64_t n0, int64_t m0) {
  __m256 acc[RN][RM];
  for (int i = 0; i < RN; ++i)
    for (int j = 0; j < RM; ++j) acc[i][j] = _mm256_setzero_ps();
  const uint16_t* w = P.w + n0 * P.K;
  const float* x = xf + m0 * P.K;
  for (int64_t k = 0; k < P.K; k += 16)
    for (int i = 0; i < RN; ++i) {
      __m256 lo, hi;
      widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * P.K + k)), lo, hi);
      for (int j = 0; j < RM; ++j)
        acc[i][j] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + j * P.K + k + 8),
                                    _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + j * P.K + k), acc[i][j]));
    }
  for (int i = 0; i < RN; ++i)
    for (int j = 0; j < RM; ++j) P.out[(m0 + j) * P.N + n0 + i] = sum8(acc[i][j]);
}

// x [M, K] widened to float32 in the order of `xf_index` -> xf [M, K].
inline void widen_x(const Problem& P, float* xf) {
  for (int64_t m = 0; m < P.M; ++m)
    for (int64_t k = 0; k < P.K; ++k) xf[m * P.K + xf_index(k)] = jp::bf16_to_f32(P.x[m * P.K + k]);
}
#endif

// Unit u of the product on the vector path `avx512` (AVX-512 BF16) or not (AVX2; xf: x widened).
template <bool AVX512>
void unit(const Problem& P, const float* xf, int64_t u) {
  const int64_t M = P.M, KB = P.K / 32, stride = KB * TILE;
  if (P.transpose) {  // 32 rows of w (16 at the end of an odd number of tiles)
    const int64_t n0 = u * ROWS_T, rows = std::min<int64_t>(ROWS_T, P.N - n0);
    int64_t m = 0;
    if constexpr (AVX512) {
#if JP_BF16
      const int64_t m4 = M / 4 * 4;  // w's 4 rows stay in L1 while every block of 4 x rows takes them
      for (int64_t n = n0; n < n0 + rows && m4; n += 4)
        for (m = 0; m < m4; m += 4) bf16_dots<4, 4>(P, n, m);
      for (m = m4; m < M; ++m)
        for (int64_t n = n0; n < n0 + rows; n += 8) bf16_dots<8, 1>(P, n, m);
#endif
    } else {
#if JP_AVX2
      for (; m + 2 <= M; m += 2)
        for (int64_t n = n0; n < n0 + rows; n += 4) avx2_dots<4, 2>(P, xf, n, m);
      for (; m < M; ++m)
        for (int64_t n = n0; n < n0 + rows; n += 8) avx2_dots<8, 1>(P, xf, n, m);
#endif
    }
    return;
  }
  thread_local std::vector<uint16_t> buf;
  const int64_t chunks = row_chunks(P), m0 = u % chunks * ROW_CHUNK, M1 = std::min(M, m0 + ROW_CHUNK);
  const int64_t n0 = u / chunks * PANEL, nt = std::min<int64_t>(PANEL / 16, (P.N - n0) / 16);
  const uint16_t* b = jp_mm::panel(P, n0, nt, buf);
  int64_t m = m0;
  if constexpr (AVX512) {
#if JP_BF16
    for (; m + 8 <= M1; m += 8)  // the first rows read the panel from memory, the rest from L2
      for (int64_t t = 0; t < nt; t += 2)
        (t + 1 < nt ? (m > m0 ? bf16_block<8, 2> : bf16_block<8, 2, true>) : bf16_block<8, 1>)(
            P, b + t * stride, stride, m, n0 + t * 16);
    for (; m + 4 <= M1; m += 4)
      for (int64_t t = 0; t < nt; t += 2)
        (t + 1 < nt ? bf16_block<4, 2> : bf16_block<4, 1>)(P, b + t * stride, stride, m, n0 + t * 16);
    for (; m < M1; ++m) {
      int64_t t = 0;
      for (; t + 4 <= nt; t += 4) bf16_block<1, 4>(P, b + t * stride, stride, m, n0 + t * 16);
      for (; t < nt; ++t) bf16_block<1, 1>(P, b + t * stride, stride, m, n0 + t * 16);
    }
#endif
  } else {
#if JP_AVX2
    for (; m + 4 <= M1; m += 4)
      for (int64_t t = 0; t < nt; ++t) avx2_block<4, 1>(P, xf, b + t * stride, stride, m, n0 + t * 16);
    for (; m < M1; ++m) {
      int64_t t = 0;
      for (; t + 2 <= nt; t += 2) avx2_block<1, 2>(P, xf, b + t * stride, stride, m, n0 + t * 16);
      for (; t < nt; ++t) avx2_block<1, 1>(P, xf, b + t * stride, stride, m, n0 + t * 16);
    }
#endif
  }
}

}  // namespace jp_vec
