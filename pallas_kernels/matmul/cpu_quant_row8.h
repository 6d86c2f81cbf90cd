// The quantized CPU product's lone-row path for 8-bit codes (cpu_quant.cc runs it on AVX-512 VNNI): one row of
// activations against NT column tiles, for the one-level formats whose activation block is 32 k and whose scale
// group is a multiple of it (int8 grouped 32 / 64 / 128 or per column, with or without a minimum; GGUF Q8_0,
// Q5_0 / Q5_1 as 8-bit codes). A block of 32 k is 8 code vectors a tile (64 bytes: 16 columns x 4 k), unrolled,
// its dots in two accumulator chains a tile (even and odd vectors), its float work once after it (the scales
// read after the codes, so each tile is one ascending run of cache lines for the hardware prefetcher).
// WIDE (int16 activation codes as two int8 planes, `act_outlier`): the high plane's dots in every block, the low
// plane's (a third chain a tile) only in the blocks where the row's low codes are not all zero (`lowf`), then
// 128 x the high sums + the low ones. At most 27 vector registers live for NT 4: no spills, no division.
// The sums are the same integers, and the float steps the same operations in the same order, as the general
// path's (`vnni_tiles` with R 1: per block y += float(dot) * (s * dx), then the group's minimum term), so the
// outputs are identical to it.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace jp_row8 {

// Where one row's product with one run of NT tiles reads and writes.
struct Args {
  const uint8_t* w;    // tile t0's first stored group (tile t at w + t * tile_bytes), its codes first
  int64_t tile_bytes, group_bytes, groups;  // bytes a tile and a stored group; stored groups a tile
  int64_t blocks;      // blocks of 32 k a stored group (its k / 32)
  int64_t scale_off;   // a stored group's scales from its start (its code bytes); the minima part_bytes on
  int64_t part_bytes;  // the scales' bytes (and again the minima's)
  int64_t sb;          // bytes a float scale (2: float16, 4: float32)
  int32_t zero;        // the zero code (0 with a minimum)
  const int8_t* xq;    // the row's int8 activations (WIDE: the int16 codes' high plane), from k 0
  const int8_t* xl;    // WIDE: the low plane
  const float* dx;     // its scale a block of 32 k
  const int32_t* qs;   // its sum of codes a block of 32 k
  const float* xs;     // its dx * that sum a stored group (the minimum's term)
  const uint8_t* lf;   // WIDE: 1 for a block of 32 k whose low codes are not all zero
};

// 16 float32 values stored at p as float32 (sb 4) or float16 (sb 2).
inline __m512 floats16(const uint8_t* p, int64_t sb) {
  return sb == 2 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))) : _mm512_loadu_ps(p);
}

// acc += the 4-byte dot products of u8 w and s8 x in each int32 lane (asm, as cpu_quant.cc's `dpbusd`).
inline void dot4(__m512i& acc, __m512i w, __m512i x) { __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x)); }

// The 64 code bytes at p (asm volatile: kept in program order, so GCC does not hoist a block's 32 loads ahead of
// their dots and spill them).
inline __m512i codes64(const uint8_t* p) {
  __m512i v;
  __asm__ volatile("vmovdqu64 %1, %0" : "=v"(v) : "m"(*reinterpret_cast<const char(*)[64]>(p)));
  return v;
}

// The 4 int8 activations at p in every int32 lane.
inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// out[t] (16 columns each) = the row @ tile t0 + t, for t < NT. WIDE: int16 codes as two planes; MIN: a minimum
// term a stored group (zero 0), else zero * the block's code sum off each dot.
template <int NT, bool WIDE, bool MIN>
void row8(const Args& a, __m512 (&out)[NT]) {
  const int64_t tb = a.tile_bytes;
  __m512 y[NT];  // in registers until the end (out may be memory the loop would store to every block)
  for (int t = 0; t < NT; ++t) y[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* codes = a.w + g * a.group_bytes;
    for (int64_t b = 0; b < a.blocks; ++b) {
      const int64_t f = g * a.blocks + b;  // the block of 32 k
      const int8_t* x = a.xq + 32 * f;
      const uint8_t* v = codes + b * 512;
      __m512i h0[NT], h1[NT];
      for (int t = 0; t < NT; ++t) h0[t] = h1[t] = _mm512_setzero_si512();
      if (WIDE && a.lf[f]) {  // an outlier block: the low plane's dots too
        const int8_t* xl = a.xl + 32 * f;
        __m512i lo[NT];
        for (int t = 0; t < NT; ++t) lo[t] = _mm512_setzero_si512();
        for (int q = 0; q < 8; ++q) {
          const __m512i xh = bcast4(x + 4 * q), xw = bcast4(xl + 4 * q);
          for (int t = 0; t < NT; ++t) {
            const __m512i c = codes64(v + t * tb + 64 * q);
            dot4(q & 1 ? h1[t] : h0[t], c, xh);
            dot4(lo[t], c, xw);
          }
        }
        for (int t = 0; t < NT; ++t) h0[t] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0[t], h1[t]), 7), lo[t]);
      } else {
        for (int q = 0; q < 8; ++q) {
          const __m512i xh = bcast4(x + 4 * q);
          for (int t = 0; t < NT; ++t) dot4(q & 1 ? h1[t] : h0[t], codes64(v + t * tb + 64 * q), xh);
        }
        for (int t = 0; t < NT; ++t) {
          h0[t] = _mm512_add_epi32(h0[t], h1[t]);
          if (WIDE) h0[t] = _mm512_slli_epi32(h0[t], 7);
        }
      }
      const __m512 d = _mm512_set1_ps(a.dx[f]);
      const __m512i zq = _mm512_set1_epi32(a.zero * a.qs[f]);
      for (int t = 0; t < NT; ++t) {
        const __m512i acc = MIN ? h0[t] : _mm512_sub_epi32(h0[t], zq);
        const __m512 s = floats16(codes + t * tb + a.scale_off, a.sb);  // read after the codes: one ascending run
        y[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(s, d), y[t]);
      }
    }
    if (MIN)
      for (int t = 0; t < NT; ++t)
        y[t] = _mm512_fmadd_ps(floats16(codes + t * tb + a.scale_off + a.part_bytes, a.sb), _mm512_set1_ps(a.xs[g]),
                               y[t]);
  }
  for (int t = 0; t < NT; ++t) out[t] = y[t];
}

}  // namespace jp_row8
