// Cache lines a decode-attention tile requests a few at a time while it computes (the next
// tile's K / V rows and, for the quantized cache, their scales), instead of all at once.
//
// NOTE: a tile's worth of prefetches issued in one burst mostly waits behind the core's few
// outstanding misses (see tile_avx512 in paged_attention.cpp and attend in kvq_item.h for what
// spreading them measured).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "stream_prefetch.h"

namespace fitserve {

class LineQueue {
 public:
  // Forget what was queued (whether or not it was requested).
  void clear() {
    runs_.clear();
    total_ = next_ = run_ = line_ = 0;
  }

  // Queue the lines covering [start, start + bytes) as one run (a KV block's rows, a scale row).
  void add(const void* start, int64_t bytes) {
    if (bytes <= 0) return;
    const uintptr_t a = reinterpret_cast<uintptr_t>(start);
    const uintptr_t first = a & ~uintptr_t{63};
    const int64_t lines = static_cast<int64_t>((a + bytes - first + 63) / 64);
    runs_.push_back({reinterpret_cast<const char*>(first), lines});
    total_ += lines;
  }

  int64_t left() const { return total_ - next_; }

  // Request up to `count` more of the queued lines, in queue order.
  void issue(int64_t count) {
    int64_t todo = std::min(left(), count);
    if (todo <= 0) return;
    next_ += todo;
    while (todo > 0) {
      const Run& r = runs_[run_];
      const int64_t take = std::min(todo, r.lines - line_);
      const char* p = r.first + 64 * line_;
      for (int64_t i = 0; i < take; ++i) prefetch_stream(p + 64 * i);
      todo -= take;
      if ((line_ += take) == r.lines) {
        ++run_;
        line_ = 0;
      }
    }
  }

  // The share of what is left to request at each of `steps` even steps (rounded up).
  int64_t share(int64_t steps) const { return steps > 0 ? (left() + steps - 1) / steps : left(); }

 private:
  struct Run {
    const char* first;  // 64-byte aligned
    int64_t lines;
  };
  std::vector<Run> runs_;
  int64_t total_ = 0, next_ = 0, run_ = 0, line_ = 0;
};

}  // namespace fitserve
