// Which Engram publication is current, per device (docs/design.md §2): a
// publish into a window area makes every earlier publication that overlaps
// it stale, so does any other op whose window area reaches it (Invalidate),
// and a fetch must say which publication it reads. The host keeps
// the versions because it launches publishes and fetches in stream order;
// the publish kernel writes its version into the token and the fetch
// kernel compares the token it was given with the version current at its
// launch (a mismatch: zeros and Cause::kStalePublication).
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <utility>

namespace jax_ep {

class EngramVersions {
 public:
  // Records a publish of [off, off + bytes) and returns its version (>= 1).
  int32_t Publish(size_t off, size_t bytes) {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = areas_.begin(); it != areas_.end();) {
      const size_t a = it->first, b = it->first + it->second.first;
      it = (a < off + bytes && off < b) ? areas_.erase(it) : std::next(it);
    }
    last_ = last_ >= INT32_MAX - 1 ? 1 : last_ + 1;
    areas_[off] = {bytes, last_};
    return last_;
  }

  // Another op is about to write window bytes [begin, end): publications
  // there are stale from now on (a later fetch of them reports it instead of
  // reading overwritten rows).
  void Invalidate(size_t begin, size_t end) {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = areas_.begin(); it != areas_.end();) {
      const size_t a = it->first, b = it->first + it->second.first;
      it = (a < end && begin < b) ? areas_.erase(it) : std::next(it);
    }
  }

  // The version of the live publication starting at `off` with `bytes`
  // bytes, or 0 (none: never published there, or overwritten since).
  int32_t Current(size_t off, size_t bytes) const {
    std::lock_guard<std::mutex> g(mu_);
    auto it = areas_.find(off);
    return (it != areas_.end() && it->second.first == bytes) ? it->second.second : 0;
  }

 private:
  mutable std::mutex mu_;
  std::map<size_t, std::pair<size_t, int32_t>> areas_;  // off -> (bytes, version)
  int32_t last_ = 0;
};

}  // namespace jax_ep
