// The quantized CPU product's lone-row path for 4-bit codes (cpu_quant.cc runs it on AVX-512 VNNI): one row of
// int8 activations against NT column tiles, for the formats whose scale group and activation block are both
// 32 k (int4 / Q4_0 / Q4_1 of group 32, and Q4_K's two-level form, 8 groups a superblock): every group then has
// one activation scale dx and one weight scale a column, so the loop over a group's 4 code vectors is unrolled
// and the group's float work is done once, after it.
// Per 64-byte code vector (16 columns x 8 k, low nibbles k 0..3, high nibbles k 4..7: cpu_quant.cc's layout) two
// ANDs and two vpdpbusd: the high nibbles stay at 16 times their value (v & 0xF0) and their int32 sum, an exact
// multiple of 16, is shifted down once a group; the low and high sums are separate accumulators (two chains a
// tile). No shift a vector, no register spills (at most 28 vector registers live for NT 4), no division.
// The sums are the same integers, and the float steps the same operations in the same order, as the general
// path's (`vnni_tiles` with R 1), so the outputs are identical to it.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace jp_row4 {

// Where one row's product with one run of NT tiles reads and writes.
struct Args {
  const uint8_t* w;    // tile t0's first stored group (tile t at w + t * tile_bytes)
  int64_t tile_bytes, group_bytes, groups;  // bytes a tile and a stored group; stored groups a tile
  int64_t subgroups;   // scale groups of 32 k a stored group: 8 two-level (a superblock), else 1
  int64_t code_off;    // a stored group's codes from its start
  int64_t scale_off;   // its scales (then, part_bytes on, its minima) from its codes
  int64_t part_bytes;  // the scales' bytes (and again the minima's)
  int64_t sb;          // bytes a float scale (2: float16, 4: float32)
  int32_t zero;        // the zero code (0 with a minimum)
  const int8_t* xq;    // the row's int8 activations, from k 0
  const float* dx;     // its scale a block of 32 k
  const int32_t* qs;   // its sum of codes a block of 32 k
  const float* xs;     // its dx * that sum a block of 32 k (the minimum's term)
};

// 16 float32 values stored at p as float32 (sb 4) or float16 (sb 2).
inline __m512 floats16(const uint8_t* p, int64_t sb) {
  return sb == 2 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))) : _mm512_loadu_ps(p);
}

// 16 int8 at p as float32.
inline __m512 ints16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// acc += the 4-byte dot products of u8 w and s8 x in each int32 lane (asm, as cpu_quant.cc's `dpbusd`).
inline void dot4(__m512i& acc, __m512i w, __m512i x) { __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x)); }

// out[t] (16 columns each) = the row @ tile t0 + t, for t < NT. TWO: the two-level form (per stored group d and,
// with MIN, dm, then int8 c and c' a scale group); MIN: a minimum term a scale group.
template <int NT, bool TWO, bool MIN>
void row4(const Args& a, __m512 (&out)[NT]) {
  const __m512i lo4 = _mm512_set1_epi8(0x0F), hi4 = _mm512_set1_epi8(static_cast<char>(0xF0));
  const int64_t tb = a.tile_bytes, sub = 16 * a.sb;
  __m512 y[NT];  // in registers until the end (out may be memory the loop would store to every group)
  for (int t = 0; t < NT; ++t) y[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* codes = a.w + g * a.group_bytes + a.code_off;
    const uint8_t* sc = codes + a.scale_off;
    __m512 ys[NT], ym[NT];  // two-level: the stored group's sums before d and dm multiply them
    if (TWO)
      for (int t = 0; t < NT; ++t) ys[t] = ym[t] = _mm512_setzero_ps();
    for (int64_t j = 0; j < a.subgroups; ++j) {
      const int64_t f = g * a.subgroups + j;  // the block of 32 k
      const int8_t* x = a.xq + 32 * f;
      __m512i lo[NT], hi[NT];
      for (int t = 0; t < NT; ++t) lo[t] = hi[t] = _mm512_setzero_si512();
      for (int o = 0; o < 4; ++o) {
        int32_t xa, xb;
        std::memcpy(&xa, x + 8 * o, 4);
        std::memcpy(&xb, x + 8 * o + 4, 4);
        const __m512i va = _mm512_set1_epi32(xa), vb = _mm512_set1_epi32(xb);
        for (int t = 0; t < NT; ++t) {
          const __m512i v = _mm512_loadu_si512(codes + t * tb + (4 * j + o) * 64);
          dot4(lo[t], _mm512_and_si512(v, lo4), va);
          dot4(hi[t], _mm512_and_si512(v, hi4), vb);
        }
      }
      const __m512 d = _mm512_set1_ps(a.dx[f]);
      const __m512i zq = _mm512_set1_epi32(a.zero * a.qs[f]);
      for (int t = 0; t < NT; ++t) {
        __m512i acc = _mm512_add_epi32(lo[t], _mm512_srai_epi32(hi[t], 4));
        if (!MIN) acc = _mm512_sub_epi32(acc, zq);
        const uint8_t* st = sc + t * tb;
        if (TWO) {
          ys[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(ints16(st + sub + 16 * j), d), ys[t]);
          if (MIN) ym[t] = _mm512_fmadd_ps(ints16(st + a.part_bytes + sub + 16 * j), _mm512_set1_ps(a.xs[f]), ym[t]);
        } else {
          y[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(floats16(st, a.sb), d), y[t]);
          if (MIN) y[t] = _mm512_fmadd_ps(floats16(st + a.part_bytes, a.sb), _mm512_set1_ps(a.xs[f]), y[t]);
        }
      }
    }
    if (TWO)
      for (int t = 0; t < NT; ++t) {
        const uint8_t* st = sc + t * tb;
        const __m512 dm = MIN ? floats16(st + a.part_bytes, a.sb) : _mm512_setzero_ps();
        y[t] = _mm512_fmadd_ps(dm, ym[t], _mm512_fmadd_ps(floats16(st, a.sb), ys[t], y[t]));
      }
  }
  for (int t = 0; t < NT; ++t) out[t] = y[t];
}

}  // namespace jp_row4
