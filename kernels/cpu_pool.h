// Work split over XLA:CPU's intra-op thread pool, shared by the CPU kernels
// (int8_matmul.cc, cache_attention.cc), so that they start no threads of
// their own beside XLA's.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace mdlm_jax {

// Runs fn(c) for c in [0, chunks) on the calling thread and XLA's pool, each
// taking the next chunk until none is left; returns when all are done. A
// task the pool starts late finds no chunk and touches nothing else.
template <typename F>
void ForEachChunk(xla::ffi::ThreadPool& pool, int64_t chunks, F fn) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  // Helpers hold `state` alive; `fn` is read only while a chunk is left, and
  // the caller waits for every chunk, so it outlives those reads.
  auto work = [state, chunks, fnp = &fn]() {
    for (int64_t c; (c = state->next.fetch_add(1)) < chunks;) {
      (*fnp)(c);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(work)(work));
  work();
  while (state->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

}  // namespace mdlm_jax
