// AMX tile basics shared by the CPU kernels (cpu_matmul.cc, cpu_paged_attention.cc): whether Linux lets the
// process use the tiles, and the one tile shape both kernels use (every tile 16 rows of 64 bytes: 16 x 32
// bfloat16 operands, 16 x 16 float32 results). A thread configures its tiles before its first tile
// instruction and releases them when its work is done.
#pragma once
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__linux__)
#define JP_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace jp_amx {

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
