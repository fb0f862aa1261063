// The one place the CPU kernels get threads from. A kernel splits its work into tasks that write
// disjoint outputs and computes each task in a fixed order, so its results never depend on how many
// threads ran or which thread took which task; parallel_for only hands the tasks out.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>

#include "dfss/attention.hpp"

namespace dfss::cpu {

/// How tasks are handed out. contiguous: each worker takes one contiguous range of tasks (a kernel
/// whose neighbouring tasks share packed data, e.g. the heads of one kv head, packs it once per
/// worker). dynamic: one task at a time in increasing order (tasks of unequal cost, e.g. causal rows).
enum class schedule { contiguous, dynamic };

/// @brief Worker threads for a call: @p requested, or all hardware threads when 0, capped at
/// kMaxThreads (validation already refuses more) and at the task count (at least 1).
inline int worker_count(int requested, std::int64_t tasks) noexcept {
  const int want = requested > 0 ? requested : omp_get_max_threads();
  const std::int64_t capped = std::min<std::int64_t>({static_cast<std::int64_t>(want), kMaxThreads, tasks});
  return static_cast<int>(std::max<std::int64_t>(capped, 1));
}

/// @brief Scratch that belongs to the calling thread and outlives the call: OpenMP keeps its
/// threads, so repeated calls reuse the pages instead of faulting in fresh ones. One per State type.
template <typename State>
State& worker_scratch() {
  static thread_local State state;
  return state;
}

/// @brief Runs body(task) for every task in [0, tasks) on worker_count(requested, tasks) threads.
/// Each worker first calls prepare() (size its scratch; it may throw, e.g. std::bad_alloc), then
/// its tasks. An exception from prepare or body stops the worker's remaining tasks and is rethrown
/// on the calling thread after all workers finished (the first one caught wins), so no exception
/// ever leaves the parallel region.
template <typename Prepare, typename Body>
void parallel_for(std::int64_t tasks, int requested, schedule sched, Prepare&& prepare, Body&& body) {
  if (tasks <= 0) return;
  std::exception_ptr failure;
  std::mutex failure_lock;
  std::atomic<bool> failed{false};
  const auto record = [&] {
    std::lock_guard<std::mutex> lock(failure_lock);
    if (!failure) failure = std::current_exception();
    failed = true;
  };
#pragma omp parallel num_threads(worker_count(requested, tasks))
  {
    bool ready = true;
    try {
      prepare();
    } catch (...) {
      ready = false;
      record();
    }
    const auto run_task = [&](std::int64_t t) {
      if (!ready || failed) return;
      try {
        body(t);
      } catch (...) {
        record();
      }
    };
    if (sched == schedule::dynamic) {
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t t = 0; t < tasks; ++t) run_task(t);
    } else {
#pragma omp for schedule(static)
      for (std::int64_t t = 0; t < tasks; ++t) run_task(t);
    }
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace dfss::cpu
