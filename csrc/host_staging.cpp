#include "host_staging.hpp"

#include <c10/core/DeviceGuard.h>

namespace ft {

std::vector<std::vector<int>> sharedDevices(
    const std::vector<std::string>& ids) {
  std::vector<std::vector<int>> groups;
  std::vector<bool> placed(ids.size(), false);
  for (size_t first = 0; first < ids.size(); ++first) {
    if (placed[first]) {
      continue;
    }
    std::vector<int> group{static_cast<int>(first)};
    for (size_t other = first + 1; other < ids.size(); ++other) {
      if (!placed[other] && ids[other] == ids[first]) {
        placed[other] = true;
        group.push_back(static_cast<int>(other));
      }
    }
    if (group.size() > 1) {
      groups.push_back(std::move(group));
    }
  }
  return groups;
}

at::Tensor HostStaging::stage(const at::Tensor& t) {
  if (!t.defined() || !staged(t)) {
    return t;
  }
  for (const auto& [original, copy] : copies_) {
    if (original.is_same(t)) {
      return copy;
    }
  }
  // Pinned, so the copies run at the host link's speed; the copy in is a
  // blocking one on the caller's current stream, so it reads what the work
  // queued there before the op has written.
  auto options = t.options().device(at::kCPU).pinned_memory(t.is_cuda());
  at::Tensor copy = at::empty_strided(t.sizes(), t.strides(), options);
  copy.copy_(t, /*non_blocking=*/false);
  copies_.emplace_back(t, copy);
  return copy;
}

void HostStaging::copyBack(const std::vector<at::Tensor>& outputs) const {
  for (const auto& [original, copy] : copies_) {
    bool written = false;
    for (const auto& out : outputs) {
      if (out.is_same(original)) {
        written = true;
        break;
      }
    }
    if (!written) {
      continue;
    }
    // On the original's device (the completion runs on a communicator
    // thread whose current device may be another), and blocking: the op is
    // complete only once its result is in place.
    c10::OptionalDeviceGuard guard(original.device());
    original.copy_(copy, /*non_blocking=*/false);
  }
}

} // namespace ft
