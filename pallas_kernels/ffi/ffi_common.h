// What every CPU kernel of pallas_kernels shares: the XLA FFI API, bfloat16 widening, the operand checks
// at the FFI boundary, and the thread fan-out over the FFI's intra-op thread pool. Built into each kernel by pallas_kernels/ffi/loader.py
// (its hash is part of each kernel's build key).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jp {

// A bfloat16's bits (the high half of a float32) -> the float32.
inline float bf16_to_f32(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The operand checks of a handler: every operand's dtype and dimensions are checked before any is read,
// and a mismatch is an InvalidArgument error naming the kernel, the operand, what it must be and what it is.
inline const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S8: return "int8";
    default: return "another dtype";
  }
}

inline std::string describe(const ffi::AnyBuffer& b) {  // e.g. "float32[4, 16, 2, 64]"
  std::string s = std::string(dtype_name(b.element_type())) + "[";
  auto d = b.dimensions();
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

inline ffi::Error bad_operand(const char* kernel, const char* operand, const std::string& want,
                              const ffi::AnyBuffer& got) {
  return ffi::Error::InvalidArgument(std::string(kernel) + ": " + operand + " must be " + want + ", got " +
                                     describe(got));
}

// b has `rank` dimensions, each dims[i] unless that is negative (any size).
inline bool has_dims(const ffi::AnyBuffer& b, std::initializer_list<int64_t> dims) {
  auto d = b.dimensions();
  if (d.size() != dims.size()) return false;
  size_t i = 0;
  for (int64_t want : dims) {
    if (want >= 0 && d[i] != want) return false;
    ++i;
  }
  return true;
}

struct NoHook {
  void operator()() const {}
};

// Runs body(i) for every unit i in [0, n) on the calling thread and up to min(pool threads, max_threads,
// n) - 1 helpers of `pool`; returns when every unit is done. Units are taken in index order through an
// atomic counter, so a caller that sorts its units longest first has the threads end close together. The
// calling thread works too: the call never waits on a pool busy elsewhere, and a helper that starts late
// finds no unit left (the shared state outlives the call for it). Each participating thread calls
// enter() before its first unit and leave() after its last (per-thread setup, e.g. AMX tile config).
template <typename Body, typename Enter = NoHook, typename Leave = NoHook>
void parallel_for(ffi::ThreadPool pool, int64_t n, int64_t max_threads, Body body, Enter enter = {},
                  Leave leave = {}) {
  struct State {
    Body body;
    Enter enter;
    Leave leave;
    int64_t n;
    std::atomic<int64_t> next{0}, done{0};
    State(Body b, Enter e, Leave l, int64_t count)
        : body(std::move(b)), enter(std::move(e)), leave(std::move(l)), n(count) {}
    void work() {
      enter();
      for (int64_t i; (i = next.fetch_add(1)) < n;) {
        body(i);
        done.fetch_add(1, std::memory_order_release);
      }
      leave();
    }
  };
  if (n <= 0) return;
  auto st = std::make_shared<State>(std::move(body), std::move(enter), std::move(leave), n);
  const int64_t helpers = std::min<int64_t>({static_cast<int64_t>(pool.num_threads()), max_threads, n}) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([st] { st->work(); });
  st->work();
  while (st->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace jp
