// Weight-only quantized products on the CPU (an XLA FFI handler): out f32[M, N] = x[M, K] @ W, x float32 or
// bfloat16, W read once per call from its packed bytes.
//
// The format: W[K, N] = s[k / G, n] * (u[k, n] - z) + m[k / G, n]
//   u: unsigned codes, 8-bit (0..255) or 4-bit (0..15); s and the optional minimum m: [ceil(K / G), N], stored
//   as float32 or, when they are float16 values (`scale_bytes` 2: grouped int8 / int4, GGUF's legacy types), float16;
//   z: an integer zero code (0 when m is given); G: 16, 32, 64, 128, or K (one scale per output column).
// The two-level form (`superblock` 256: GGUF's K-quants at nearly their own bytes): s = d[k / 256, n] * c[k / G, n]
//   and m = dm[k / 256, n] * c'[k / G, n], d and dm float32 or float16 (`scale_bytes`), c and c' int8, formed in
//   registers (exact: the packer checks d * c is s in float32).
// int8 / int4 symmetric quantization is z = 128 / 8; GGUF Q8_0 (z = 128), Q4_0 (8), Q5_0 (16), Q6_K (G = 16,
// z = 32), Q4_1 / Q5_1 / Q4_K / Q5_K (m = -dmin * min) are this form exactly (Q5_* and Q6_K as 8-bit codes).
//
// The packed layout (matmul/cpu_quant.py `pack`): K padded with zero codes to Kp (a multiple of the group Gp: G, or
// K rounded up to 128 for one scale per column), N to tiles of 16 columns; w [T, ng, group_bytes] uint8:
// tile t (columns 16t .. 16t+15), group g (k = g*Gp .. ): the codes, then s[16], then m[16] if any (float32 or
// float16 each: `scale_bytes`; the AVX2 path widens float16 with F16C, the AVX-512 one with vcvtph2ps).
// Two-level: a stored group is a superblock (Gp 256), holding 256 / G groups j: d[16], c[j][16], then (with a
// minimum) dm[16], c'[j][16], then the codes (the scales first: a tile is read in one ascending run).
//   8-bit: Gp / 4 vectors of 64 bytes; vector q byte 4c + j = u[g*Gp + 4q + j, 16t + c]
//   4-bit: Gp / 8 vectors; vector o byte 4c + j = u[g*Gp + 8o + j, ..] | u[g*Gp + 8o + 4 + j, ..] << 4
// so one 64-byte vector is one VNNI step: 16 int32 lanes (the columns), each the dot of 4 consecutive k.
// A stack [L, T, ng, group_bytes] with a layer index is read at that layer, in place. `rows` (int32, in
// [0, M]) says how many leading rows of x are live: the rest pad the step's token bucket, and their outputs are
// zeros without being computed (a lone request's step is 1 row of a bucket of 8).
//
// The product (int8 activations): each row of x is quantized per block of A k (32, 64 or 128: `act_block`;
// dx = max|x| / 127, round to nearest even); per column the integer dot sum(xq * (u - z)) over F = min(Gp, A)
// k, then y += s * dx * dot; with m, y += m * sum(dx * xq) per group. So y is exactly (up to float32
// summation) the product of the dequantized activations with W; a block of x holding a NaN or an infinity
// makes its row's outputs NaN. act_bits 16: int16 codes (dx = max|x| / 16319) as two int8 planes, each run
// through the same dots, their sums joined as 128 x the high's + the low's; with `act_outlier` tau > 0 only a
// row's outlier blocks (max|x| * the row's blocks > tau * the sum of its block maxima) take int16 codes, the
// others int8 ones as the high plane (dx = max|x| / (127 * 128), low plane 0), and on AVX-512 the low plane's
// dots of an 8-bit block are skipped for a run of rows whose low codes there are all zero: a row's codes and
// outputs depend on that row alone. Paths, compiled where -march allows, the best one run unless `isa` caps it:
//   3 AVX-512 VNNI: vpdpbusd (u8 codes x s8 activations), rows in blocks of 8 (8-bit) / 6 (4-bit) x 2 tiles
//     (one-level formats whose scale group is a multiple of the activation block: blocks of 7 and 6 rows, 4-bit 6
//     and 5, on cpu_quant_blocks.h's loop),
//     lone rows by cpu_quant_row4.h / cpu_quant_row8.h where their formats fit;
//   1 AVX2 + FMA + F16C: vpmaddubsw + vpmaddwd, 8-bit codes as u - 128 with the sign trick (no pair saturates);
//   0 scalar loops. The integer dots are exact on every path.
// One call may take several matrices of one x (a layer's q, k and v; gate and up), each with its own format
// (the attributes N .. superblock hold one value a matrix) and out: x is quantized once for them all.
// Activation rows, then work units (4 column tiles x all rows, every matrix's in one list, largest first), are
// shared by the XLA FFI's intra-op thread pool (ffi_common.h: jp::parallel_for); the calling thread works too.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ffi_common.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define JP_VNNI 1
#else
#define JP_VNNI 0
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JP_AVX2 1
#else
#define JP_AVX2 0
#endif
#if JP_VNNI || JP_AVX2
#include <immintrin.h>
#endif
#if JP_VNNI
#include "cpu_quant_blocks.h"
#include "cpu_quant_row4.h"
#include "cpu_quant_row8.h"
#endif

namespace {

using jp::bf16_to_f32;

constexpr int ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_VNNI = 3;
constexpr int BEST_ISA = JP_VNNI ? ISA_VNNI : JP_AVX2 ? ISA_AVX2 : ISA_SCALAR;
constexpr int UNIT_TILES = 4;  // column tiles a work unit
// The largest int16 activation code (act_bits 16): 127 * 128 + 63, so a code is an int8 high part times 128
// plus an int8 low part, and each plane runs the int8 paths' instructions unchanged.
constexpr float TOP16 = 16319.f;

struct Meta {
  // G: a stored group's k (Gp: the superblock when two-level); S: a scale's k (G, or the group inside a superblock);
  // ns: int8 sub-scales a stored group (G / S two-level, else 0); sb: bytes a float scale
  // wide: the activations' codes are int16 ones (act_bits 16) held as two int8 planes
  // tau: wide, the outlier cut (`quantize_row`; 0: int16 codes in every block)
  int64_t M, K, N, Kp, G, S, ns, bits, has_min, zero, A, sb, wide;
  float tau;
  int64_t ng() const { return Kp / G; }
  int64_t nsg() const { return Kp / S; }                  // scale groups (a row's minimum terms)
  int64_t code_bytes() const { return G * 16 * bits / 8; }
  int64_t part_bytes() const { return 16 * sb + 16 * ns; }  // the scales' (and again the minima's) bytes
  int64_t group_bytes() const { return code_bytes() + part_bytes() * (1 + has_min); }
  // a stored group's codes, and its scales from them: two-level, the scales come first (one ascending read)
  int64_t code_off() const { return ns ? part_bytes() * (1 + has_min) : 0; }
  int64_t scale_off() const { return ns ? -code_off() : code_bytes(); }
  int64_t tile_bytes() const { return ng() * group_bytes(); }
  int64_t tiles() const { return (N + 15) / 16; }
  int64_t F() const { return std::min(S, A); }           // k per integer accumulation
  int64_t Ka() const { return (Kp + A - 1) / A * A; }     // a quantized row's length
  int64_t nf() const { return Ka() / F(); }
  int64_t xrow() const { return Ka() * (1 + wide); }   // a quantized row's bytes (its planes)
};

// The quantized activations: xq [M, xrow] (wide: the high plane [Ka] then the low one), dx [M, Ka / A], qsum [M, nf] (sum of xq per F block),
// xsum [M, nsg] (sum of dx * xq per scale group: the minimum's term).
struct Acts {
  std::vector<int8_t> xq;
  std::vector<float> dx, xsum;
  std::vector<int32_t> qsum;
  std::vector<uint8_t> lowf;  // wide: [M, nf], 1 where the F block's low plane holds a nonzero code
  // the many-row path (`blocks_fit`): each full block of R rows interleaved (jp_blocks::Block, one after another)
  std::vector<int8_t> bq, bl;
  std::vector<float> bdx, bxs;
  std::vector<int32_t> bqs;
  std::vector<uint8_t> blf;
};

struct Call {
  Meta P;
  const uint8_t* w;
  Acts A;
  float* out;
};

// A float16's bits -> the float32 of the same value (subnormals included: a float16 one is a normal float32).
inline float half_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 31, m = h & 1023;
  if (e == 0) return std::copysign(std::ldexp(static_cast<float>(m), -24), sign ? -1.f : 1.f);
  const uint32_t u = sign | (e == 31 ? 0x7F800000u : (e + 112) << 23) | m << 13;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The 16 float32 values (a group's scales or minima) stored at p as float32 (sb 4) or float16 (sb 2).
inline void widen16(const uint8_t* p, int64_t sb, float* out) {
  if (sb == 4) {
    std::memcpy(out, p, 64);
    return;
  }
  for (int c = 0; c < 16; ++c) {
    uint16_t h;
    std::memcpy(&h, p + 2 * c, 2);
    out[c] = half_to_f32(h);
  }
}

// The 16 scales (or minima) of scale group j of the part at p: its floats, times its int8 c[j] when two-level.
inline void scales16(const uint8_t* p, const Meta& P, int64_t j, float* out) {
  widen16(p, P.sb, out);
  if (P.ns)
    for (int c = 0; c < 16; ++c) out[c] *= static_cast<float>(static_cast<int8_t>(p[16 * P.sb + 16 * j + c]));
}

// Row m of x [M, K] (float32, or bfloat16 when `bf16`) quantized over P.Ka() k, zeros past K, one scale dx a
// block of P.A k (r: scratch of Ka floats): int8 codes q [Ka] (dx = max|x| / 127), or wide, codes c within
// +-TOP16 (dx = max|x| / TOP16) as two int8 planes, q [Ka] the high h = (c + 64) >> 7 (|h| <= 127) and
// q + Ka the low c - 128 h (-64 .. 63). The row's blocks depend on K and A only, so one quantization over the
// longest Ka serves every product of x (the others read its planes' prefixes).
void quantize_row(const Meta& P, const void* x, bool bf16, int64_t m, float* r, int8_t* q, float* dx, float* mx) {
  if (bf16) {
    const uint16_t* xr = static_cast<const uint16_t*>(x) + m * P.K;
    for (int64_t k = 0; k < P.K; ++k) r[k] = bf16_to_f32(xr[k]);
  } else {
    std::memcpy(r, static_cast<const float*>(x) + m * P.K, 4 * P.K);
  }
  // the format's sizes read once (stores through the int8 codes may alias P, so a loop would reload them)
  const int64_t Ka = P.Ka(), A = P.A;
  const bool wide = P.wide;
  const float tau = P.tau;
  std::fill(r + P.K, r + Ka, 0.f);
  const int64_t nb = Ka / A, nx = (P.K + A - 1) / A;  // blocks; those holding x
  for (int64_t b = 0; b < nb; ++b) {  // each block's max|x|, NaN where it holds a NaN or an infinity
    const float* rb = r + b * A;
#if JP_VNNI
    __m512 v = _mm512_setzero_ps();
    __mmask16 nonfinite = 0;
    for (int64_t k = 0; k < A; k += 16) {
      const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(rb + k));
      nonfinite |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);
      v = _mm512_max_ps(v, a);
    }
    mx[b] = nonfinite ? NAN : _mm512_reduce_max_ps(v);
#else
    float amax = 0.f;
    bool bad = false;
    for (int64_t k = 0; k < A; ++k) {
      const float a = std::fabs(rb[k]);
      bad |= !(a < INFINITY);
      amax = std::max(amax, a);
    }
    mx[b] = bad ? NAN : amax;
#endif
  }
  float total = 0.f;  // outlier blocks (wide, tau > 0): max|x| * nx > tau * the sum of the maxima (in block order)
  for (int64_t b = 0; b < nx; ++b) total += mx[b];
  const float cut = tau * total, nxf = static_cast<float>(nx);
  for (int64_t b = 0; b < nb; ++b) {
    const float* rb = r + b * A;
    int8_t* qb = q + b * A;
    const float amax = mx[b];
    const bool bad = std::isnan(amax), wide16 = wide && (tau <= 0.f || amax * nxf > cut);
    const float top = wide16 ? TOP16 : 127.f;
    const float inv = amax > 0.f && !bad ? top / amax : 0.f;
    dx[b] = bad ? NAN : wide && !wide16 ? amax / (127.f * 128.f) : amax / top;  // int8 codes as high planes
#if JP_VNNI
    for (int64_t k = 0; k < A; k += 16) {
      const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(rb + k), _mm512_set1_ps(inv)));
      if (!wide16) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + k), _mm512_cvtsepi32_epi8(c));
        if (wide) _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + Ka + k), _mm_setzero_si128());
        continue;
      }
      const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(c, _mm512_set1_epi32(64)), 7);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + k), _mm512_cvtsepi32_epi8(h));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + Ka + k),
                       _mm512_cvtsepi32_epi8(_mm512_sub_epi32(c, _mm512_slli_epi32(h, 7))));
    }
#else
    for (int64_t k = 0; k < A; ++k) {
      const int32_t c = static_cast<int32_t>(std::nearbyint(rb[k] * inv));
      if (!wide16) {
        qb[k] = static_cast<int8_t>(c);
        if (wide) qb[Ka + k] = 0;
        continue;
      }
      const int32_t h = (c + 64) >> 7;
      qb[k] = static_cast<int8_t>(h), qb[Ka + k] = static_cast<int8_t>(c - 128 * h);
    }
#endif
  }
}

// A quantized row's sums for the product of format P: qsum [nf] (sum of the codes per F block; wide: of
// 128 h + l), xsum [nsg] (sum of dx * code per scale group: the minimum's term).
void row_sums(const Meta& P, const int8_t* q, const float* dx, int32_t* qsum, float* xsum, uint8_t* lowf) {
  // the format's sizes read once (stores through the int8 outputs may alias P, so a loop would reload them)
  const int64_t F = P.F(), nf = P.nf(), Ka = P.Ka(), A = P.A, S = P.S, nsg = P.nsg();
  const bool wide = P.wide;
  for (int64_t f = 0; f < nf; ++f) {
    int32_t s = 0;
    bool low = false;
#if JP_VNNI  // F is a multiple of 16: each plane's codes summed 16 lanes at a time (the same integers)
    __m512i sh = _mm512_setzero_si512(), sl = _mm512_setzero_si512();
    __m128i any = _mm_setzero_si128();  // wide: the low plane's codes or-ed
    for (int64_t k = f * F; k < (f + 1) * F; k += 16) {
      sh = _mm512_add_epi32(sh, _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
      if (!wide) continue;
      const __m128i l = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + Ka + k));
      sl = _mm512_add_epi32(sl, _mm512_cvtepi8_epi32(l));
      any = _mm_or_si128(any, l);
    }
    s = (wide ? 128 : 1) * _mm512_reduce_add_epi32(sh) + _mm512_reduce_add_epi32(sl);
    low = !_mm_testz_si128(any, any);
#else
    for (int64_t k = f * F; k < (f + 1) * F; ++k) {
      s += wide ? 128 * q[k] + q[Ka + k] : q[k];
      low |= wide && q[Ka + k] != 0;
    }
#endif
    qsum[f] = s;
    lowf[f] = low;
  }
  for (int64_t g = 0; g < nsg; ++g) {
    float s = 0.f;
    for (int64_t f = g * S / F; f < (g + 1) * S / F; ++f) s += dx[f * F / A] * static_cast<float>(qsum[f]);
    xsum[g] = s;
  }
}

// Pointers to the activations of rows r0 .. r0 + R.
template <int R>
struct Rows {
  const int8_t* xq[R];  // the codes (wide: their high plane)
  const int8_t* xl[R];  // wide: the low plane
  const float* dx[R];
  const float* xs[R];
  const int32_t* qs[R];
  const uint8_t* lf[R];  // wide: the F blocks' low-plane flags
  Rows(const Call& C, int64_t r0) {
    const Meta& P = C.P;
    for (int r = 0; r < R; ++r) {
      xq[r] = C.A.xq.data() + (r0 + r) * P.xrow(), xl[r] = xq[r] + P.Ka();
      dx[r] = C.A.dx.data() + (r0 + r) * (P.Ka() / P.A);
      xs[r] = C.A.xsum.data() + (r0 + r) * P.nsg();
      qs[r] = C.A.qsum.data() + (r0 + r) * P.nf();
      lf[r] = C.A.lowf.data() + (r0 + r) * P.nf();
    }
  }
};

inline void store16(const Call& C, int64_t m, int64_t t, const float* y) {
  const int64_t n0 = t * 16;
  std::memcpy(C.out + m * C.P.N + n0, y, 4 * std::min<int64_t>(16, C.P.N - n0));
}

// ---- scalar: one row x one tile
void scalar_tile(const Call& C, int64_t m, int64_t t) {
  const Meta& P = C.P;
  const Rows<1> X(C, m);
  const int64_t F = P.F(), nj = P.G / P.S;
  const uint8_t* base = C.w + t * P.tile_bytes();
  float y[16] = {};
  for (int64_t g = 0; g < P.ng(); ++g) {
    const uint8_t* gb = base + g * P.group_bytes() + P.code_off();
    float s[16], mn[16];
    for (int64_t j = 0; j < nj; ++j) {  // the stored group's scale groups
      for (int64_t f0 = j * P.S; f0 < (j + 1) * P.S; f0 += F) {
        scales16(gb + P.scale_off(), P, j, s);
        int32_t acc[16] = {};
        for (int64_t kk = f0; kk < f0 + F; ++kk) {
          const int64_t i = g * P.G + kk;
          const int32_t xv = P.wide ? 128 * X.xq[0][i] + X.xl[0][i] : X.xq[0][i];
          for (int c = 0; c < 16; ++c) {
            const uint8_t b = P.bits == 8 ? gb[(kk / 4) * 64 + 4 * c + kk % 4] : gb[(kk / 8) * 64 + 4 * c + kk % 4];
            const int32_t u = P.bits == 8 ? b : (kk % 8 < 4 ? b & 15 : b >> 4);
            acc[c] += u * xv;
          }
        }
        const int64_t k0 = g * P.G + f0;
        const int32_t zq = static_cast<int32_t>(P.zero) * X.qs[0][k0 / F];
        const float d = X.dx[0][k0 / P.A];
        for (int c = 0; c < 16; ++c) y[c] += static_cast<float>(acc[c] - zq) * (s[c] * d);
      }
      if (P.has_min) {  // the scale group's minimum term
        scales16(gb + P.scale_off() + P.part_bytes(), P, j, mn);
        for (int c = 0; c < 16; ++c) y[c] += mn[c] * X.xs[0][g * nj + j];
      }
    }
  }
  store16(C, m, t, y);
}

#if JP_AVX2
// 8 float32 values stored at p as float32 (sb 4) or float16 (sb 2: F16C's vcvtph2ps).
inline __m256 load8(const uint8_t* p, int64_t sb) {
  return sb == 2 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
                 : _mm256_loadu_ps(reinterpret_cast<const float*>(p));
}

// Half h (columns 8h ..) of scale group j's scales (or minima) of the part at p (`scales16`).
inline __m256 scales8(const uint8_t* p, const Meta& P, int64_t j, int h) {
  const __m256 f = load8(p + 8 * h * P.sb, P.sb);
  if (!P.ns) return f;
  const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 16 * P.sb + 16 * j + 8 * h));
  return _mm256_mul_ps(f, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)));
}

// ---- AVX2: R rows x one tile (two halves of 8 columns)
// acc[r] += the dots of w with the int8 activations xq[r] at k (one plane)
template <int R>
inline void avx2_step(const __m256i* w, const int8_t* const* xq, int64_t k, __m256i (*acc)[2], bool sign_trick) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) {
    int32_t xv;
    std::memcpy(&xv, xq[r] + k, 4);
    const __m256i xb = _mm256_set1_epi32(xv);
    for (int h = 0; h < 2; ++h) {
      const __m256i p = sign_trick ? _mm256_maddubs_epi16(_mm256_sign_epi8(w[h], w[h]), _mm256_sign_epi8(xb, w[h]))
                                   : _mm256_maddubs_epi16(w[h], xb);
      acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(p, ones));
    }
  }
}

// the step on each plane of the activations: wide, the low plane's dots into accl
template <int R, bool WIDE>
inline void avx2_planes(const __m256i* w, const Rows<R>& X, int64_t k, __m256i (*acc)[2], __m256i (*accl)[2],
                        bool sign_trick) {
  avx2_step<R>(w, X.xq, k, acc, sign_trick);
  if constexpr (WIDE) avx2_step<R>(w, X.xl, k, accl, sign_trick);
}

template <int R, int BITS, bool WIDE>
void avx2_tile(const Call& C, int64_t r0, int64_t t) {
  const Meta& P = C.P;
  const Rows<R> X(C, r0);
  const int64_t F = P.F(), nj = P.G / P.S, cb = P.scale_off();
  const __m256i lo4 = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(-128);
  const uint8_t* base = C.w + t * P.tile_bytes();
  __m256 y[R][2];
  for (int r = 0; r < R; ++r) y[r][0] = y[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < P.ng(); ++g) {
    const uint8_t* gb = base + g * P.group_bytes() + P.code_off();
    for (int64_t j = 0; j < nj; ++j) {  // the stored group's scale groups
      for (int64_t f0 = j * P.S; f0 < (j + 1) * P.S; f0 += F) {
        __m256i acc[R][2], accl[WIDE ? R : 1][2];
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        for (int r = 0; r < (WIDE ? R : 1); ++r) accl[r][0] = accl[r][1] = _mm256_setzero_si256();
        const int64_t k0 = g * P.G + f0;
        int32_t offset = -static_cast<int32_t>(P.zero);  // acc += offset * sum(xq): sum(xq * (u - z))
        if (BITS == 8) {
          for (int64_t q = 0; q < F / 4; ++q) {
            const uint8_t* p = gb + (f0 / 4 + q) * 64;
            const __m256i w[2] = {_mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), flip),
                                  _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), flip)};
            avx2_planes<R, WIDE>(w, X, k0 + 4 * q, acc, accl, true);  // sum(xq * (u - 128))
          }
          offset += 128;
        } else {
          for (int64_t o = 0; o < F / 8; ++o) {
            const uint8_t* p = gb + (f0 / 8 + o) * 64;
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
            const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
            const __m256i lo[2] = {_mm256_and_si256(a, lo4), _mm256_and_si256(b, lo4)};
            const __m256i hi[2] = {_mm256_and_si256(_mm256_srli_epi16(a, 4), lo4),
                                   _mm256_and_si256(_mm256_srli_epi16(b, 4), lo4)};
            avx2_planes<R, WIDE>(lo, X, k0 + 8 * o, acc, accl, false);
            avx2_planes<R, WIDE>(hi, X, k0 + 8 * o + 4, acc, accl, false);
          }
        }
        if constexpr (WIDE)  // the codes' dots: 128 x the high plane's + the low plane's
          for (int r = 0; r < R; ++r)
            for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_add_epi32(_mm256_slli_epi32(acc[r][h], 7), accl[r][h]);
        for (int r = 0; r < R; ++r) {
          const __m256i c = _mm256_set1_epi32(offset * X.qs[r][k0 / F]);
          acc[r][0] = _mm256_add_epi32(acc[r][0], c), acc[r][1] = _mm256_add_epi32(acc[r][1], c);
        }
        for (int h = 0; h < 2; ++h) {
          const __m256 s = scales8(gb + cb, P, j, h);
          for (int r = 0; r < R; ++r)
            y[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_mul_ps(s, _mm256_set1_ps(X.dx[r][k0 / P.A])),
                                      y[r][h]);
        }
      }
      if (P.has_min)  // the scale group's minimum term
        for (int h = 0; h < 2; ++h) {
          const __m256 m = scales8(gb + cb + P.part_bytes(), P, j, h);
          for (int r = 0; r < R; ++r) y[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(X.xs[r][g * nj + j]), y[r][h]);
        }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float yy[16];
    _mm256_store_ps(yy, y[r][0]);
    _mm256_store_ps(yy + 8, y[r][1]);
    store16(C, r0 + r, t, yy);
  }
}
#endif

#if JP_VNNI
// acc += the 4-byte dot products of u8 w and s8 x in each int32 lane (asm: GCC 12 copies the accumulator
// around every call of the intrinsic).
inline void dpbusd(__m512i& acc, __m512i w, __m512i x) { __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x)); }

// 16 float32 values stored at p as float32 (sb 4) or float16 (sb 2: vcvtph2ps).
inline __m512 load16(const uint8_t* p, int64_t sb) {
  return sb == 2 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))) : _mm512_loadu_ps(p);
}

// Scale group j's 16 scales (or minima) of the part at p (`scales16`); two-level: d (`dv`, widened once a stored
// group) times c[j] widened in registers.
inline __m512 sub16(const uint8_t* p) {  // 16 int8 at p as float32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 scales16v(const uint8_t* p, const Meta& P, int64_t j, __m512 dv) {
  return P.ns ? _mm512_mul_ps(dv, sub16(p + 16 * P.sb + 16 * j)) : load16(p, P.sb);
}

// Row m's outputs of NT tiles from t0 (the last tile's columns past N left unwritten).
template <int NT>
inline void store_tiles(const Call& C, int64_t m, int64_t t0, const __m512* y) {
  for (int t = 0; t < NT; ++t) {
    const int64_t n0 = (t0 + t) * 16, nn = std::min<int64_t>(16, C.P.N - n0);
    _mm512_mask_storeu_ps(C.out + m * C.P.N + n0, static_cast<__mmask16>((1u << nn) - 1), y[t]);
  }
}

// acc[r][t] += the dots of one plane of R rows' int8 activations (x[r] from k0) with NT tiles' 8-bit codes
// (tile t's at w + t * tb, from the block's first vector) over F k: int8 codes, or int16 ones' high plane alone.
template <int R, int NT>
inline void vnni_plane8(__m512i (&acc)[R][NT], const uint8_t* w, int64_t tb, const int8_t* const* x, int64_t k0,
                        int64_t F) {
  for (int64_t q = 0; q < F / 4; ++q) {
    __m512i wv[NT];
    for (int t = 0; t < NT; ++t) wv[t] = _mm512_loadu_si512(w + t * tb + q * 64);
    for (int r = 0; r < R; ++r) {
      int32_t xv;
      std::memcpy(&xv, x[r] + k0 + 4 * q, 4);
      const __m512i xb = _mm512_set1_epi32(xv);
      for (int t = 0; t < NT; ++t) dpbusd(acc[r][t], wv[t], xb);
    }
  }
}

// ---- AVX-512 VNNI: R rows x NT tiles; int32 accumulators flushed to float32 every F k (WIDE: each plane's
// accumulators, joined as 128 x the high's + the low's before)
template <int R, int NT, int BITS, bool WIDE>
void vnni_tiles(const Call& C, int64_t r0, int64_t t0) {
  const Meta& P = C.P;
  const Rows<R> X(C, r0);
  const int64_t F = P.F(), nj = P.G / P.S, cb = P.scale_off(), tb = P.tile_bytes(), gbytes = P.group_bytes();
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  const uint8_t* base = C.w + t0 * tb;
  // one row (a lone request's step), two-level: the stored group's sums kept before d and dm, which multiply
  // them once (two multiplies a group fewer)
  const bool split = R == 1 && P.ns;
  const int64_t pb = P.part_bytes(), sub = 16 * P.sb;
  __m512 y[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) y[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < P.ng(); ++g) {
    const uint8_t* gb = base + g * gbytes + P.code_off();
    __m512 dv[NT], dmv[NT];  // two-level: the stored group's d and dm
    for (int t = 0; t < NT; ++t)
      if (P.ns) {
        dv[t] = load16(gb + t * tb + cb, P.sb);
        dmv[t] = P.has_min ? load16(gb + t * tb + cb + pb, P.sb) : dv[t];
      }
    __m512 ys[NT], ym[NT];
    for (int t = 0; t < NT; ++t) ys[t] = ym[t] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nj; ++j) {  // the stored group's scale groups
      for (int64_t f0 = j * P.S; f0 < (j + 1) * P.S; f0 += F) {
        __m512i acc[R][NT], accl[WIDE ? R : 1][NT];
        for (int r = 0; r < R; ++r)
          for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_si512();
        if constexpr (WIDE)
          for (int r = 0; r < R; ++r)
            for (int t = 0; t < NT; ++t) accl[r][t] = _mm512_setzero_si512();
        const int64_t k0 = g * P.G + f0;
        bool low = WIDE;  // wide 8-bit: the low plane's dots skipped where every row's low codes are zero
        if (WIDE && BITS == 8) {
          low = false;
          for (int r = 0; r < R; ++r) low |= X.lf[r][k0 / F] != 0;
        }
        if (BITS == 8 && !low) {
          vnni_plane8<R, NT>(acc, gb + (f0 / 4) * 64, tb, X.xq, k0, F);
        } else if (BITS == 8) {
          for (int64_t q = 0; q < F / 4; ++q) {
            __m512i w[NT];
            for (int t = 0; t < NT; ++t) w[t] = _mm512_loadu_si512(gb + t * tb + (f0 / 4 + q) * 64);
            for (int r = 0; r < R; ++r) {
              int32_t xv;
              std::memcpy(&xv, X.xq[r] + k0 + 4 * q, 4);
              const __m512i xb = _mm512_set1_epi32(xv);
              for (int t = 0; t < NT; ++t) dpbusd(acc[r][t], w[t], xb);
              std::memcpy(&xv, X.xl[r] + k0 + 4 * q, 4);
              const __m512i xl = _mm512_set1_epi32(xv);
              for (int t = 0; t < NT; ++t) dpbusd(accl[r][t], w[t], xl);
            }
          }
        } else {
          for (int64_t o = 0; o < F / 8; ++o) {
            __m512i lo[NT], hi[NT];
            for (int t = 0; t < NT; ++t) {
              const __m512i v = _mm512_loadu_si512(gb + t * tb + (f0 / 8 + o) * 64);
              lo[t] = _mm512_and_si512(v, lo4);
              hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
            }
            for (int r = 0; r < R; ++r) {
              int32_t xa, xb;
              std::memcpy(&xa, X.xq[r] + k0 + 8 * o, 4);
              std::memcpy(&xb, X.xq[r] + k0 + 8 * o + 4, 4);
              const __m512i va = _mm512_set1_epi32(xa), vb = _mm512_set1_epi32(xb);
              for (int t = 0; t < NT; ++t) dpbusd(acc[r][t], lo[t], va), dpbusd(acc[r][t], hi[t], vb);
              if constexpr (WIDE) {
                std::memcpy(&xa, X.xl[r] + k0 + 8 * o, 4);
                std::memcpy(&xb, X.xl[r] + k0 + 8 * o + 4, 4);
                const __m512i la = _mm512_set1_epi32(xa), lb = _mm512_set1_epi32(xb);
                for (int t = 0; t < NT; ++t) dpbusd(accl[r][t], lo[t], la), dpbusd(accl[r][t], hi[t], lb);
              }
            }
          }
        }
        if constexpr (WIDE)  // 128 x the high plane's sums + the low plane's (zero where skipped)
          for (int r = 0; r < R; ++r)
            for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_add_epi32(_mm512_slli_epi32(acc[r][t], 7), accl[r][t]);
        if (P.zero)
          for (int r = 0; r < R; ++r) {
            const __m512i zq = _mm512_set1_epi32(static_cast<int32_t>(P.zero) * X.qs[r][k0 / F]);
            for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_sub_epi32(acc[r][t], zq);
          }
        for (int t = 0; t < NT; ++t) {
          if (split) {
            const __m512 cdx = _mm512_mul_ps(sub16(gb + t * tb + cb + sub + 16 * j), _mm512_set1_ps(X.dx[0][k0 / P.A]));
            ys[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[0][t]), cdx, ys[t]);
            continue;
          }
          const __m512 s = scales16v(gb + t * tb + cb, P, j, dv[t]);
          for (int r = 0; r < R; ++r)
            y[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]), _mm512_mul_ps(s, _mm512_set1_ps(X.dx[r][k0 / P.A])),
                                      y[r][t]);
        }
      }
      if (P.has_min)  // the scale group's minimum term
        for (int t = 0; t < NT; ++t) {
          if (split) {
            ym[t] = _mm512_fmadd_ps(sub16(gb + t * tb + cb + pb + sub + 16 * j), _mm512_set1_ps(X.xs[0][g * nj + j]), ym[t]);
            continue;
          }
          const __m512 m = scales16v(gb + t * tb + cb + pb, P, j, dmv[t]);
          for (int r = 0; r < R; ++r) y[r][t] = _mm512_fmadd_ps(m, _mm512_set1_ps(X.xs[r][g * nj + j]), y[r][t]);
        }
    }
    if (split)
      for (int t = 0; t < NT; ++t) y[0][t] = _mm512_fmadd_ps(dmv[t], ym[t], _mm512_fmadd_ps(dv[t], ys[t], y[0][t]));
  }
  for (int r = 0; r < R; ++r) store_tiles<NT>(C, r0 + r, t0, y[r]);
}

// One row x NT tiles of 4-bit codes with scale groups and activation blocks of 32 k (`row4_fits`): the unrolled
// lone-row loop of cpu_quant_row4.h.
inline bool row4_fits(const Meta& P) { return P.bits == 4 && P.S == 32 && P.A == 32 && !P.wide; }

template <int NT, bool TWO, bool MIN>
void vnni_row4(const Call& C, int64_t r, int64_t t0) {
  const Meta& P = C.P;
  const jp_row4::Args a{C.w + t0 * P.tile_bytes(), P.tile_bytes(), P.group_bytes(), P.ng(), P.G / 32, P.code_off(),
                        P.scale_off(), P.part_bytes(), P.sb, static_cast<int32_t>(P.zero),
                        C.A.xq.data() + r * P.xrow(), C.A.dx.data() + r * (P.Ka() / 32), C.A.qsum.data() + r * P.nf(),
                        C.A.xsum.data() + r * P.nsg()};
  __m512 y[NT];
  jp_row4::row4<NT, TWO, MIN>(a, y);
  store_tiles<NT>(C, r, t0, y);
}

// One row x NT tiles of 8-bit codes, one-level, activation blocks of 32 k and scale groups of a multiple of 32
// (`row8_fits`): the unrolled lone-row loop of cpu_quant_row8.h.
inline bool row8_fits(const Meta& P) { return P.bits == 8 && P.A == 32 && !P.ns && P.S % 32 == 0; }

template <int NT, bool WIDE, bool MIN>
void vnni_row8(const Call& C, int64_t r, int64_t t0) {
  const Meta& P = C.P;
  const int8_t* xq = C.A.xq.data() + r * P.xrow();
  const jp_row8::Args a{C.w + t0 * P.tile_bytes(), P.tile_bytes(), P.group_bytes(), P.ng(), P.G / 32,
                        P.scale_off(), P.part_bytes(), P.sb, static_cast<int32_t>(P.zero), xq, xq + P.Ka(),
                        C.A.dx.data() + r * (P.Ka() / 32), C.A.qsum.data() + r * P.nf(), C.A.xsum.data() + r * P.nsg(),
                        C.A.lowf.data() + r * P.nf()};
  __m512 y[NT];
  jp_row8::row8<NT, WIDE, MIN>(a, y);
  store_tiles<NT>(C, r, t0, y);
}
#endif

#if JP_VNNI
// The many-row path (cpu_quant_blocks.h) takes one-level formats whose scale group is a multiple of the activation
// block (blocks of F = A k; wide: 8-bit codes), rows in blocks of 7 (8-bit codes) or 6 (4-bit: their two code
// registers a tile), 2 tiles a call: every sum of a call in registers (measured: 8 rows x 2 tiles, sums spilled, or
// 4 x 4 are slower). M rows are cut into blocks of RB and RB - 1 rows where that covers them all (64 rows: 4 x 7 +
// 6 x 6, not 9 x 7 and a lone row that reads every weight again for itself), else into blocks of RB and a tail.
inline bool blocks_fit(const Meta& P) { return !P.ns && P.S % P.A == 0 && (!P.wide || P.bits == 8); }
constexpr int RB8 = 7, BT8 = 2, RB4 = 6, BT4 = 2;  // rows a block and tiles a call: 8-bit, 4-bit codes

struct Plan {
  int64_t RB, nb, big;  // rows a full block, blocks, and how many of them (the first) have RB rows, the rest RB - 1
  int64_t rows(int64_t b) const { return b < big ? RB : RB - 1; }
  int64_t start(int64_t b) const { return b * (RB - 1) + std::min(b, big); }
  int64_t covered() const { return start(nb); }
};
inline Plan block_plan(const Meta& P) {
  const int64_t RB = P.bits == 8 ? RB8 : RB4, nb = (P.M + RB - 1) / RB;
  if (P.M >= (RB - 1) * nb) return {RB, nb, P.M - (RB - 1) * nb};
  return {RB, P.M / RB, P.M / RB};
}

// Block b's R rows (from plan.start(b)) interleaved (jp_blocks::interleave) into C's block arrays.
template <int R>
void interleave_block(Call& C, int64_t b, int64_t r0) {
  const Meta& P = C.P;
  Acts& A = C.A;
  const int64_t nf = P.nf(), nsg = P.nsg();
  jp_blocks::interleave<R>(nf, P.F(), nsg, P.wide, A.xq.data() + r0 * P.xrow(), P.xrow(), P.Ka(),
                           A.dx.data() + r0 * nf, A.xsum.data() + r0 * nsg, A.qsum.data() + r0 * nf,
                           A.lowf.data() + r0 * nf, A.bq.data() + r0 * P.Ka(),
                           P.wide ? A.bl.data() + r0 * P.Ka() : nullptr, A.bdx.data() + r0 * nf,
                           A.bxs.data() + r0 * nsg, A.bqs.data() + r0 * nf, A.blf.data() + b * nf);
}

// Block b's R rows (from r0) x NT tiles from t0 on the many-row path.
template <int R, int NT, int BITS, bool WIDE>
void vnni_blocks(const Call& C, int64_t b, int64_t r0, int64_t t0) {
  const Meta& P = C.P;
  const Acts& A = C.A;
  const int64_t nf = P.nf(), nsg = P.nsg();
  const jp_blocks::Tiles T{C.w + t0 * P.tile_bytes(), P.tile_bytes(), P.group_bytes(), P.scale_off(), P.part_bytes(),
                           P.sb, static_cast<int32_t>(P.zero), P.has_min != 0, P.ng(), P.F(), P.G / P.F()};
  const jp_blocks::Block<R> X{A.bq.data() + r0 * P.Ka(), WIDE ? A.bl.data() + r0 * P.Ka() : nullptr,
                              A.bdx.data() + r0 * nf, A.bxs.data() + r0 * nsg, A.bqs.data() + r0 * nf,
                              A.blf.data() + b * nf};
  const int last = static_cast<int>(std::min<int64_t>(16, P.N - (t0 + NT - 1) * 16));  // the last tile's columns
  jp_blocks::tiles<R, NT, BITS, WIDE>(T, X, C.out + r0 * P.N + t0 * 16, P.N, last);
}
#endif

// One work unit: columns tiles t0 .. t0 + nt, every row, on path `isa`.
void unit(const Call& C, int isa, int64_t t0, int nt) {
  const int64_t M = C.P.M;
#if JP_VNNI
  if (isa == ISA_VNNI) {
    using Fn = void (*)(const Call&, int64_t, int64_t);
    const int b = C.P.bits == 8 ? 0 : 1, wd = C.P.wide ? 1 : 0;
    // rows a block: int8 activations 8 (8-bit codes) / 6 (4-bit), then 4; wide (two planes' accumulators) 4, 2
    const int64_t R = wd ? 4 : C.P.bits == 8 ? 8 : 6, R2 = wd ? 2 : 4;
    static const Fn big[2][2][2] = {
        {{vnni_tiles<8, 1, 8, false>, vnni_tiles<8, 2, 8, false>}, {vnni_tiles<6, 1, 4, false>, vnni_tiles<6, 2, 4, false>}},
        {{vnni_tiles<4, 1, 8, true>, vnni_tiles<4, 2, 8, true>}, {vnni_tiles<4, 1, 4, true>, vnni_tiles<4, 2, 4, true>}}};
    static const Fn mid[2][2][2] = {
        {{vnni_tiles<4, 1, 8, false>, vnni_tiles<4, 2, 8, false>}, {vnni_tiles<4, 1, 4, false>, vnni_tiles<4, 2, 4, false>}},
        {{vnni_tiles<2, 1, 8, true>, vnni_tiles<2, 2, 8, true>}, {vnni_tiles<2, 1, 4, true>, vnni_tiles<2, 2, 4, true>}}};
    static const Fn one[2][2][2] = {
        {{vnni_tiles<1, 1, 8, false>, vnni_tiles<1, UNIT_TILES, 8, false>},
         {vnni_tiles<1, 1, 4, false>, vnni_tiles<1, UNIT_TILES, 4, false>}},
        {{vnni_tiles<1, 1, 8, true>, vnni_tiles<1, UNIT_TILES, 8, true>},
         {vnni_tiles<1, 1, 4, true>, vnni_tiles<1, UNIT_TILES, 4, true>}}};
    int64_t r = 0;
    if (blocks_fit(C.P)) {  // blocks of rows on the many-row path ([blocks of RB, of RB - 1][1 tile, BT tiles])
      using Bn = void (*)(const Call&, int64_t, int64_t, int64_t);
      static const Bn blocks[3][2][2] = {
          {{vnni_blocks<RB8, 1, 8, false>, vnni_blocks<RB8, BT8, 8, false>},
           {vnni_blocks<RB8 - 1, 1, 8, false>, vnni_blocks<RB8 - 1, BT8, 8, false>}},
          {{vnni_blocks<RB8, 1, 8, true>, vnni_blocks<RB8, BT8, 8, true>},
           {vnni_blocks<RB8 - 1, 1, 8, true>, vnni_blocks<RB8 - 1, BT8, 8, true>}},
          {{vnni_blocks<RB4, 1, 4, false>, vnni_blocks<RB4, BT4, 4, false>},
           {vnni_blocks<RB4 - 1, 1, 4, false>, vnni_blocks<RB4 - 1, BT4, 4, false>}}};
      const Plan plan = block_plan(C.P);
      const int64_t BT = C.P.bits == 8 ? BT8 : BT4;
      for (int64_t bk = 0; bk < plan.nb; ++bk) {
        const Bn* f = blocks[b ? 2 : wd][plan.rows(bk) < plan.RB];
        const int64_t r0 = plan.start(bk);
        int64_t t = 0;
        for (; t + BT <= nt; t += BT) f[1](C, bk, r0, t0 + t);
        for (; t < nt; ++t) f[0](C, bk, r0, t0 + t);
      }
      r = plan.covered();
    }
    for (; r + R <= M; r += R)
      for (int t = 0; t < nt; t += 2) big[wd][b][t + 1 < nt](C, r, t0 + t);
    for (; r + R2 <= M; r += R2)
      for (int t = 0; t < nt; t += 2) mid[wd][b][t + 1 < nt](C, r, t0 + t);
    static const Fn row4[2][2][2] = {  // [all tiles][two-level][minimum]
        {{vnni_row4<1, false, false>, vnni_row4<1, false, true>}, {vnni_row4<1, true, false>, vnni_row4<1, true, true>}},
        {{vnni_row4<UNIT_TILES, false, false>, vnni_row4<UNIT_TILES, false, true>},
         {vnni_row4<UNIT_TILES, true, false>, vnni_row4<UNIT_TILES, true, true>}}};
    for (; r < M && row4_fits(C.P); ++r) {
      const Fn* f = row4[nt == UNIT_TILES][C.P.ns != 0];
      if (nt == UNIT_TILES) {
        f[C.P.has_min](C, r, t0);
        continue;
      }
      for (int t = 0; t < nt; ++t) f[C.P.has_min](C, r, t0 + t);
    }
    static const Fn row8[2][2][2] = {  // [all tiles][wide][minimum]
        {{vnni_row8<1, false, false>, vnni_row8<1, false, true>}, {vnni_row8<1, true, false>, vnni_row8<1, true, true>}},
        {{vnni_row8<UNIT_TILES, false, false>, vnni_row8<UNIT_TILES, false, true>},
         {vnni_row8<UNIT_TILES, true, false>, vnni_row8<UNIT_TILES, true, true>}}};
    for (; r < M && row8_fits(C.P); ++r) {
      const Fn f = row8[nt == UNIT_TILES][wd][C.P.has_min != 0];
      for (int t = 0; t < nt; t += (nt == UNIT_TILES ? UNIT_TILES : 1)) f(C, r, t0 + t);
    }
    for (; r < M; ++r) {
      if (nt == UNIT_TILES) {
        one[wd][b][1](C, r, t0);
        continue;
      }
      for (int t = 0; t < nt; ++t) one[wd][b][0](C, r, t0 + t);
    }
    return;
  }
#endif
#if JP_AVX2
  if (isa == ISA_AVX2) {
    using Fn = void (*)(const Call&, int64_t, int64_t);
    const int b = C.P.bits == 8 ? 0 : 1, wd = C.P.wide ? 1 : 0;
    const int64_t R = wd ? 2 : 4;  // rows a block (wide: two planes' accumulators)
    static const Fn big[2][2] = {{avx2_tile<4, 8, false>, avx2_tile<4, 4, false>},
                                 {avx2_tile<2, 8, true>, avx2_tile<2, 4, true>}};
    static const Fn one[2][2] = {{avx2_tile<1, 8, false>, avx2_tile<1, 4, false>},
                                 {avx2_tile<1, 8, true>, avx2_tile<1, 4, true>}};
    for (int t = 0; t < nt; ++t) {
      int64_t r = 0;
      for (; r + R <= M; r += R) big[wd][b](C, r, t0 + t);
      for (; r < M; ++r) one[wd][b](C, r, t0 + t);
    }
    return;
  }
#endif
  for (int t = 0; t < nt; ++t)
    for (int64_t r = 0; r < M; ++r) scalar_tile(C, r, t0 + t);
}

// Product i of n's name for operand `base` in errors: "w" alone, "ws[i]" among several.
std::string named(const char* base, size_t i, size_t n) {
  return n == 1 ? std::string(base) : std::string(base) + "s[" + std::to_string(i) + "]";
}

// The format of product i (its attributes, x's M and K) and its operands w and out checked against it, every
// mismatch an InvalidArgument naming the operand -> C (w at the layer index, M all of x's rows).
ffi::Error check_product(size_t i, size_t n, int64_t M, int64_t K, int64_t N, int64_t group, int64_t bits, int64_t zero,
                         int64_t has_min, int64_t scale_bytes, int64_t superblock, int64_t act_block,
                         const ffi::AnyBuffer& w,
                         const ffi::AnyBuffer& out, int32_t layer, Call& C) {
  constexpr const char* KERNEL = "cpu_quant_matmul";
  const std::string at = std::string(KERNEL) + ": " + (n == 1 ? "" : named("w", i, n) + ": ");
  if ((bits != 8 && bits != 4) || N <= 0 || (group != K && group != 16 && group != 32 && group != 64 && group != 128))
    return ffi::Error::InvalidArgument(at + "bits must be 4 or 8, group 16, 32, 64, 128 or K, N positive");
  if (zero < 0 || zero >= (int64_t{1} << bits) || (has_min && zero))
    return ffi::Error::InvalidArgument(at + "zero must be a code (0 when the weights have a min)");
  if (scale_bytes != 2 && scale_bytes != 4)
    return ffi::Error::InvalidArgument(at + "scale_bytes must be 2 (float16) or 4 (float32)");
  if ((superblock != 0 && superblock != 256) || (superblock && group == K && group != 16 && group != 32 &&
                                                  group != 64 && group != 128))
    return ffi::Error::InvalidArgument(at + "superblock must be 0 or 256 (with a group of 16 .. 128)");
  Meta& P = C.P;
  P.M = M, P.K = K, P.N = N, P.bits = bits, P.zero = zero, P.has_min = has_min != 0, P.A = act_block;
  P.sb = scale_bytes;
  P.S = group == 16 || group == 32 || group == 64 || group == 128 ? group : (K + 127) / 128 * 128;
  P.G = superblock ? superblock : P.S;
  P.ns = superblock ? superblock / P.S : 0;
  P.Kp = (K + P.G - 1) / P.G * P.G;
  auto wd = w.dimensions();
  const bool stacked = wd.size() == 4;
  const std::string wname = named("w", i, n), blob = std::to_string(P.tiles()) + ", " + std::to_string(P.ng()) +
                                                     ", " + std::to_string(P.group_bytes());
  if (w.element_type() != ffi::DataType::U8 || (wd.size() != 3 && !stacked) || wd[stacked] != P.tiles() ||
      wd[stacked + 1] != P.ng() || wd[stacked + 2] != P.group_bytes())
    return ffi::Error::InvalidArgument(at + wname + " must be the packed uint8[" + blob + "] (or [L, " + blob +
                                       "]) of the format's K, N, group, bits, min, scale bytes and superblock, got " +
                                       jp::describe(w));
  if (stacked && (layer < 0 || layer >= wd[0]))
    return ffi::Error::InvalidArgument(at + "the layer index must be in [0, " + std::to_string(wd[0]) + ") of " +
                                       wname + "'s stack, got " + std::to_string(layer));
  if (out.element_type() != ffi::DataType::F32 || !jp::has_dims(out, {M, N}))
    return jp::bad_operand(KERNEL, named("out", i, n).c_str(),
                           "float32 [M = " + std::to_string(M) + ", N = " + std::to_string(N) + "]", out);
  C.w = static_cast<const uint8_t*>(w.untyped_data()) + (stacked ? layer : 0) * P.tiles() * P.tile_bytes();
  C.out = static_cast<float*>(out.untyped_data());
  return ffi::Error::Success();
}

// A unit of the threads' one work list: column tiles t0 .. t0 + nt of product i, every row; `bytes` of
// weights it reads.
struct Work {
  size_t i;
  int64_t t0;
  int nt;
  int64_t bytes;
};

// What the threads share: every product, x, the work list, the path.
struct Job {
  std::vector<Call> calls;
  Meta widest;  // the format with the longest quantized row: x is quantized once, over its Ka
  const void* x;
  bool bf16;
  std::vector<Work> work;
  std::vector<std::pair<size_t, int64_t>> blocks;  // the many-row path's row blocks to interleave: (product, block)
  int path;
};

// Several products of one x (a layer's q, k and v; gate and up) are one call: x quantized once, then the
// column tiles of every product one work list, largest units first. Each product has its own format (the
// attribute arrays N .. superblock, one value a product: the same K, act_block and isa), w and out.
ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer,
                ffi::Buffer<ffi::S32> rows, ffi::RemainingArgs more_w, ffi::Result<ffi::AnyBuffer> out,
                ffi::RemainingRets more_out, int64_t K, ffi::Span<const int64_t> N, ffi::Span<const int64_t> group,
                ffi::Span<const int64_t> bits, ffi::Span<const int64_t> zero, ffi::Span<const int64_t> has_min,
                ffi::Span<const int64_t> scale_bytes, ffi::Span<const int64_t> superblock, int64_t act_block,
                int64_t act_bits, float act_outlier, int64_t isa) {
  const size_t n = 1 + more_w.size();
  if (more_out.size() != more_w.size())
    return ffi::Error::InvalidArgument("cpu_quant_matmul: one out per w, got " + std::to_string(n) + " w and " +
                                       std::to_string(more_out.size() + 1) + " out");
  for (auto [name, a] : {std::pair{"N", N}, {"group", group}, {"bits", bits}, {"zero", zero}, {"has_min", has_min},
                         {"scale_bytes", scale_bytes}, {"superblock", superblock}})
    if (a.size() != n)
      return ffi::Error::InvalidArgument(std::string("cpu_quant_matmul: the attribute ") + name + " must hold one value "
                                         "a w (" + std::to_string(n) + "), got " + std::to_string(a.size()));
  auto xd = x.dimensions();
  if (x.element_type() != ffi::DataType::F32 && x.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("cpu_quant_matmul: x must be float32 or bfloat16");
  if (xd.size() != 2 || xd[1] != K || K <= 0)
    return ffi::Error::InvalidArgument("cpu_quant_matmul: x must be [M, K] with K the weights' K");
  if (act_block != 32 && act_block != 64 && act_block != 128)
    return ffi::Error::InvalidArgument("cpu_quant_matmul: act_block must be 32, 64 or 128");
  if (act_bits != 8 && act_bits != 16)
    return ffi::Error::InvalidArgument("cpu_quant_matmul: act_bits must be 8 or 16");
  if (!(act_outlier >= 0.f && act_outlier < INFINITY) || (act_outlier > 0.f && act_bits != 16))
    return ffi::Error::InvalidArgument("cpu_quant_matmul: act_outlier must be a finite number >= 0, and 0 unless "
                                       "act_bits is 16");
  if (layer.element_count() != 1)
    return ffi::Error::InvalidArgument("cpu_quant_matmul: the layer index must be one int32");
  const int64_t M = xd[0];
  if (rows.element_count() != 1 || rows.typed_data()[0] < 0 || rows.typed_data()[0] > M)
    return ffi::Error::InvalidArgument("cpu_quant_matmul: rows must be one int32 in [0, M] (x's live rows)");
  auto J = std::make_shared<Job>();
  J->calls.resize(n);
  auto check = [&](size_t i, const ffi::AnyBuffer& wi, const ffi::AnyBuffer& oi) {
    return check_product(i, n, M, K, N[i], group[i], bits[i], zero[i], has_min[i], scale_bytes[i], superblock[i],
                         act_block, wi, oi, layer.typed_data()[0], J->calls[i]);
  };
  if (ffi::Error e = check(0, w, *out); e.failure()) return e;
  for (size_t i = 1; i < n; ++i) {
    auto wi = more_w.get<ffi::AnyBuffer>(i - 1);
    auto oi = more_out.get<ffi::AnyBuffer>(i - 1);
    if (!wi.has_value() || !oi.has_value())
      return ffi::Error::InvalidArgument("cpu_quant_matmul: " + named("w", i, n) + " and " + named("out", i, n) +
                                         " must be arrays");
    if (ffi::Error e = check(i, *wi, **oi); e.failure()) return e;
  }
  // Rows past `rows` pad a token bucket: their outputs are zeros, and nothing of them is read or computed.
  const int64_t live = rows.typed_data()[0];
  for (Call& C : J->calls) {
    std::fill(C.out + live * C.P.N, C.out + M * C.P.N, 0.0f);
    C.P.M = live, C.P.wide = act_bits == 16, C.P.tau = act_outlier;
  }
  if (live == 0) return ffi::Error::Success();
  J->widest = J->calls[0].P;
  for (Call& C : J->calls) {
    if (C.P.Ka() > J->widest.Ka()) J->widest = C.P;
    Acts& A = C.A;
    A.xq.resize(live * C.P.xrow()), A.dx.resize(live * (C.P.Ka() / C.P.A)), A.qsum.resize(live * C.P.nf());
    A.xsum.resize(live * C.P.nsg()), A.lowf.resize(live * C.P.nf());
  }
  J->x = x.untyped_data(), J->bf16 = x.element_type() == ffi::DataType::BF16;
  jp::parallel_for(pool, live, live, [J](int64_t m) {
    const Meta& W = J->widest;
    thread_local std::vector<float> row, dx, mx;
    thread_local std::vector<int8_t> q;
    row.resize(W.Ka()), q.resize(W.xrow()), dx.resize(W.Ka() / W.A), mx.resize(W.Ka() / W.A);
    quantize_row(W, J->x, J->bf16, m, row.data(), q.data(), dx.data(), mx.data());
    for (Call& C : J->calls) {  // each product's own row: the prefix of its Ka (each plane's), its own sums
      const Meta& Q = C.P;
      int8_t* cq = C.A.xq.data() + m * Q.xrow();
      float* cdx = C.A.dx.data() + m * (Q.Ka() / Q.A);
      std::memcpy(cq, q.data(), Q.Ka());
      if (Q.wide) std::memcpy(cq + Q.Ka(), q.data() + W.Ka(), Q.Ka());
      std::memcpy(cdx, dx.data(), sizeof(float) * (Q.Ka() / Q.A));
      row_sums(Q, cq, cdx, C.A.qsum.data() + m * Q.nf(), C.A.xsum.data() + m * Q.nsg(), C.A.lowf.data() + m * Q.nf());
    }
  });
  J->path = std::min<int>(static_cast<int>(isa), BEST_ISA);
#if JP_VNNI
  if (J->path == ISA_VNNI) {  // the many-row path's interleaved blocks of rows, one list over every product
    for (size_t i = 0; i < n; ++i) {
      Call& C = J->calls[i];
      if (!blocks_fit(C.P)) continue;
      const Plan plan = block_plan(C.P);
      const int64_t covered = plan.covered(), nf = C.P.nf(), nsg = C.P.nsg();  // (`rows` is the operand)
      Acts& A = C.A;
      A.bq.resize(covered * C.P.Ka()), A.bl.resize(C.P.wide ? covered * C.P.Ka() : 0);
      A.bdx.resize(covered * nf), A.bxs.resize(covered * nsg), A.bqs.resize(covered * nf), A.blf.resize(plan.nb * nf);
      for (int64_t b = 0; b < plan.nb; ++b) J->blocks.emplace_back(i, b);
    }
    const int64_t nblocks = static_cast<int64_t>(J->blocks.size());
    jp::parallel_for(pool, nblocks, nblocks, [J](int64_t u) {
      Call& C = J->calls[J->blocks[u].first];
      const Plan plan = block_plan(C.P);
      const int64_t b = J->blocks[u].second, r0 = plan.start(b);
      const bool full = plan.rows(b) == plan.RB;
      if (C.P.bits == 8) full ? interleave_block<RB8>(C, b, r0) : interleave_block<RB8 - 1>(C, b, r0);
      else full ? interleave_block<RB4>(C, b, r0) : interleave_block<RB4 - 1>(C, b, r0);
    });
  }
#endif
  for (size_t i = 0; i < n; ++i) {
    const Meta& P = J->calls[i].P;
    for (int64_t t0 = 0; t0 < P.tiles(); t0 += UNIT_TILES) {
      const int nt = static_cast<int>(std::min<int64_t>(UNIT_TILES, P.tiles() - t0));
      J->work.push_back(Work{i, t0, nt, nt * P.tile_bytes()});
    }
  }
  // largest units first, so the threads end close together (jp::parallel_for takes units in order)
  std::stable_sort(J->work.begin(), J->work.end(), [](const Work& a, const Work& b) { return a.bytes > b.bytes; });
  const int64_t units = static_cast<int64_t>(J->work.size());
  jp::parallel_for(pool, units, units, [J](int64_t u) {
    const Work& U = J->work[u];
    unit(J->calls[U.i], J->path, U.t0, U.nt);
  });
  return ffi::Error::Success();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedCpuQuantMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()               // x [M, K]
                                  .Arg<ffi::AnyBuffer>()               // w: the first product's packed matrix
                                  .Arg<ffi::Buffer<ffi::S32>>()        // layer: the index into stacked w
                                  .Arg<ffi::Buffer<ffi::S32>>()        // rows: x's live rows
                                  .RemainingArgs()                     // more w of the same x, each its own out
                                  .Ret<ffi::AnyBuffer>()               // out f32[M, N]
                                  .RemainingRets()                     // the out of each further w
                                  .Attr<int64_t>("K")
                                  .Attr<ffi::Span<const int64_t>>("N")  // one value a product, from here on
                                  .Attr<ffi::Span<const int64_t>>("group")
                                  .Attr<ffi::Span<const int64_t>>("bits")
                                  .Attr<ffi::Span<const int64_t>>("zero")
                                  .Attr<ffi::Span<const int64_t>>("has_min")
                                  .Attr<ffi::Span<const int64_t>>("scale_bytes")
                                  .Attr<ffi::Span<const int64_t>>("superblock")
                                  .Attr<int64_t>("act_block")
                                  .Attr<int64_t>("act_bits")
                                  .Attr<float>("act_outlier")
                                  .Attr<int64_t>("isa"));

// The best path this build runs: 3 AVX-512 VNNI, 1 AVX2 + FMA + F16C, 0 scalar loops.
extern "C" int JaxpagedCpuQuantIsa() { return BEST_ISA; }
