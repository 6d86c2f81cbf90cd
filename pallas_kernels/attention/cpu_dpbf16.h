// The logits of a bfloat16 pool on AVX-512 BF16 (vdpbf16ps), included by cpu.cc inside its namespace after
// its Lanes (16 float32 lanes), `fold` tree and GROUP: each instruction multiplies 32 bfloat16 pairs of a
// key row and a query and adds them, two a lane, into float32 lanes, so a key row is read from the pool
// as it is (no widening) and half as many products are issued as with float32 lanes.
//
// Exactness: a bfloat16 x bfloat16 product is exact in float32, so the only rounding is in the sums (as
// with FMAs, in another order). A float32 query q is split as q = hi + lo, both bfloat16 (lo = q - hi
// rounded, |lo| <= 2^-9 |q|), so q . k = hi . k + lo . k to ~2^-17 of |q| |k|; a query whose values are
// bfloat16 already (a bfloat16 model's) has lo = 0 and takes one product a pair. The instruction treats
// subnormal inputs and results as zero.
#pragma once

#if defined(__AVX512BF16__) && JP_AVX512
#define JP_DPBF16 1

constexpr int BH = 32;  // bfloat16 values in a vector

// The first `valid` (1..32) 16-bit lanes.
inline __mmask32 first_bh(int valid) { return valid >= BH ? ~__mmask32{0} : (__mmask32{1} << valid) - 1; }

// q [D] float32 -> hi, lo [nb * 32] bfloat16 (zero-padded past D), hi rounded to nearest even, lo the rest of
// q rounded; returns whether any lo is non-zero.
inline bool split_query(const float* q, int D, int nb, uint16_t* hi, uint16_t* lo) {
  __mmask32 any = 0;
  for (int c = 0; c < nb; ++c) {
    const int a = std::min(D - BH * c, 16), b = std::min(D - BH * c - 16, 16);
    const __m512 x0 = _mm512_maskz_loadu_ps(Lanes::first(a), q + BH * c);
    const __m512 x1 = b > 0 ? _mm512_maskz_loadu_ps(Lanes::first(b), q + BH * c + 16) : _mm512_setzero_ps();
    const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(x1, x0));  // [x0's 16, x1's 16]
    const __m512 h0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
    const __m512 h1 =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
    const __m512i l = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, h1), _mm512_sub_ps(x0, h0)));
    _mm512_store_si512(hi + BH * c, h);
    _mm512_store_si512(lo + BH * c, l);
    any |= _mm512_test_epi16_mask(l, l);
  }
  return any != 0;
}

// vdpbf16ps: acc + the pairwise products of a and b, two a lane.
inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// The dots of NI split queries (hi, lo: NI rows of nb * 32 bfloat16) with the 2^LEVEL keys from kj on, of
// which `valid` exist (the others count as zeros and are never read), folded LEVEL levels: out[t]. The last
// of a row's nb vectors holds `db` values.
template <int NI, bool LO, int LEVEL>
[[gnu::always_inline]] inline void dots_bh(const uint16_t* hi, const uint16_t* lo, int nb, int db, const char* kj,
                                           size_t key_stride, int valid, F* out) {
  if constexpr (LEVEL == 0) {
    for (int t = 0; t < NI; ++t) out[t] = Lanes::zero();
    if (valid <= 0) return;
    for (int c = 0; c < nb; ++c) {
      const __m512i k = _mm512_maskz_loadu_epi16(first_bh(c == nb - 1 ? db : BH),
                                                 reinterpret_cast<const uint16_t*>(kj) + BH * c);
      for (int t = 0; t < NI; ++t) {
        out[t] = dp(out[t], _mm512_load_si512(hi + (t * nb + c) * BH), k);
        if constexpr (LO) out[t] = dp(out[t], _mm512_load_si512(lo + (t * nb + c) * BH), k);
      }
    }
  } else {
    constexpr int half = 1 << (LEVEL - 1);
    F x[NI], y[NI];
    dots_bh<NI, LO, LEVEL - 1>(hi, lo, nb, db, kj, key_stride, valid, x);
    dots_bh<NI, LO, LEVEL - 1>(hi, lo, nb, db, kj + half * key_stride, key_stride, valid - half, y);
    for (int t = 0; t < NI; ++t) out[t] = Lanes::fold<LEVEL>(x[t], y[t]);
  }
}

// logits_group's contract for a bfloat16 pool and split queries: s[t * bsp + j] = q_t . k_j over n keys.
template <int NI, bool LO>
inline void logits_bh(const uint16_t* hi, const uint16_t* lo, int nb, int db, const char* kh, size_t key_stride,
                      int n, float* s, int bsp) {
  for (int j = 0; j < n; j += Lanes::L) {
    F a[NI];
    dots_bh<NI, LO, Lanes::LEVELS>(hi, lo, nb, db, kh + j * key_stride, key_stride, n - j, a);
    for (int t = 0; t < NI; ++t) Lanes::storeu(s + t * bsp + j, Lanes::in_order(a[t]));
  }
}

// logits_bh for ni (1..GROUP) queries, with their lo halves where `with_lo`.
inline void logits_bh_group(int ni, bool with_lo, const uint16_t* hi, const uint16_t* lo, int nb, int db,
                            const char* kh, size_t key_stride, int n, float* s, int bsp) {
  static_assert(GROUP == 4, "logits_bh_group dispatches 1..4 queries");
  switch (std::min(ni, GROUP) * 2 + with_lo) {
    case 2: return logits_bh<1, false>(hi, lo, nb, db, kh, key_stride, n, s, bsp);
    case 3: return logits_bh<1, true>(hi, lo, nb, db, kh, key_stride, n, s, bsp);
    case 4: return logits_bh<2, false>(hi, lo, nb, db, kh, key_stride, n, s, bsp);
    case 5: return logits_bh<2, true>(hi, lo, nb, db, kh, key_stride, n, s, bsp);
    case 6: return logits_bh<3, false>(hi, lo, nb, db, kh, key_stride, n, s, bsp);
    case 7: return logits_bh<3, true>(hi, lo, nb, db, kh, key_stride, n, s, bsp);
    case 8: return logits_bh<4, false>(hi, lo, nb, db, kh, key_stride, n, s, bsp);
    default: return logits_bh<4, true>(hi, lo, nb, db, kh, key_stride, n, s, bsp);
  }
}

#else
#define JP_DPBF16 0
#endif
