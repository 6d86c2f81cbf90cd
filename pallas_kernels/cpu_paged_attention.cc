// Ragged paged attention on the CPU, reading the paged KV pool in place (an XLA FFI handler).
//
// Semantics are those of pallas_kernels/reference.py (ragged_paged_attention_reference): the rows
// query_start_loc[s]..query_start_loc[s+1] of q are the last tokens of slot s's seq_lens[s] keys, causal;
// q head j reads KV head j / G (G = Hq / Hkv); rows past query_start_loc[S], and rows that see no key,
// are zeros. Keys visible to a query at position p: p - window < k <= p (window 0: unbounded).
//
// Work units: (slot, KV head, tile of up to TILE_ROWS query rows). A unit's G x rows query vectors read
// each K/V row of its slot once, a block (block_size keys) at a time: the block is widened to float32
// in a small thread-local buffer (the pool itself is never copied), its logits for every query vector
// computed, and an online softmax (running max, sum, weighted values) merged once per block. The units
// are shared by the XLA FFI's intra-op thread pool through an atomic counter; the calling thread works
// too, so the call never waits on a pool that is busy elsewhere.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int TILE_ROWS = 8;  // query rows of one slot a unit (prefill); decode units have one
constexpr float NEG = -1e30f;

inline float bf16_to_f32(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

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

// The units shared by the threads: each takes the next by `next`, counts it in `done` when finished.
struct Shared {
  Problem P;
  std::vector<Unit> units;
  std::atomic<int64_t> next{0}, done{0};
  void work() {
    for (int64_t i; (i = next.fetch_add(1)) < static_cast<int64_t>(units.size());) {
      attend(P, units[i]);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                ffi::Buffer<ffi::S32> query_start_loc, ffi::ResultBuffer<ffi::F32> out, float scale,
                int64_t window, float softcap) {
  auto qd = q.dimensions(), kd = k_pool.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || k_pool.element_type() != v_pool.element_type())
    return ffi::Error::InvalidArgument("cpu_paged_attention: q [T, Hq, D], pools [NB, bs, Hkv, D] alike, tables [S, B]");
  const auto et = k_pool.element_type();
  if (et != ffi::DataType::F32 && et != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("cpu_paged_attention: pools must be float32 or bfloat16");
  auto sh = std::make_shared<Shared>();
  Problem& P = sh->P;
  P.q = q.typed_data();
  P.k = static_cast<const char*>(k_pool.untyped_data());
  P.v = static_cast<const char*>(v_pool.untyped_data());
  P.tables = block_tables.typed_data();
  P.lens = seq_lens.typed_data();
  P.qsl = query_start_loc.typed_data();
  P.out = out->typed_data();
  P.T = qd[0], P.Hq = qd[1], P.D = qd[2];
  P.NB = kd[0], P.bs = kd[1], P.Hkv = kd[2];
  P.S = td[0], P.B = td[1];
  if (kd[3] != P.D || P.Hkv <= 0 || P.Hq % P.Hkv || P.B <= 0 || P.NB <= 0)
    return ffi::Error::InvalidArgument("cpu_paged_attention: head_dim / head counts do not match");
  P.G = P.Hq / P.Hkv;
  P.bf16 = et == ffi::DataType::BF16;
  P.scale = scale, P.softcap = softcap, P.window = window;
  std::memset(P.out, 0, sizeof(float) * P.T * P.Hq * P.D);  // padding rows stay zeros
  for (int64_t s = 0; s < P.S; ++s) {
    const int64_t a = std::clamp<int64_t>(P.qsl[s], 0, P.T), e = std::clamp<int64_t>(P.qsl[s + 1], 0, P.T);
    for (int64_t r = a; r < e; r += TILE_ROWS)
      for (int64_t h = 0; h < P.Hkv; ++h)
        sh->units.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h), static_cast<int32_t>(r),
                             static_cast<int32_t>(std::min<int64_t>(TILE_ROWS, e - r))});
  }
  // the long units (prefill tiles) first: the threads then end close together
  std::stable_sort(sh->units.begin(), sh->units.end(), [](const Unit& x, const Unit& y) { return x.rows > y.rows; });
  const int64_t n = static_cast<int64_t>(sh->units.size());
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([sh] { sh->work(); });
  sh->work();
  while (sh->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedCpuPagedAttention, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap"));
