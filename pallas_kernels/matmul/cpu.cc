// bfloat16 matrix products on the CPU's AMX tiles (an XLA FFI handler): out f32[M, N] = x[M, K] @ w.
//
// w is one weight matrix as the model stores it, read in place: [K, N] (`transpose` 0) or [N, K]
// (`transpose` 1: the tied embedding as the lm_head), or the stack [L, ..] of every layer's with the
// index of the one to read (so the layer loop hands the kernel the stack, never a sliced copy). AMX's B
// operand wants K in pairs (the VNNI layout: row r of a tile holds k = 2r, 2r+1 of 16 columns). Weights
// packed ahead of time in that order (`packed` 1: [N / 16, K / 32, 16, 32], the tiles of 16 columns one
// after the other; matmul/cpu.py `pack`, done once when the runner places its parameters) are read as tiles
// straight from memory; otherwise each unit of work interleaves its slice of the weights into a small
// per-thread buffer (two AVX-512 permutes per two rows of 32 columns). Then every row tile of x runs over it:
//   transpose 0: a unit is 32 columns of w (two 16-column tiles); A = x's rows, B = the packed columns.
//   transpose 1: the product is computed transposed, out^T = w @ x^T: a unit is 32 rows of w, which are
//     A tiles as they lie in memory; B = x^T, packed once per call; each 16 x 16 result tile is written
//     back transposed.
// Register blocking: 2 x 2 result tiles (tmm0-3), 2 A tiles (tmm4-5), 2 B tiles (tmm6-7); float32
// accumulation over K in tiles of 32. Requirements (checked by the caller, pallas_kernels/matmul/cpu.py):
// K % 32 == 0, N % 16 == 0, both operands bfloat16.
// Units are shared by the XLA FFI's intra-op thread pool through an atomic counter; the calling thread
// works too. Built without AMX (or without the kernel's permission to use it), the same contract runs
// as plain loops: correct and slow, for tests on machines without AMX.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ffi_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__linux__)
#define JP_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace jp_amx {  // the tile basics: permission, one tile shape (16 rows of 64 bytes), configure before use

constexpr int TILE_BYTES = 1024;  // a 16 x 32 bfloat16 tile (16 rows of 64 bytes)

inline bool permitted() {  // Linux hands AMX's tile state to a process that asks for it (once, for all threads)
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  _tile_loadconfig(&c);
}

}  // namespace jp_amx
#else
#define JP_AMX 0
#endif

namespace {

using jp::bf16_to_f32;

struct Problem {
  const uint16_t* x;  // [M, K] (or the zero-padded copy [Mp, K] on the AMX path)
  const uint16_t* w;  // [K, N] or [N, K]
  float* out;         // [M, N]
  int64_t M, K, N;
  bool transpose;
  bool packed;  // w in the tile order of `pack` (matmul/cpu.py): [N / 16, K / 32, 16, 32]
};

// Element (k, n) of w [K, N] (transpose 0), wherever its layout puts it.
inline uint16_t weight(const Problem& P, int64_t k, int64_t n) {
  if (!P.packed) return P.w[k * P.N + n];
  return P.w[((n / 16) * (P.K / 32) + k / 32) * 512 + ((k % 32) / 2) * 32 + (n % 16) * 2 + (k % 2)];
}

// The plain-loop path (no AMX): the same contract, float32 accumulation.
void plain(const Problem& P, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < P.M; ++m) {
    float* o = P.out + m * P.N;
    const uint16_t* xr = P.x + m * P.K;
    if (P.transpose) {
      for (int64_t n = n0; n < n1; ++n) {
        const uint16_t* wr = P.w + n * P.K;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t k = 0; k < P.K; ++k) s += bf16_to_f32(xr[k]) * bf16_to_f32(wr[k]);
        o[n] = s;
      }
    } else {
      for (int64_t n = n0; n < n1; ++n) o[n] = 0.f;
      for (int64_t k = 0; k < P.K; ++k) {
        const float xv = bf16_to_f32(xr[k]);
        if (P.packed) {
          for (int64_t n = n0; n < n1; ++n) o[n] += xv * bf16_to_f32(weight(P, k, n));
          continue;
        }
        const uint16_t* wr = P.w + k * P.N;
#pragma omp simd
        for (int64_t n = n0; n < n1; ++n) o[n] += xv * bf16_to_f32(wr[n]);
      }
    }
  }
}

#if JP_AMX
using jp_amx::TILE_BYTES;
constexpr int64_t PANEL = 128;     // columns of w a unit packs (transpose 0): rows read 256 bytes at a time
constexpr int64_t PREFETCH_ROWS = 16;  // rows of w ahead of the packing that are prefetched

// Result tiles (MT x NT of 16 x 16 float32) of A rows [MT*16, K] (stride lda bytes) times the packed B
// tiles b[nt] (KB tiles of 16 x 32 each, consecutive) -> c[i * 2 + j] (16 x 16 each, dense).
// Operands read from memory rather than from the caches are prefetched PREFETCH_TILES K tiles ahead:
// `fetch` bit 0 the A rows, bit 1 the B tiles.
constexpr int64_t PREFETCH_TILES = 6;
constexpr int FETCH_A = 1, FETCH_B = 2;

template <int MT, int NT>
void tiles(const uint16_t* a, int64_t lda, const uint16_t* const* b, int64_t KB, float* c, int fetch) {
  _tile_zero(0);
  if (NT == 2) _tile_zero(1);
  if (MT == 2) _tile_zero(2);
  if (MT == 2 && NT == 2) _tile_zero(3);
  const char* a0 = reinterpret_cast<const char*>(a);
  const char* a1 = a0 + 16 * lda;
  for (int64_t kb = 0; kb < KB; ++kb) {
    if (fetch && kb + PREFETCH_TILES < KB) {
      const int64_t ahead = kb + PREFETCH_TILES;
      if (fetch & FETCH_A)
        for (int r = 0; r < 16 * MT; ++r) _mm_prefetch(a0 + r * lda + ahead * 64, _MM_HINT_T0);
      if (fetch & FETCH_B)
        for (int j = 0; j < NT; ++j)
          for (int line = 0; line < TILE_BYTES; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(b[j]) + ahead * TILE_BYTES + line, _MM_HINT_T0);
    }
    _tile_loadd(4, a0 + kb * 64, lda);
    if (MT == 2) _tile_loadd(5, a1 + kb * 64, lda);
    _tile_loadd(6, reinterpret_cast<const char*>(b[0]) + kb * TILE_BYTES, 64);
    if (NT == 2) _tile_loadd(7, reinterpret_cast<const char*>(b[1]) + kb * TILE_BYTES, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (NT == 2) _tile_dpbf16ps(1, 4, 7);
    if (MT == 2) _tile_dpbf16ps(2, 5, 6);
    if (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  if (NT == 2) _tile_stored(1, c + 256, 64);
  if (MT == 2) _tile_stored(2, c + 512, 64);
  if (MT == 2 && NT == 2) _tile_stored(3, c + 768, 64);
}

using TilesFn = void (*)(const uint16_t*, int64_t, const uint16_t* const*, int64_t, float*, int);
constexpr TilesFn TILES[2][2] = {{tiles<1, 1>, tiles<1, 2>}, {tiles<2, 1>, tiles<2, 2>}};

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

// One unit u of the product on AMX tiles (on a thread that configured them): a panel of up to PANEL
// columns of w (transpose 0), or 32 rows of w (transpose 1). x is padded to m_tiles * 16 rows (transpose
// 0); xt is x^T packed, m_tiles x KB tiles (transpose 1).
struct Tiled {
  Problem P;
  int64_t m_tiles;         // 16-row tiles along M
  const uint16_t* xt;      // transpose 1 only

  void unit(int64_t u) const {
    const int64_t K = P.K, KB = K / 32, N = P.N;
    thread_local std::vector<uint16_t> buf;
    alignas(64) float c[1024];
    if (!P.transpose) {
      // a panel of up to PANEL columns: its rows read 2 at a time in order (a few cache lines each,
      // prefetched ahead), interleaved into tiles t (16 columns each) x kb, then every row tile of x
      const int64_t n0 = u * PANEL, nt = std::min<int64_t>(PANEL / 16, (N - n0) / 16);
      buf.resize(PANEL / 16 * KB * 512);
      uint16_t* b = P.packed ? const_cast<uint16_t*>(P.w) + (n0 / 16) * KB * 512 : buf.data();
      for (int64_t kb = 0; kb < KB && !P.packed; ++kb)
        for (int r = 0; r < 16; ++r) {
          const int64_t k = kb * 32 + 2 * r;
          const uint16_t* r0 = P.w + k * N + n0;
          if (k + PREFETCH_ROWS + 1 < K)
            for (int64_t j = 0; j < nt * 16; j += 32) {
              _mm_prefetch(reinterpret_cast<const char*>(r0 + PREFETCH_ROWS * N + j), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(r0 + (PREFETCH_ROWS + 1) * N + j), _MM_HINT_T0);
            }
          for (int64_t t = 0; t < nt; t += 2)
            interleave(r0 + t * 16, r0 + N + t * 16, static_cast<int>(std::min<int64_t>(2, nt - t) * 16),
                       b + (t * KB + kb) * 512 + r * 32, b + ((t + 1) * KB + kb) * 512 + r * 32);
        }
      for (int64_t t = 0; t < nt; t += 2) {
        const int tn = static_cast<int>(std::min<int64_t>(2, nt - t));
        const uint16_t* bt[2] = {b + t * KB * 512, b + (t + 1) * KB * 512};
        for (int64_t mt = 0; mt < m_tiles; mt += 2) {
          const int mn = static_cast<int>(std::min<int64_t>(2, m_tiles - mt));
          TILES[mn - 1][tn - 1](P.x + mt * 16 * K, K * 2, bt, KB, c, P.packed && mt == 0 ? FETCH_B : 0);
          for (int i = 0; i < mn; ++i)
            for (int r = 0; r < 16; ++r) {
              const int64_t m = (mt + i) * 16 + r;
              if (m >= P.M) break;
              for (int j = 0; j < tn; ++j)
                std::memcpy(P.out + m * N + n0 + (t + j) * 16, c + (i * 2 + j) * 256 + r * 16, 64);
            }
        }
      }
    } else {  // out^T tile (w rows n, x rows m) = w[n0 .., :] @ x^T; w's 32 rows read in place as A tiles
      const int64_t n0 = u * 32, nt = std::min<int64_t>(2, (N - n0) / 16);
      for (int64_t mt = 0; mt < m_tiles; mt += 2) {
        const int mn = static_cast<int>(std::min<int64_t>(2, m_tiles - mt));
        const uint16_t* bt[2] = {xt + mt * KB * 512, xt + (mt + 1) * KB * 512};
        TILES[nt - 1][mn - 1](P.w + n0 * K, K * 2, bt, KB, c, mt == 0 ? FETCH_A : 0);
        for (int i = 0; i < nt; ++i)      // w rows n0 + 16 i ..
          for (int j = 0; j < mn; ++j) {  // x rows 16 (mt + j) ..
            const float* t = c + (i * 2 + j) * 256;
            for (int mm = 0; mm < 16; ++mm) {
              const int64_t m = (mt + j) * 16 + mm;
              if (m >= P.M) break;
              float* o = P.out + m * N + n0 + i * 16;
              for (int nn = 0; nn < 16; ++nn) o[nn] = t[nn * 16 + mm];
            }
          }
      }
    }
  }
};
#endif

// Every operand's dtype and dimensions (InvalidArgument naming the operand) -> the problem, w pointing at
// the matrix of the layer index.
ffi::Error check(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, const ffi::AnyBuffer& layer,
                 const ffi::AnyBuffer& out, bool transpose, bool packed, Problem& P) {
  constexpr const char* K = "cpu_matmul";
  using T = ffi::DataType;
  if (x.element_type() != T::BF16 || !jp::has_dims(x, {-1, -1}))
    return jp::bad_operand(K, "x", "bfloat16 [M, K]", x);
  const int64_t M = x.dimensions()[0], Kx = x.dimensions()[1];
  auto wd = w.dimensions();
  const size_t mat = packed ? 4 : 2;  // w's dimensions of one matrix; one more when stacked
  const std::string w_form = std::string("bfloat16 ") +
                             (packed ? "packed [N / 16, K / 32, 16, 32]" : transpose ? "[N, K]" : "[K, N]") +
                             " (or [L, ..] of them, stacked) with K = " + std::to_string(Kx) + " (x's)";
  if (w.element_type() != T::BF16 || (wd.size() != mat && wd.size() != mat + 1))
    return jp::bad_operand(K, "w", w_form, w);
  const bool stacked = wd.size() == mat + 1;
  const int64_t d0 = wd[stacked], d1 = wd[stacked + 1];  // [K, N], [N, K], or packed N / 16, K / 32
  if ((packed ? d1 * 32 : transpose ? d1 : d0) != Kx ||
      (packed && (transpose || wd[wd.size() - 2] != 16 || wd[wd.size() - 1] != 32)))
    return jp::bad_operand(K, "w", w_form, w);
  if (layer.element_type() != T::S32 || layer.element_count() != 1)
    return jp::bad_operand(K, "layer", "one int32", layer);
  const int64_t l = stacked ? layer.typed_data<int32_t>()[0] : 0;
  if (l < 0 || (stacked && l >= wd[0]))
    return ffi::Error::InvalidArgument("cpu_matmul: layer must be in [0, " + std::to_string(stacked ? wd[0] : 1) +
                                       ") (w's stacked matrices), got " + std::to_string(l));
  P.N = packed ? d0 * 16 : transpose ? d0 : d1;
  if (out.element_type() != T::F32 || !jp::has_dims(out, {M, P.N}))
    return jp::bad_operand(K, "out", "float32 [M = " + std::to_string(M) + ", N = " + std::to_string(P.N) + "]", out);
  P.x = static_cast<const uint16_t*>(x.untyped_data());
  P.w = static_cast<const uint16_t*>(w.untyped_data()) + l * d0 * d1 * (packed ? 512 : 1);
  P.M = M, P.K = Kx, P.transpose = transpose, P.packed = packed;
  return ffi::Error::Success();
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer layer,
                ffi::Result<ffi::AnyBuffer> out, int64_t transpose, int64_t packed) {
  Problem P;
  if (ffi::Error e = check(x, w, layer, *out, transpose != 0, packed != 0, P); e.failure()) return e;
  P.out = out->typed_data<float>();
  if (P.M == 0 || P.N == 0) return ffi::Error::Success();
#if JP_AMX
  if (P.K % 32 == 0 && P.N % 16 == 0 && jp_amx::permitted()) {
    Tiled tiled{P, (P.M + 15) / 16, nullptr};
    const int64_t units = P.transpose ? (P.N + 31) / 32 : (P.N + PANEL - 1) / PANEL;  // panels or row pairs
    const int64_t KB = P.K / 32;
    std::vector<uint16_t> xpad;  // x zero-padded [m_tiles * 16, K] (transpose 0, when M % 16)
    std::vector<uint16_t> xt;    // x^T packed: m_tiles x KB tiles (transpose 1)
    if (!P.transpose && P.M % 16) {
      xpad.assign(tiled.m_tiles * 16 * P.K, 0);
      std::memcpy(xpad.data(), P.x, sizeof(uint16_t) * P.M * P.K);
      tiled.P.x = xpad.data();
    }
    if (P.transpose) {  // x^T in VNNI tiles: tile (mt, kb) row r = the pairs k = kb*32 + 2r, +1 of rows mt*16 ..
      xt.assign((tiled.m_tiles + 1) * KB * 512, 0);
      for (int64_t m = 0; m < P.M; ++m)
        for (int64_t k = 0; k < P.K; ++k)
          xt[((m / 16) * KB + k / 32) * 512 + ((k % 32) / 2) * 32 + (m % 16) * 2 + (k % 2)] = P.x[m * P.K + k];
      tiled.xt = xt.data();
    }
    jp::parallel_for(pool, units, units, [tiled](int64_t u) { tiled.unit(u); }, [] { jp_amx::configure(); },
                     [] { _tile_release(); });
    return ffi::Error::Success();
  }
#endif
  plain(P, 0, P.N);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedCpuMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Arg<ffi::AnyBuffer>()  // layer
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Attr<int64_t>("transpose")
                                  .Attr<int64_t>("packed"));

// 1 when this build runs the products on AMX tiles (compiled for them and permitted by the kernel), else 0.
extern "C" int JaxpagedCpuMatmulAmx() {
#if JP_AMX
  return jp_amx::permitted() ? 1 : 0;
#else
  return 0;
#endif
}
