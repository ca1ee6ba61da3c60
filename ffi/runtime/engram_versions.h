// Which Engram publication is current, per device (docs/design.md §2): a
// publish into a window area makes every earlier publication that overlaps
// it stale, so does any other op whose window area reaches it, and a fetch
// must say which publication it reads.
//
// The versions live on the device, not here: XLA may capture publish and
// fetch into a command buffer (a CUDA graph) and replay it without running
// the handlers, so anything the host decided per call would be frozen at
// capture. The host only gives every table placement [off, off + bytes) a
// fixed slot (kernels/engram.cuh, EngramVersionWords) and tells each
// launch which slots it touches; those do not change between calls. The
// publish kernel draws a new version from the device's counter, stores it
// in its slot and in the token; the fetch kernel compares its token with
// the slot (a mismatch: zeros and Cause::kStalePublication); an op that
// overwrites a table's bytes clears its slot on the device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "kernels/engram.cuh"

namespace jax_ep {

class EngramVersions {
 public:
  // The slot of area [off, off + bytes) for a publish into it, or -1 when
  // kEngramSlots distinct placements are taken. `clear` gets every known
  // area overlapping it, its own included (no live publication there while
  // the copy runs).
  int Publish(size_t off, size_t bytes, EngramSlotMask* clear) {
    std::lock_guard<std::mutex> g(mu_);
    const int slot = SlotLocked(off, bytes);
    *clear = OverlappingLocked(off, off + bytes);
    return slot;
  }

  // The slot a fetch of area [off, off + bytes) checks its token against,
  // or -1 (placements exhausted). Assigned here too if no publish has been
  // seen yet: its word then reads 0 (stale) until one has run, also when a
  // command buffer captured the fetch before any publish.
  int Slot(size_t off, size_t bytes) {
    std::lock_guard<std::mutex> g(mu_);
    return SlotLocked(off, bytes);
  }

  // The slots of the areas that overlap window bytes [begin, end): another
  // op is about to write there, so their publications must be cleared.
  EngramSlotMask Overlapping(size_t begin, size_t end) const {
    std::lock_guard<std::mutex> g(mu_);
    return OverlappingLocked(begin, end);
  }

 private:
  // Assigned at the area's first publish or fetch and kept for the
  // communicator's life.
  int SlotLocked(size_t off, size_t bytes) {
    auto it = slots_.find({off, bytes});
    if (it != slots_.end()) return it->second;
    if (next_ >= kEngramSlots) return -1;
    slots_[{off, bytes}] = next_;
    return next_++;
  }

  EngramSlotMask OverlappingLocked(size_t begin, size_t end) const {
    EngramSlotMask m;
    for (const auto& [area, slot] : slots_) {
      if (area.first < end && begin < area.first + area.second) m.Set(slot);
    }
    return m;
  }

  mutable std::mutex mu_;
  std::map<std::pair<size_t, size_t>, int> slots_;  // (off, bytes) -> slot
  int next_ = 0;
};

}  // namespace jax_ep
