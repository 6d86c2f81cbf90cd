// bfloat16 products on the CPU's AMX tiles, the path cpu.cc runs where the build has AMX and Linux grants
// the tile state (`permitted`).
//   transpose 0: a unit is PANEL columns of w (their tiles from `panel`); A = x's rows (zero-padded to whole
//     tiles), B = the packed columns.
//   transpose 1: the product is computed transposed, out^T = w @ x^T: a unit is 32 rows of w, which are
//     A tiles as they lie in memory; B = x^T, packed once per call; each 16 x 16 result tile is written
//     back transposed.
// Register blocking: 2 x 2 result tiles (tmm0-3), 2 A tiles (tmm4-5), 2 B tiles (tmm6-7); float32
// accumulation over K in tiles of 32.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_tiles.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__linux__)
#define JP_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace jp_amx {

// The tile basics: permission, one tile shape (16 rows of 64 bytes), configure before use.

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

using jp_mm::PANEL;
using jp_mm::Problem;
using jp_mm::panel;

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
      // a panel of up to PANEL columns in the tile order (`panel`), then every row tile of x
      const int64_t n0 = u * PANEL, nt = std::min<int64_t>(PANEL / 16, (N - n0) / 16);
      const uint16_t* b = panel(P, n0, nt, buf);
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

}  // namespace jp_amx
#else
#define JP_AMX 0
#endif
