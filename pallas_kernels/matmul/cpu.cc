// bfloat16 matrix products on the CPU (an XLA FFI handler): out f32[M, N] = x[M, K] @ w, float32
// accumulation.
//
// w is one weight matrix as the model stores it, read in place: [K, N] (`transpose` 0) or [N, K]
// (`transpose` 1: the tied embedding as the lm_head), or the stack [L, ..] of every layer's with the
// index of the one to read (so the layer loop hands the kernel the stack, never a sliced copy). Weights
// packed ahead of time (`packed` 1: [N / 16, K / 32, 16, 32], matmul/cpu.py `pack`, done once when the
// runner places its parameters; cpu_tiles.h) are read as tiles straight from memory; otherwise each unit of
// work interleaves its columns into a small per-thread buffer. Paths, compiled where -march allows, the best
// one run unless `isa` caps it:
//   3 AMX tiles (cpu_amx.h; where Linux grants the tile state);
//   2 AVX-512 BF16: vdpbf16ps on the same tiles (cpu_vec.h);
//   1 AVX2 + FMA: the tiles widened to float32 by bit operations (cpu_vec.h);
//   0 scalar loops (any shape).
// The vector paths need K % 32 == 0 and N % 16 == 0 (what matmul/cpu.py `supported` admits); other shapes
// run the scalar loops. Units (column panels, on the vector paths in pieces of x's rows when w is packed;
// or row blocks of w when transposed) are shared by the XLA
// FFI's intra-op thread pool (ffi_common.h: jp::parallel_for); the calling thread works too. One call may
// take several matrices of one x (a layer's q, k and v; gate and up), each with its own out: their units
// are one list, so a layer's products are fewer fan-outs with more units each to share.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_amx.h"
#include "cpu_tiles.h"
#include "cpu_vec.h"
#include "ffi_common.h"

namespace {

using jp::bf16_to_f32;
using jp_mm::PANEL;
using jp_mm::Problem;
using jp_mm::weight;

constexpr int ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_BF16 = 2, ISA_AMX = 3;

// The best path this build runs here.
int best_isa() {
#if JP_AMX
  if (jp_amx::permitted()) return ISA_AMX;
#endif
  return JP_BF16 ? ISA_BF16 : JP_AVX2 ? ISA_AVX2 : ISA_SCALAR;
}

// The path a call with the cap `isa` runs for K x N: the best one of the build up to the cap; the scalar
// loops for shapes the tiles do not fit.
int path_for(int64_t isa, int64_t K, int64_t N) {
  return K % 32 == 0 && N % 16 == 0 ? std::min<int>(static_cast<int>(isa), best_isa()) : ISA_SCALAR;
}

// The scalar path: columns n0 .. n1 of every row, float32 accumulation.
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

// Unit u of the products `units` counts (each product's units in turn) -> (the product, its own unit).
struct Units {
  std::vector<int64_t> first;  // first[i]: the first unit of product i; first.back(): every unit
  std::pair<size_t, int64_t> at(int64_t u) const {
    size_t i = 0;
    while (u >= first[i + 1]) ++i;
    return {i, u - first[i]};
  }
};

// The units of one product on the AMX path: row pairs of 32 w rows (transposed), else column panels (the
// vector paths': jp_vec::units).
int64_t units_of(const Problem& P) { return P.transpose ? (P.N + 31) / 32 : (P.N + jp_mm::PANEL - 1) / jp_mm::PANEL; }

ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer layer, ffi::AnyBuffer rows,
                ffi::RemainingArgs more_w, ffi::Result<ffi::AnyBuffer> out, ffi::RemainingRets more_out,
                int64_t transpose, int64_t packed, int64_t isa) {
  // Several matrices of one x (q, k, v; gate, up) are one call: one fan-out over all their units.
  if (more_w.size() != more_out.size())
    return ffi::Error::InvalidArgument("cpu_matmul: one out per w, got " + std::to_string(more_w.size() + 1) +
                                       " w and " + std::to_string(more_out.size() + 1) + " out");
  std::vector<Problem> Ps(1 + more_w.size());
  if (ffi::Error e = check(x, w, layer, *out, transpose != 0, packed != 0, Ps[0]); e.failure()) return e;
  Ps[0].out = out->typed_data<float>();
  for (size_t i = 0; i < more_w.size(); ++i) {
    auto wi = more_w.get<ffi::AnyBuffer>(i);
    auto oi = more_out.get<ffi::AnyBuffer>(i);
    if (!wi.has_value() || !oi.has_value())
      return ffi::Error::InvalidArgument("cpu_matmul: w and out " + std::to_string(i + 1) + " must be arrays");
    if (ffi::Error e = check(x, *wi, layer, **oi, transpose != 0, packed != 0, Ps[i + 1]); e.failure()) return e;
    Ps[i + 1].out = (*oi)->typed_data<float>();
  }
  if (rows.element_type() != ffi::DataType::S32 || rows.element_count() != 1 ||
      rows.typed_data<int32_t>()[0] < 0 || rows.typed_data<int32_t>()[0] > Ps[0].M)
    return jp::bad_operand("cpu_matmul", "rows", "one int32 in [0, M = " + std::to_string(Ps[0].M) + "]", rows);
  const int64_t live = rows.typed_data<int32_t>()[0];
  // the path of the narrowest product (a shape the tiles do not fit takes the scalar loops for all)
  int path = ISA_AMX;
  for (const Problem& Q : Ps) path = std::min(path, path_for(isa, Q.K, Q.N));
  Units U{{0}};
  for (Problem& P : Ps) {
    // Rows past `rows` pad the step's token bucket: zeros, nothing of them read or computed.
    std::fill(P.out + live * P.N, P.out + P.M * P.N, 0.0f);
    P.M = live;
    U.first.push_back(U.first.back() + (P.M == 0 ? 0 : path == ISA_AMX ? units_of(P) : jp_vec::units(P)));
  }
  const int64_t units = U.first.back();
  if (units == 0) return ffi::Error::Success();
  const Problem& P = Ps[0];  // x, K and M are every product's; N each one's own
#if JP_AMX
  if (path == ISA_AMX) {
    const int64_t m_tiles = (P.M + 15) / 16, KB = P.K / 32;
    std::vector<uint16_t> xpad;  // x zero-padded [m_tiles * 16, K] (transpose 0, when M % 16)
    std::vector<uint16_t> xt;    // x^T packed: m_tiles x KB tiles (transpose 1)
    const uint16_t* xa = P.x;
    if (!P.transpose && P.M % 16) {
      xpad.assign(m_tiles * 16 * P.K, 0);
      std::memcpy(xpad.data(), P.x, sizeof(uint16_t) * P.M * P.K);
      xa = xpad.data();
    }
    if (P.transpose) {  // x^T in VNNI tiles: tile (mt, kb) row r = the pairs k = kb*32 + 2r, +1 of rows mt*16 ..
      xt.assign((m_tiles + 1) * KB * 512, 0);
      for (int64_t m = 0; m < P.M; ++m)
        for (int64_t k = 0; k < P.K; ++k)
          xt[((m / 16) * KB + k / 32) * 512 + ((k % 32) / 2) * 32 + (m % 16) * 2 + (k % 2)] = P.x[m * P.K + k];
    }
    std::vector<jp_amx::Tiled> ts;
    for (Problem Q : Ps) {
      Q.x = xa;
      ts.push_back(jp_amx::Tiled{Q, m_tiles, xt.data()});
    }
    const auto* tp = &ts;
    jp::parallel_for(pool, units, units, [tp, U](int64_t u) { auto [i, v] = U.at(u); (*tp)[i].unit(v); },
                     [] { jp_amx::configure(); }, [] { _tile_release(); });
    return ffi::Error::Success();
  }
#endif
#if JP_BF16
  if (path == ISA_BF16) {
    jp::parallel_for(pool, units, units, [&Ps, U](int64_t u) { auto [i, v] = U.at(u); jp_vec::unit<true>(Ps[i], nullptr, v); });
    return ffi::Error::Success();
  }
#endif
#if JP_AVX2
  if (path == ISA_AVX2) {
    std::vector<float> xf(P.M * P.K);  // x widened [M, K] (jp_vec::xf_index order), every product's
    jp_vec::widen_x(P, xf.data());
    const float* xp = xf.data();
    jp::parallel_for(pool, units, units, [&Ps, U, xp](int64_t u) { auto [i, v] = U.at(u); jp_vec::unit<false>(Ps[i], xp, v); });
    return ffi::Error::Success();
  }
#endif
  Units S{{0}};  // the scalar loops: every product in column panels
  for (const Problem& Q : Ps) S.first.push_back(S.first.back() + (Q.N + PANEL - 1) / PANEL);
  jp::parallel_for(pool, S.first.back(), S.first.back(), [&Ps, S](int64_t u) {
    auto [i, v] = S.at(u);
    plain(Ps[i], v * PANEL, std::min(Ps[i].N, (v + 1) * PANEL));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedCpuMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Arg<ffi::AnyBuffer>()  // layer
                                  .Arg<ffi::AnyBuffer>()  // rows: x's live rows (the rest pad a token bucket)
                                  .RemainingArgs()        // more w of the same x (and form), each its own out
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .RemainingRets()        // the out of each further w
                                  .Attr<int64_t>("transpose")
                                  .Attr<int64_t>("packed")
                                  .Attr<int64_t>("isa"));  // the most capable path to run (3: the best)

// The best path this build runs here: 3 AMX (compiled for it and granted by the kernel), 2 AVX-512 BF16,
// 1 AVX2 + FMA, 0 scalar loops.
extern "C" int JaxpagedCpuMatmulIsa() { return best_isa(); }

// The path a call capped at `isa` runs for K x N (as above).
extern "C" int JaxpagedCpuMatmulPath(int64_t isa, int64_t K, int64_t N) { return path_for(isa, K, N); }
