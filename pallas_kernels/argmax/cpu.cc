// The index of each row's largest value, float32 x [R, V] -> int32 [R] (an XLA FFI handler): the first of
// ties, and the first NaN where a row holds one, as jnp.argmax. XLA:CPU runs jnp.argmax as a (value, index)
// reduction it does not vectorize (4.4 ms for the [64, 49152] logits of a decode step on a 2-core Xeon);
// here each row is one pass of 16-lane compares, the rows shared by the intra-op thread pool.
#include <cmath>
#include <cstdint>

#include "ffi_common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

int32_t row_argmax(const float* x, int64_t V) {
  int64_t j = 0, at = 0;
  float best = -INFINITY;
#if defined(__AVX512F__)
  if (V >= 16) {
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), lane_at = idx;
    __m512 lane_max = _mm512_loadu_ps(x);
    __mmask16 nan = _mm512_cmp_ps_mask(lane_max, lane_max, _CMP_UNORD_Q);
    for (j = 16; j + 16 <= V; j += 16) {
      idx = _mm512_add_epi32(idx, step);
      const __m512 v = _mm512_loadu_ps(x + j);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, lane_max, _CMP_GT_OQ);  // strictly: a lane keeps its first
      lane_max = _mm512_mask_mov_ps(lane_max, gt, v);
      lane_at = _mm512_mask_mov_epi32(lane_at, gt, idx);
    }
    if (nan) {
      for (int64_t k = 0; k < j; ++k)
        if (std::isnan(x[k])) return static_cast<int32_t>(k);
    }
    best = _mm512_reduce_max_ps(lane_max);
    const __mmask16 eq = _mm512_cmp_ps_mask(lane_max, _mm512_set1_ps(best), _CMP_EQ_OQ);
    at = _mm512_mask_reduce_min_epi32(eq, lane_at);  // the first index among the lanes holding the max
  }
#endif
  for (; j < V; ++j) {
    if (std::isnan(x[j])) return static_cast<int32_t>(j);
    if (x[j] > best) best = x[j], at = j;
  }
  return static_cast<int32_t>(at);
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  if (x.element_type() != ffi::DataType::F32 || !jp::has_dims(x, {-1, -1}) || x.dimensions()[1] <= 0)
    return jp::bad_operand("cpu_argmax", "x", "float32 [R, V] with V > 0", x);
  const int64_t R = x.dimensions()[0], V = x.dimensions()[1];
  if (out->element_type() != ffi::DataType::S32 || !jp::has_dims(*out, {R}))
    return jp::bad_operand("cpu_argmax", "out", "int32 [R = " + std::to_string(R) + "]", *out);
  const float* xs = x.typed_data<float>();
  int32_t* o = out->typed_data<int32_t>();
  jp::parallel_for(pool, R, R / 8, [=](int64_t r) { o[r] = row_argmax(xs + r * V, V); });  // 8 rows a thread
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedCpuArgmax, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()    // x
                                  .Ret<ffi::AnyBuffer>());  // out

// The float32 lanes of the vector loop in this build (16: AVX-512 F), 0 where only the scalar loop runs.
extern "C" int JaxpagedCpuArgmaxLanes() {
#if defined(__AVX512F__)
  return 16;
#else
  return 0;
#endif
}
