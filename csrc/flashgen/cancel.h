// Cancelling the kernels that run now (Ctrl-C in `flashgen run`, or a host's own
// interrupt): while the flag is set, the CPU kernels' parallel_for hands out no
// further work item and the handlers fail with "interrupted" instead of
// returning partial results. It stays set until cleared; one flag per library.
#pragma once
#include <atomic>

namespace flashgen {

inline std::atomic<bool>& cancel_flag() {
  static std::atomic<bool> requested{false};
  return requested;
}

inline bool cancel_requested() { return cancel_flag().load(std::memory_order_relaxed); }

}  // namespace flashgen
