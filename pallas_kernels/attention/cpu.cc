// Ragged paged attention on the CPU, reading the paged KV pool in place (an XLA FFI handler).
//
// Semantics are those of pallas_kernels/attention/reference.py (ragged_paged_attention_reference): the rows
// query_start_loc[s]..query_start_loc[s+1] of q are the last tokens of slot s's seq_lens[s] keys, causal;
// q head j reads KV head j / G (G = Hq / Hkv); rows past query_start_loc[S], and rows that see no key,
// are zeros. Keys visible to a query at position p: p - window < k <= p (window 0: unbounded).
//
// Two implementations of one contract, chosen when the source is compiled (-march=native):
// - AVX-512 (F, BW, VL): a work unit is (slot, tile of up to TILE_ROWS query rows) over every KV head, so a
//   unit walks its slot's blocks once and reads each block's K and V rows of all heads, contiguous in the
//   pool, straight from the pool into registers (bfloat16 widened by a shift, no buffer; on AVX-512 BF16 a
//   bfloat16 pool's logits take its rows as they are, by vdpbf16ps: cpu_dpbf16.h). The blocks go in tiles
//   of whole blocks (TILE_KEYS keys, at least a block). Per tile and KV head: the logits of the G x rows query
//   vectors (16-lane dots, the dots of 16 keys summed transposed into one vector of logits), then the
//   softmax over the tile's keys 16 at a time (masking, max, a vector exp) and the values weighted into
//   float32 accumulators (online softmax merged once a tile); a tile's blocks in order, each block's heads in
//   turn, the next block's rows of a head prefetched into L2 while the head is worked on. With fewer row
//   tiles than threads (a lone decode) a unit takes a range of the KV heads instead, so no thread idles.
// - Elsewhere (AVX2 and older): a unit is (slot, KV head, row tile), the block widened to float32 in a
//   small thread-local buffer, plain loops the compiler vectorizes.
// The units are shared by the XLA FFI's intra-op thread pool through an atomic counter, longest first; the
// calling thread works too, so the call never waits on a pool that is busy elsewhere.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ffi_common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define JP_AVX512 1
#define JP_AVX2 0
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define JP_AVX512 0
#define JP_AVX2 1
#include <immintrin.h>
#else
#define JP_AVX512 0
#define JP_AVX2 0
#endif

namespace {

constexpr int TILE_ROWS = 8;  // query rows of one slot a unit (prefill); decode units have one
constexpr float NEG = -1e30f;

using jp::bf16_to_f32;

// D values of one pool row -> float32 dst.
inline void widen(const void* src, bool bf16, int D, float* dst) {
  if (bf16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
#pragma omp simd
    for (int d = 0; d < D; ++d) dst[d] = bf16_to_f32(s[d]);
  } else {
    std::memcpy(dst, src, sizeof(float) * D);
  }
}

inline float dot(const float* a, const float* b, int D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

struct Problem {
  const float* q;  // [T, Hq, D] float32
  const char* k;   // [NB, bs, Hkv, D] float32 or bfloat16
  const char* v;
  const int32_t* tables;  // [S, B]
  const int32_t* lens;    // [S]
  const int32_t* qsl;     // [S + 1]
  float* out;             // [T, Hq, D] float32
  int64_t T, Hq, D, NB, bs, Hkv, S, B, G;
  bool bf16;
  float scale, softcap;
  int64_t window;
};

struct Unit {
  int32_t slot, head, row0, rows;  // rows row0..row0+rows of q, all of `slot`; KV head `head`
  int32_t heads;                   // the vector path's KV heads head..head+heads (the plain loops': 1)
};

// One unit: the G x rows query vectors of KV head `u.head` over the slot's keys.
void attend(const Problem& P, const Unit& u) {
  const int D = static_cast<int>(P.D), bs = static_cast<int>(P.bs), G = static_cast<int>(P.G);
  const int R = G * u.rows;  // query vectors, row-major (row, g)
  const int64_t row_end = P.qsl[u.slot + 1];
  const int64_t len = P.lens[u.slot];
  thread_local std::vector<float> buf;
  buf.resize(static_cast<size_t>(R) * (2 * D + 3) + static_cast<size_t>(2 * bs) * D + static_cast<size_t>(R) * bs);
  float* qv = buf.data();                  // [R, D]
  float* acc = qv + static_cast<size_t>(R) * D;  // [R, D]
  float* m = acc + static_cast<size_t>(R) * D;   // [R]
  float* l = m + R;                        // [R]
  float* pos = l + R;                      // [R] query positions (as float: exact for any context)
  float* kb = pos + R;                     // [bs, D] widened keys of a block
  float* vb = kb + static_cast<size_t>(bs) * D;  // [bs, D]
  float* s = vb + static_cast<size_t>(bs) * D;   // [R, bs] logits
  int64_t lo = INT64_MAX, hi = -1;  // key positions the unit may see
  for (int r = 0; r < u.rows; ++r) {
    const int64_t row = u.row0 + r;
    const int64_t p = len - (row_end - row);
    for (int g = 0; g < G; ++g) {
      const int i = r * G + g;
      const float* src = P.q + (row * P.Hq + u.head * G + g) * P.D;
      std::memcpy(qv + static_cast<size_t>(i) * D, src, sizeof(float) * D);
      pos[i] = static_cast<float>(p);
      m[i] = NEG;
      l[i] = 0.f;
      std::fill(acc + static_cast<size_t>(i) * D, acc + static_cast<size_t>(i + 1) * D, 0.f);
    }
    if (p >= 0) {
      hi = std::max(hi, p);
      lo = std::min(lo, P.window > 0 ? std::max<int64_t>(p - P.window + 1, 0) : 0);
    }
  }
  const size_t elt = P.bf16 ? 2 : 4;
  const size_t row_stride = static_cast<size_t>(P.Hkv) * D * elt;  // bytes between keys of a block
  for (int64_t b = (hi < 0 ? 1 : lo / bs), last = hi / bs; hi >= 0 && b <= last; ++b) {
    int64_t id = P.tables[u.slot * P.B + std::min<int64_t>(b, P.B - 1)];
    id = std::min<int64_t>(std::max<int64_t>(id, 0), P.NB - 1);  // the reference's gathers clip
    const size_t base = (static_cast<size_t>(id) * bs * P.Hkv + u.head) * D * elt;
    const int n = static_cast<int>(std::min<int64_t>(bs, hi + 1 - b * bs));  // keys of the block <= hi
    for (int j = 0; j < n; ++j) widen(P.k + base + j * row_stride, P.bf16, D, kb + static_cast<size_t>(j) * D);
    bool vwide = false;
    for (int i = 0; i < R; ++i) {
      float* si = s + static_cast<size_t>(i) * bs;
      float mb = NEG;
      for (int j = 0; j < n; ++j) {
        const float kp = static_cast<float>(b * bs + j);
        const bool seen = kp <= pos[i] && (P.window <= 0 || kp > pos[i] - static_cast<float>(P.window));
        if (!seen) { si[j] = NEG; continue; }
        float x = dot(qv + static_cast<size_t>(i) * D, kb + static_cast<size_t>(j) * D, D) * P.scale;
        if (P.softcap > 0.f) x = P.softcap * std::tanh(x / P.softcap);
        si[j] = x;
        mb = std::max(mb, x);
      }
      if (mb <= NEG) continue;  // this query sees none of the block
      if (!vwide) {
        for (int j = 0; j < n; ++j) widen(P.v + base + j * row_stride, P.bf16, D, vb + static_cast<size_t>(j) * D);
        vwide = true;
      }
      const float m_new = std::max(m[i], mb);
      const float alpha = std::exp(m[i] - m_new);
      float* ai = acc + static_cast<size_t>(i) * D;
      float sum = l[i] * alpha;
#pragma omp simd
      for (int d = 0; d < D; ++d) ai[d] *= alpha;
      for (int j = 0; j < n; ++j) {
        if (si[j] <= NEG) continue;
        const float p = std::exp(si[j] - m_new);
        sum += p;
        const float* vj = vb + static_cast<size_t>(j) * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) ai[d] += p * vj[d];
      }
      m[i] = m_new;
      l[i] = sum;
    }
  }
  for (int r = 0; r < u.rows; ++r) {
    for (int g = 0; g < G; ++g) {
      const int i = r * G + g;
      float* dst = P.out + ((u.row0 + r) * P.Hq + u.head * G + g) * P.D;
      const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;  // a query that saw nothing: zeros
      const float* ai = acc + static_cast<size_t>(i) * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) dst[d] = ai[d] * inv;
    }
  }
}


#if JP_AVX512 || JP_AVX2
// The lane types of the vector path: L float32 lanes, loads of pool rows (float32 or bfloat16, widened),
// masks of key positions, a vector exp. `part` loads and stores touch only the first `valid` lanes.
#if JP_AVX512
struct Lanes {
  static constexpr int L = 16;
  using F = __m512;
  using M = __mmask16;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_load_ps(p); }
  static F loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_store_ps(p, x); }
  static void storeu(float* p, F x) { _mm512_storeu_ps(p, x); }
  static void store_part(float* p, int valid, F x) { _mm512_mask_storeu_ps(p, first(valid), x); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static float hsum(F x) { return _mm512_reduce_add_ps(x); }
  static float hmax(F x) { return _mm512_reduce_max_ps(x); }
  static M first(int valid) { return valid >= L ? M(0xFFFF) : M((1u << valid) - 1); }
  static M le(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
  static M gt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static M both(M a, M b) { return a & b; }
  static F keep(M m, F x) { return _mm512_maskz_mov_ps(m, x); }     // x where m, else 0
  static F max_where(M m, F a, F x) { return _mm512_mask_max_ps(a, m, a, x); }  // max(a, x) where m, else a
  static F round(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F p, F n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
  static F lanes() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  // The transposed sum of L vectors, one level of a tree: level 1 adds the 256-bit halves of keys x, y into
  // one vector (8 lanes each), level 2 their 128-bit quarters (4 lanes a key of 4 keys), level 3 the 64-bit
  // pairs, level 4 the last pairs: lane 4c + k then holds key c + 4k's sum, which `in_order` puts in lane
  // c + 4k.
  static constexpr int LEVELS = 4;
  template <int LEVEL>
  static F fold(F x, F y) {
    if constexpr (LEVEL == 1) return add(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    else if constexpr (LEVEL == 2) return add(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
    else if constexpr (LEVEL == 3)
      return add(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x), _mm512_castps_pd(y))),
                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x), _mm512_castps_pd(y))));
    else return add(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
  }
  static F in_order(F x) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), x);
  }
  template <bool BF16>
  static F row(const void* r, int c) { return row_part<BF16>(r, c, L); }
  template <bool BF16>
  static F row_part(const void* r, int c, int valid) {
    const M m = first(valid);
    if constexpr (BF16) {
      const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(r) + c);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_maskz_loadu_ps(m, static_cast<const float*>(r) + c);
    }
  }
};
#else
struct Lanes {
  static constexpr int L = 8;
  using F = __m256;
  using M = __m256;  // all-ones lanes where true
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_load_ps(p); }
  static F loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_store_ps(p, x); }
  static void storeu(float* p, F x) { _mm256_storeu_ps(p, x); }
  static void store_part(float* p, int valid, F x) { _mm256_maskstore_ps(p, ints(valid), x); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static float hsum(F x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float hmax(F x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  static __m256i ints(int valid) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static M first(int valid) { return _mm256_castsi256_ps(ints(valid)); }
  static M le(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
  static M gt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static M both(M a, M b) { return _mm256_and_ps(a, b); }
  static F keep(M m, F x) { return _mm256_and_ps(m, x); }
  static F max_where(M m, F a, F x) { return _mm256_blendv_ps(a, _mm256_max_ps(a, x), m); }
  static F round(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F p, F n) {  // n in [-126, 127] here (exp clamps x)
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
  static F lanes() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
  // The transposed sum of L vectors, one level of a tree: level 1 adds the 128-bit halves of keys x, y into
  // one vector (4 lanes each), level 2 their 64-bit pairs, level 3 the last pairs: lane 4h + k then holds
  // key 2k + h's sum, which `in_order` puts in lane 2k + h.
  static constexpr int LEVELS = 3;
  template <int LEVEL>
  static F fold(F x, F y) {
    if constexpr (LEVEL == 1) return add(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
    else if constexpr (LEVEL == 2)
      return add(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(x), _mm256_castps_pd(y))),
                 _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(x), _mm256_castps_pd(y))));
    else if constexpr (LEVEL == 3) return add(_mm256_shuffle_ps(x, y, 0x88), _mm256_shuffle_ps(x, y, 0xDD));
  }
  static F in_order(F x) { return _mm256_permutevar8x32_ps(x, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); }
  template <bool BF16>
  static F row(const void* r, int c) {
    if constexpr (BF16) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(r) + c));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_loadu_ps(static_cast<const float*>(r) + c);
    }
  }
  template <bool BF16>
  static F row_part(const void* r, int c, int valid) {
    if (valid >= L) return row<BF16>(r, c);
    if constexpr (BF16) {
      alignas(16) uint16_t t[8] = {};
      std::memcpy(t, static_cast<const uint16_t*>(r) + c, sizeof(uint16_t) * valid);
      return row<true>(t, 0);
    } else {
      return _mm256_maskload_ps(static_cast<const float*>(r) + c, ints(valid));
    }
  }
};
#endif
using F = Lanes::F;
using M = Lanes::M;
constexpr int L = Lanes::L;

// e^x a lane, relative error ~1e-7 (x = n ln2 + r, |r| <= ln2 / 2, degree-7 polynomial, times 2^n).
inline F vexp(F x) {
  x = Lanes::min(Lanes::max(x, Lanes::set1(-87.0f)), Lanes::set1(88.0f));
  const F n = Lanes::round(Lanes::mul(x, Lanes::set1(1.44269504f)));
  F r = Lanes::fnma(n, Lanes::set1(0.693359375f), x);
  r = Lanes::fnma(n, Lanes::set1(-2.12194440e-4f), r);
  F p = Lanes::set1(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = Lanes::fma(p, r, Lanes::set1(c));
  return Lanes::pow2(p, n);
}

constexpr int GROUP = 4;  // query vectors that share each K / V row loaded

// A row's chunk c of nc (the last one holds `dv` values).
template <bool BF16>
inline F chunk(const void* row, int c, int nc, int dv) {
  return c == nc - 1 ? Lanes::row_part<BF16>(row, L * c, dv) : Lanes::row<BF16>(row, L * c);
}

// The dots of NI query vectors (q: NI rows of nc * L floats, zero-padded) with the 2^LEVEL keys from kj on,
// of which `valid` exist (the others count as zeros and are never read), folded LEVEL levels: out[t].
template <bool BF16, int NI, int LEVEL>
[[gnu::always_inline]] inline void dots(const float* q, int nc, int dv, const char* kj, size_t key_stride, int valid, F* out) {
  if constexpr (LEVEL == 0) {
    for (int t = 0; t < NI; ++t) out[t] = Lanes::zero();
    if (valid <= 0) return;
    for (int c = 0; c < nc; ++c) {
      const F k = chunk<BF16>(kj, c, nc, dv);
      for (int t = 0; t < NI; ++t) out[t] = Lanes::fma(Lanes::load(q + (t * nc + c) * L), k, out[t]);
    }
  } else {
    constexpr int half = 1 << (LEVEL - 1);
    F x[NI], y[NI];
    dots<BF16, NI, LEVEL - 1>(q, nc, dv, kj, key_stride, valid, x);
    dots<BF16, NI, LEVEL - 1>(q, nc, dv, kj + half * key_stride, key_stride, valid - half, y);
    for (int t = 0; t < NI; ++t) out[t] = Lanes::fold<LEVEL>(x[t], y[t]);
  }
}

// Logits of NI query vectors (q: NI rows of nc * L floats, zero-padded) over a block's n keys:
// s[t * bsp + j] = q_t . k_j (bsp >= n rounded up to L; the lanes past n hold zeros). L keys at a time:
// each key row is loaded (and widened) once for the NI queries, and the L keys' dot vectors are summed
// transposed (Lanes::fold) into one vector of L logits.
template <bool BF16, int NI>
inline void logits_group(const float* q, int nc, int dv, const char* kh, size_t key_stride, int n, float* s,
                         int bsp) {
  for (int j = 0; j < n; j += L) {
    F a[NI];
    dots<BF16, NI, Lanes::LEVELS>(q, nc, dv, kh + j * key_stride, key_stride, n - j, a);
    for (int t = 0; t < NI; ++t) Lanes::storeu(s + t * bsp + j, Lanes::in_order(a[t]));
  }
}

// acc_t = alpha_t acc_t + sum_j p[t * bsp + j] v_j for NI query vectors (acc: NI rows of nc * L floats);
// each value row is loaded (and widened) once for the NI queries.
template <bool BF16, int NI>
inline void values_group(const float* p, int bsp, const float* alpha, float* acc, int nc, int dv, const char* vh,
                         size_t key_stride, int n) {
  for (int c = 0; c < nc; ++c) {
    F a[NI];
    for (int t = 0; t < NI; ++t) a[t] = Lanes::mul(Lanes::load(acc + (t * nc + c) * L), Lanes::set1(alpha[t]));
    for (int j = 0; j < n; ++j) {
      const F v = chunk<BF16>(vh + j * key_stride, c, nc, dv);
      for (int t = 0; t < NI; ++t) a[t] = Lanes::fma(Lanes::set1(p[t * bsp + j]), v, a[t]);
    }
    for (int t = 0; t < NI; ++t) Lanes::store(acc + (t * nc + c) * L, a[t]);
  }
}

#include "cpu_dpbf16.h"  // JP_DPBF16: the logits of a bfloat16 pool by vdpbf16ps

#define JP_GROUPS(F, BF, ni, ...)          \
  switch (ni) {                            \
    case 1: F<BF, 1>(__VA_ARGS__); break;  \
    case 2: F<BF, 2>(__VA_ARGS__); break;  \
    case 3: F<BF, 3>(__VA_ARGS__); break;  \
    default: F<BF, 4>(__VA_ARGS__); break; \
  }

// Head h's K and V rows of a block (bs keys, `span` bytes from byte `head` of each key, keys key_stride
// apart) into L2 (_MM_HINT_T1). Spread a head at a time over the current block's work, the next block's
// misses stay few enough in flight; into L1 (T0), or a whole block at once, they stall the loads
// (measured: docs/kernels.md).
inline void prefetch_head(const char* k, const char* v, size_t head, size_t span, size_t key_stride, int bs) {
  for (int j = 0; j < bs; ++j) {
    const size_t o = head + j * key_stride;
    for (size_t x = 0; x < span; x += 64) {
      _mm_prefetch(k + o + x, _MM_HINT_T1);
      _mm_prefetch(v + o + x, _MM_HINT_T1);
    }
    _mm_prefetch(k + o + span - 1, _MM_HINT_T1);  // a row that does not start on a line ends on one more
    _mm_prefetch(v + o + span - 1, _MM_HINT_T1);
  }
}

constexpr int MAX_BLOCK = 128;  // block_size on the vector path (the caller falls back beyond)
// Keys of one softmax update (a tile of whole blocks, at least one): the update's fixed work per query vector
// (the maximum, a scalar exp, the sum, the rescale of the accumulators) spread over more keys than a block.
constexpr int TILE_KEYS = 64;
constexpr int MAX_TILE = std::max(TILE_KEYS, MAX_BLOCK);  // a tile's logits a query vector, at most (cb * bsp)

// One unit: rows u.row0..u.row0+u.rows of slot u.slot, every KV head, over the slot's keys.
template <bool BF16>
void attend_vector(const Problem& P, const Unit& u) {
  const int D = static_cast<int>(P.D), bs = static_cast<int>(P.bs), G = static_cast<int>(P.G);
  const int H = u.heads, h0 = u.head, rows = u.rows, R = G * rows;  // the unit's KV heads; R query vectors a head
  const int nc = (D + L - 1) / L, dv = D - L * (nc - 1);               // chunks of a row, the last one's values
  const int bsp = (bs + L - 1) / L * L;  // a block's logits, padded to whole vectors
  const int64_t row_end = P.qsl[u.slot + 1], len = P.lens[u.slot];
  thread_local std::vector<float> buf;
  const size_t QV = static_cast<size_t>(H) * R;  // query vectors of the unit, (head - h0, row, g)
  const size_t W = static_cast<size_t>(nc) * L;    // a query vector's floats, zero-padded
#if JP_DPBF16
  const int nb = (D + BH - 1) / BH, db = D - BH * (nb - 1);  // bfloat16 vectors of a row, the last one's values
  const size_t W2 = static_cast<size_t>(nb) * BH;             // a split query's bfloat16 values, zero-padded
#else
  const size_t W2 = 0;
#endif
  const int cb = std::max(1, TILE_KEYS / bsp);  // blocks of a tile: the keys of one softmax update
  const int sp = cb * bsp;                      // a tile's logits a query vector
  buf.resize(QV * (2 * W + W2 + 4 + sp) + 16);
  // [QV, W] weighted values, 64-byte aligned, then [QV, W] the unit's queries, then (bfloat16 pools on
  // AVX-512 BF16) [QV, W2] their hi and [QV, W2] their lo bfloat16 halves
  float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  float* qb = acc + QV * W;
  uint16_t* qhi = reinterpret_cast<uint16_t*>(qb + QV * W);
  uint16_t* qlo = qhi + QV * W2;
  float* m = qb + QV * (W + W2);                    // [QV] running max
  float* l = m + QV;                                // [QV] running sum
  float* s = l + QV;                                // [QV, sp] the logits, then probabilities, of a tile
  float* alpha = s + QV * sp;                       // [QV] the rescale of the old sums by a tile
  float* ones = alpha + QV;                         // [QV] ones: the rescale of a tile's later blocks
  std::fill(ones, ones + QV, 1.f);
  std::fill(acc, acc + 2 * QV * W, 0.f);
  std::fill(m, m + QV, NEG);
  std::fill(l, l + QV, 0.f);
  int64_t pos[TILE_ROWS];
  int64_t lo = INT64_MAX, hi = -1;  // key positions the unit may see
  for (int r = 0; r < rows; ++r) {
    pos[r] = len - (row_end - (u.row0 + r));
    if (pos[r] >= 0) {
      hi = std::max(hi, pos[r]);
      lo = std::min(lo, P.window > 0 ? std::max<int64_t>(pos[r] - P.window + 1, 0) : 0);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < R; ++i)
      std::memcpy(qb + (static_cast<size_t>(h) * R + i) * W,
                  P.q + ((u.row0 + i / G) * P.Hq + (h0 + h) * G + i % G) * P.D, sizeof(float) * D);
#if JP_DPBF16
  bool with_lo = false;  // some query is not bfloat16-exact: its logits take the lo halves too
  if constexpr (BF16)
    for (size_t i = 0; i < QV; ++i) with_lo |= split_query(qb + i * W, D, nb, qhi + i * W2, qlo + i * W2);
#endif
  const size_t elt = BF16 ? 2 : 4;
  const size_t key_stride = static_cast<size_t>(P.Hkv) * D * elt;  // bytes between keys of a block
  const F lane = Lanes::lanes(), scale = Lanes::set1(P.scale);
  const int64_t first = hi < 0 ? 1 : lo / bs, last = hi / bs;  // the blocks the unit reads
  const size_t bytes = static_cast<size_t>(bs) * key_stride;       // a block of one pool
  // The pool offset of block b of the slot (the reference's gathers clip the id).
  auto block_at = [&](int64_t b) {
    const int64_t id = P.tables[u.slot * P.B + std::min<int64_t>(b, P.B - 1)];
    return static_cast<size_t>(std::min<int64_t>(std::max<int64_t>(id, 0), P.NB - 1)) * bytes;
  };
  const size_t head_bytes = static_cast<size_t>(D) * elt;
  for (int64_t b0 = first; hi >= 0 && b0 <= last; b0 += cb) {
    const int nblk = static_cast<int>(std::min<int64_t>(cb, last + 1 - b0));  // blocks of this tile
    size_t off[MAX_TILE / L];                       // the tile's blocks
    int nk[MAX_TILE / L];                           // keys of each block <= hi
    for (int t = 0; t < nblk; ++t) {
      off[t] = block_at(b0 + t);
      nk[t] = static_cast<int>(std::min<int64_t>(bs, hi + 1 - (b0 + t) * bs));
    }
    // logits s[h, i, t * bsp + j] = q_i . k_j of block t, i = (row, g), a block's heads after each other (its
    // rows are contiguous); the next block's rows of a head prefetched while the head is worked on
    for (int t = 0; t < nblk; ++t) {
      const size_t next = b0 + t < last ? block_at(b0 + t + 1) : 0;
      for (int h = 0; h < H; ++h) {
        const char* kh = P.k + off[t] + (h0 + h) * head_bytes;
        if (b0 + t < last) prefetch_head(P.k + next, P.v + next, (h0 + h) * head_bytes, head_bytes, key_stride, bs);
        float* sh = s + static_cast<size_t>(h) * R * sp + t * bsp;
        for (int i0 = 0; i0 < R; i0 += GROUP) {
#if JP_DPBF16
          if constexpr (BF16) {
            const size_t at = (static_cast<size_t>(h) * R + i0) * W2;
            logits_bh_group(R - i0, with_lo, qhi + at, qlo + at, nb, db, kh, key_stride, nk[t],
                            sh + static_cast<size_t>(i0) * sp, sp);
            continue;
          }
#endif
          JP_GROUPS(logits_group, BF16, R - i0, qb + (static_cast<size_t>(h) * R + i0) * W, nc, dv, kh, key_stride,
                    nk[t], sh + static_cast<size_t>(i0) * sp, sp)
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      // the tile's softmax update, L keys at a time; alpha rescales the old sums
      for (int r = 0; r < rows; ++r) {
        const F p_hi = Lanes::set1(static_cast<float>(pos[r]));  // positions as float: exact below 2^24
        const F p_lo = Lanes::set1(P.window > 0 ? static_cast<float>(pos[r] - P.window) : -1.f);
        for (int g = 0; g < G; ++g) {
          const int i = r * G + g;
          const size_t qi = static_cast<size_t>(h) * R + i;
          float* si = s + (static_cast<size_t>(h) * R + i) * sp;
          F mx = Lanes::set1(NEG);
          M seen[MAX_TILE / L];
          for (int t = 0, c = 0; t < nblk; ++t)
            for (int j = 0; j < nk[t]; j += L, ++c) {  // c: the vector at t * bsp + j
              const F kp = Lanes::add(Lanes::set1(static_cast<float>((b0 + t) * bs + j)), lane);
              seen[c] = Lanes::both(Lanes::both(Lanes::le(kp, p_hi), Lanes::gt(kp, p_lo)), Lanes::first(nk[t] - j));
              F x = Lanes::mul(Lanes::loadu(si + t * bsp + j), scale);
              if (P.softcap > 0.f) {
                alignas(64) float e[L];
                Lanes::store(e, x);
                for (float& y : e) y = P.softcap * std::tanh(y / P.softcap);
                x = Lanes::load(e);
              }
              Lanes::storeu(si + t * bsp + j, x);
              mx = Lanes::max_where(seen[c], mx, x);
            }
          const float mb = Lanes::hmax(mx);
          if (mb <= NEG) {  // this query sees none of the tile: its sums stay as they are
            alpha[qi] = 1.f;
            std::fill(si, si + sp, 0.f);
            continue;
          }
          const float m_new = std::max(m[qi], mb);
          alpha[qi] = std::exp(m[qi] - m_new);
          F sum = Lanes::zero();
          for (int t = 0, c = 0; t < nblk; ++t)
            for (int j = 0; j < nk[t]; j += L, ++c) {
              const F p = Lanes::keep(seen[c], vexp(Lanes::sub(Lanes::loadu(si + t * bsp + j), Lanes::set1(m_new))));
              Lanes::storeu(si + t * bsp + j, p);
              sum = Lanes::add(sum, p);
            }
          m[qi] = m_new;
          l[qi] = l[qi] * alpha[qi] + Lanes::hsum(sum);
        }
      }
    }
    // values: acc_i = alpha_i acc_i + sum_j p_ij v_j, alpha applied with the tile's first block
    for (int t = 0; t < nblk; ++t)
      for (int h = 0; h < H; ++h) {
        const char* vh = P.v + off[t] + (h0 + h) * head_bytes;
        const float* sh = s + static_cast<size_t>(h) * R * sp + t * bsp;
        for (int i0 = 0; i0 < R; i0 += GROUP)
          JP_GROUPS(values_group, BF16, R - i0, sh + static_cast<size_t>(i0) * sp, sp,
                    (t == 0 ? alpha : ones) + h * R + i0, acc + (static_cast<size_t>(h) * R + i0) * W, nc, dv, vh,
                    key_stride, nk[t])
      }
  }
  for (int h = 0; h < H; ++h) {
    for (int i = 0; i < R; ++i) {
      const size_t qi = static_cast<size_t>(h) * R + i;
      float* dst = P.out + ((u.row0 + i / G) * P.Hq + (h0 + h) * G + i % G) * P.D;
      const F inv = Lanes::set1(l[qi] > 0.f ? 1.f / l[qi] : 0.f);  // a query that saw nothing: zeros
      for (int c = 0; c < nc; ++c) {
        const F x = Lanes::mul(Lanes::load(acc + qi * W + L * c), inv);
        if (c == nc - 1) Lanes::store_part(dst + L * c, dv, x); else Lanes::storeu(dst + L * c, x);
      }
    }
  }
}
#endif


// One unit of work: the vector path's (`fast`: units span every KV head) or the plain loops'.
inline void run_unit(const Problem& P, const Unit& u, bool fast) {
#if JP_AVX512 || JP_AVX2
  if (fast) return (P.bf16 ? attend_vector<true> : attend_vector<false>)(P, u);
#endif
  (void)fast;
  attend(P, u);
}

// Every operand's dtype and dimensions against q's and the tables' (InvalidArgument naming the operand):
// the loops below index seq_lens and query_start_loc by slot, v_pool like k_pool and out like q.
ffi::Error check(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k_pool, const ffi::AnyBuffer& v_pool,
                 const ffi::AnyBuffer& block_tables, const ffi::AnyBuffer& seq_lens,
                 const ffi::AnyBuffer& query_start_loc, const ffi::AnyBuffer& out) {
  constexpr const char* K = "cpu_paged_attention";
  using T = ffi::DataType;
  if (q.element_type() != T::F32 || !jp::has_dims(q, {-1, -1, -1}) || q.dimensions()[2] <= 0)
    return jp::bad_operand(K, "q", "float32 [T, Hq, D > 0]", q);
  auto qd = q.dimensions(), kd = k_pool.dimensions();
  const auto et = k_pool.element_type();
  if ((et != T::F32 && et != T::BF16) || !jp::has_dims(k_pool, {-1, -1, -1, qd[2]}) || kd[0] <= 0 || kd[1] <= 0 ||
      kd[2] <= 0 || qd[1] % kd[2])
    return jp::bad_operand(K, "k_pool", "float32 or bfloat16 [num_blocks > 0, block_size > 0, Hkv, D = " +
                           std::to_string(qd[2]) + "] with Hkv > 0 dividing q's " + std::to_string(qd[1]) +
                           " heads", k_pool);
  if (v_pool.element_type() != et || !jp::has_dims(v_pool, {kd[0], kd[1], kd[2], kd[3]}))
    return jp::bad_operand(K, "v_pool", "k_pool's dtype and dimensions (" + jp::describe(k_pool) + ")", v_pool);
  if (block_tables.element_type() != T::S32 || !jp::has_dims(block_tables, {-1, -1}) ||
      block_tables.dimensions()[1] <= 0)
    return jp::bad_operand(K, "block_tables", "int32 [S, B > 0]", block_tables);
  const int64_t S = block_tables.dimensions()[0];
  if (seq_lens.element_type() != T::S32 || !jp::has_dims(seq_lens, {S}))
    return jp::bad_operand(K, "seq_lens", "int32 [S = " + std::to_string(S) + "] (one per block_tables row)",
                           seq_lens);
  if (query_start_loc.element_type() != T::S32 || !jp::has_dims(query_start_loc, {S + 1}))
    return jp::bad_operand(K, "query_start_loc", "int32 [S + 1 = " + std::to_string(S + 1) + "]", query_start_loc);
  if (out.element_type() != T::F32 || !jp::has_dims(out, {qd[0], qd[1], qd[2]}))
    return jp::bad_operand(K, "out", "float32 of q's dimensions", out);
  return ffi::Error::Success();
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                ffi::AnyBuffer block_tables, ffi::AnyBuffer seq_lens, ffi::AnyBuffer query_start_loc,
                ffi::Result<ffi::AnyBuffer> out, float scale, int64_t window, float softcap) {
  if (ffi::Error e = check(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, *out); e.failure()) return e;
  auto qd = q.dimensions(), kd = k_pool.dimensions(), td = block_tables.dimensions();
  Problem P;
  P.q = q.typed_data<float>();
  P.k = static_cast<const char*>(k_pool.untyped_data());
  P.v = static_cast<const char*>(v_pool.untyped_data());
  P.tables = block_tables.typed_data<int32_t>();
  P.lens = seq_lens.typed_data<int32_t>();
  P.qsl = query_start_loc.typed_data<int32_t>();
  P.out = out->typed_data<float>();
  P.T = qd[0], P.Hq = qd[1], P.D = qd[2];
  P.NB = kd[0], P.bs = kd[1], P.Hkv = kd[2];
  P.S = td[0], P.B = td[1];
  const auto et = k_pool.element_type();
  P.G = P.Hq / P.Hkv;
  P.bf16 = et == ffi::DataType::BF16;
  P.scale = scale, P.softcap = softcap, P.window = window;
  std::memset(P.out, 0, sizeof(float) * P.T * P.Hq * P.D);  // padding rows stay zeros
  const bool fast = (JP_AVX512 || JP_AVX2) && P.bs <= 128;  // the vector path (cpu.py VECTOR_BLOCK_SIZE)
  // units a row tile: the plain loops' one a KV head; the vector path's one over every KV head, or, with fewer
  // row tiles than threads (a lone decode), the KV heads cut into `parts` ranges so every thread has work
  std::vector<Unit> tiles;  // the row tiles, KV heads not yet assigned
  for (int64_t s = 0; s < P.S; ++s) {
    const int64_t a = std::clamp<int64_t>(P.qsl[s], 0, P.T), e = std::clamp<int64_t>(P.qsl[s + 1], 0, P.T);
    for (int64_t r = a; r < e; r += TILE_ROWS)
      tiles.push_back({static_cast<int32_t>(s), 0, static_cast<int32_t>(r),
                       static_cast<int32_t>(std::min<int64_t>(TILE_ROWS, e - r)), 0});
  }
  const int64_t n_tiles = static_cast<int64_t>(tiles.size()), threads = std::max<int64_t>(pool.num_threads(), 1);
  int64_t parts = 1;
  if (!fast) parts = P.Hkv;
  else if (n_tiles > 0 && n_tiles < threads) parts = std::min<int64_t>(P.Hkv, (threads + n_tiles - 1) / n_tiles);
  std::vector<Unit> units;
  for (const Unit& t : tiles)
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t h = P.Hkv * p / parts, h1 = P.Hkv * (p + 1) / parts;  // KV heads h..h1
      units.push_back({t.slot, static_cast<int32_t>(h), t.row0, t.rows, static_cast<int32_t>(h1 - h)});
    }
  // the long units first (the most keys x rows): the threads then end close together
  auto cost = [&P](const Unit& x) { return static_cast<int64_t>(x.rows) * std::max<int32_t>(P.lens[x.slot], 1); };
  std::stable_sort(units.begin(), units.end(), [&](const Unit& x, const Unit& y) { return cost(x) > cost(y); });
  const int64_t n = static_cast<int64_t>(units.size());
  const Unit* us = units.data();
  jp::parallel_for(pool, n, n, [P, us, fast](int64_t i) { run_unit(P, us[i], fast); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedCpuPagedAttention, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k_pool
                                  .Arg<ffi::AnyBuffer>()  // v_pool
                                  .Arg<ffi::AnyBuffer>()  // block_tables
                                  .Arg<ffi::AnyBuffer>()  // seq_lens
                                  .Arg<ffi::AnyBuffer>()  // query_start_loc
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap"));

// The vector path's float32 lanes in this build (16: AVX-512, 8: AVX2 + FMA), 0 without it.
extern "C" int JaxpagedCpuAttentionVectorized() { return JP_AVX512 ? 16 : JP_AVX2 ? 8 : 0; }

// 1 where this build takes a bfloat16 pool's logits by vdpbf16ps (AVX-512 BF16, cpu_dpbf16.h), else 0.
extern "C" int JaxpagedCpuAttentionBf16Dots() {
#if JP_AVX512 || JP_AVX2
  return JP_DPBF16;
#else
  return 0;
#endif
}
