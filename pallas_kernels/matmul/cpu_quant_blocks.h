// The quantized CPU product's many-row path (cpu_quant.cc runs it on AVX-512 VNNI): R rows of activations
// against NT column tiles, for the one-level formats whose scale group S is a multiple of the activation block F
// (32, 64 or 128 k: int8 / int4 of group 32 and GGUF's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 with F 32; groups of 64 /
// 128 with F the group; one scale a column, S = K, with F 128): each F block then has one activation scale dx a
// row and one weight scale a column, so a block is F / 4 vpdpbusd steps a (row, tile) and then its float work,
// and a scale group's minimum term follows its last block.
// The rows' activations are first laid out a block of R rows together (`interleave`: per 4 k, the R rows' 4
// codes side by side; per F block, the R rows' dx and code sum side by side and one byte of flags, bit r: row r's
// low plane is not all zero; per scale group the R rows' minimum terms), so the loops read them through one
// pointer at constant offsets: no per-row pointers live in general registers, none spilled around the float work.
// Wide (int16 codes as two int8 planes, 8-bit codes): the high plane's dots for all R rows into one set of
// accumulators, those shifted left by 7 (128 x; exact: |sum| <= 128 * 128 * 127 * 255 < 2^31), then the low
// plane's dots into the same accumulators for the rows whose flag is set (every row's at once when all are): a
// block's low-plane dots cost only its rows with int16 codes there, and half as many registers as two sets.
// The sums are the same integers, and the float steps the same operations in the same order, as the general path's
// (`vnni_tiles`), so a row's outputs are identical whichever path or block of rows computes them.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <utility>

namespace jp_blocks {

// One row block's interleaved activations (`interleave`), for a product of nf blocks of F k in nsg scale groups.
template <int R>
struct Block {
  const int8_t* xq;   // [nf * F / 4][R][4] the codes (wide: the high plane)
  const int8_t* xl;   // wide: [nf * F / 4][R][4] the low plane
  const float* dx;    // [nf][R]
  const float* xs;    // [nsg][R] dx * the sum of the codes (the minimum's term)
  const int32_t* qs;  // [nf][R] the sum of the codes (the zero code's term)
  const uint8_t* lf;  // wide: [nf] bit r: row r's low plane holds a nonzero code
};

// Rows r0 .. r0 + R of the row-major activations (codes xq [M, xrow] with the low plane at + Ka = nf * F, dx, qs,
// lowf [M, nf], xs [M, nsg]) -> their block's interleaved copy at the given outputs (sizes as `Block`).
template <int R>
void interleave(int64_t nf, int64_t F, int64_t nsg, bool wide, const int8_t* xq, int64_t xrow, int64_t Ka,
                const float* dx, const float* xs, const int32_t* qs, const uint8_t* lowf, int8_t* oq, int8_t* ol,
                float* odx, float* oxs, int32_t* oqs, uint8_t* olf) {
  for (int64_t c = 0; c < nf * F / 4; ++c)
    for (int r = 0; r < R; ++r) {
      std::memcpy(oq + (c * R + r) * 4, xq + r * xrow + 4 * c, 4);
      if (wide) std::memcpy(ol + (c * R + r) * 4, xq + r * xrow + Ka + 4 * c, 4);
    }
  for (int64_t f = 0; f < nf; ++f) {
    uint8_t flags = 0;
    for (int r = 0; r < R; ++r) {
      odx[f * R + r] = dx[r * nf + f], oqs[f * R + r] = qs[r * nf + f];
      flags |= static_cast<uint8_t>((lowf[r * nf + f] != 0) << r);
    }
    olf[f] = flags;
  }
  for (int64_t g = 0; g < nsg; ++g)
    for (int r = 0; r < R; ++r) oxs[g * R + r] = xs[r * nsg + g];
}

// Where a product's NT tiles are: w (tile t0's first group, tile t at + t * tb), bytes a group and the offsets of
// its scales and minima (after its codes), the scales' width, the zero code, the minimum's presence, groups, and
// the k of a block (F) and of a group (F * fpg).
struct Tiles {
  const uint8_t* w;
  int64_t tb, gbytes, scale_off, part_bytes, sb;
  int32_t zero;
  bool has_min;
  int64_t ng, F, fpg;
};

inline void dot(__m512i& acc, __m512i w, __m512i x) { __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x)); }

inline __m512 floats16(const uint8_t* p, int64_t sb) {
  return sb == 2 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))) : _mm512_loadu_ps(p);
}

inline __m512i bcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// acc[r][t] += the 8-bit dots of one block of F k (w: tile 0's codes) with the rows' plane x ([F / 4][R][4]).
template <int R, int NT>
inline void plane8(__m512i (&acc)[R][NT], const uint8_t* w, int64_t tb, const int8_t* x, int64_t F) {
#pragma GCC unroll 1
  for (int64_t q = 0; q < F / 4; ++q) {
    __m512i wv[NT];
    for (int t = 0; t < NT; ++t) wv[t] = _mm512_loadu_si512(w + t * tb + q * 64);
    for (int r = 0; r < R; ++r) {
      const __m512i xb = bcast(x + (q * R + r) * 4);
      for (int t = 0; t < NT; ++t) dot(acc[r][t], wv[t], xb);
    }
  }
}

// The low plane's dots of row I (`plane8` for that row alone) when bit I of flags is set.
template <int R, int NT, int I>
inline void low_row(__m512i (&acc)[NT], unsigned flags, const uint8_t* w, int64_t tb, const int8_t* x, int64_t F) {
  if (!(flags >> I & 1)) return;
#pragma GCC unroll 1
  for (int64_t q = 0; q < F / 4; ++q) {
    const __m512i xb = bcast(x + (q * R + I) * 4);
    for (int t = 0; t < NT; ++t) dot(acc[t], _mm512_loadu_si512(w + t * tb + q * 64), xb);
  }
}
template <int R, int NT, size_t... I>
inline void low_rows(__m512i (&acc)[R][NT], unsigned flags, const uint8_t* w, int64_t tb, const int8_t* x,
                     int64_t F, std::index_sequence<I...>) {
  (low_row<R, NT, static_cast<int>(I)>(acc[I], flags, w, tb, x, F), ...);
}

// Row r of the block @ tile t (BITS-bit codes; WIDE: int16 activation codes, 8-bit codes only) -> out + r * ldo +
// 16 t, its first `last` columns in the last tile (the sums stay in registers until then).
template <int R, int NT, int BITS, bool WIDE>
void tiles(const Tiles& T, const Block<R>& X, float* out, int64_t ldo, int last) {
  static_assert(!WIDE || BITS == 8, "the wide many-row path takes 8-bit codes");
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  const int64_t tb = T.tb, F = T.F, bbytes = F * 16 * BITS / 8;  // a block's code bytes a tile
  __m512 y[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) y[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < T.ng; ++g) {
    const uint8_t* wg = T.w + g * T.gbytes;
    for (int64_t i = 0; i < T.fpg; ++i) {  // the group's blocks of F k
      const int64_t f = g * T.fpg + i;
      const uint8_t* wf = wg + i * bbytes;
      const int8_t* xf = X.xq + f * F * R;
      __m512i acc[R][NT];
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_si512();
      if constexpr (BITS == 8) {
        plane8<R, NT>(acc, wf, tb, xf, F);
        if constexpr (WIDE) {  // acc = 128 x the high plane's dots + the low plane's (run where a row needs them)
          for (int r = 0; r < R; ++r)
            for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_slli_epi32(acc[r][t], 7);
          const unsigned flags = X.lf[f];
          if (flags == (1u << R) - 1)
            plane8<R, NT>(acc, wf, tb, X.xl + f * F * R, F);
          else if (flags)
            low_rows<R, NT>(acc, flags, wf, tb, X.xl + f * F * R, F, std::make_index_sequence<R>());
        }
      } else {
#pragma GCC unroll 1
        for (int64_t o = 0; o < F / 8; ++o) {  // vector o: k 8o .. 8o + 3 in the low nibbles, 8o + 4 .. in the high
          __m512i lo[NT], hi[NT];
          for (int t = 0; t < NT; ++t) {
            const __m512i v = _mm512_loadu_si512(wf + t * tb + o * 64);
            lo[t] = _mm512_and_si512(v, lo4);
            hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
          }
          for (int r = 0; r < R; ++r) {
            const __m512i va = bcast(xf + ((2 * o) * R + r) * 4), vb = bcast(xf + ((2 * o + 1) * R + r) * 4);
            for (int t = 0; t < NT; ++t) dot(acc[r][t], lo[t], va), dot(acc[r][t], hi[t], vb);
          }
        }
      }
      if (T.zero)
        for (int r = 0; r < R; ++r) {
          const __m512i zq = _mm512_set1_epi32(T.zero * X.qs[f * R + r]);
          for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_sub_epi32(acc[r][t], zq);
        }
      for (int t = 0; t < NT; ++t) {  // the scales read again each block: every register holds a sum here
        const __m512 s = floats16(wg + t * tb + T.scale_off, T.sb);
        for (int r = 0; r < R; ++r)
          y[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]), _mm512_mul_ps(s, _mm512_set1_ps(X.dx[f * R + r])),
                                    y[r][t]);
      }
    }
    if (T.has_min)
      for (int t = 0; t < NT; ++t) {
        const __m512 m = floats16(wg + t * tb + T.scale_off + T.part_bytes, T.sb);
        for (int r = 0; r < R; ++r) y[r][t] = _mm512_fmadd_ps(m, _mm512_set1_ps(X.xs[g * R + r]), y[r][t]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t)
      _mm512_mask_storeu_ps(out + r * ldo + 16 * t, static_cast<__mmask16>(t + 1 < NT ? 0xFFFFu : (1u << last) - 1),
                            y[r][t]);
}

}  // namespace jp_blocks
