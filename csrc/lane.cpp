#include "lane.hpp"

#include <c10/util/Exception.h>

namespace ft {

namespace {
thread_local int tlsCurrentLane = 0;
} // namespace

int currentLane() {
  return tlsCurrentLane;
}

void setCurrentLane(int lane) {
  TORCH_CHECK_VALUE(lane >= 0, "ft: lane index must be >= 0, got ", lane);
  tlsCurrentLane = lane;
}

} // namespace ft
