#include "generation.hpp"

#include <c10/util/Exception.h>

#ifdef FT_USE_NCCL
#include "nccl_comm.hpp"
#endif

namespace ft {

Generation::Generation(
    uint64_t id,
    int rank,
    int size,
    std::vector<Lane> lanes,
    OwnedSockets sockets)
    : id(id),
      rank(rank),
      size(size),
      lanes_(std::move(lanes)),
      sockets_(std::move(sockets)) {}

Lane& Generation::lane(int index) {
  TORCH_CHECK_VALUE(
      index >= 0 && index < numLanes(),
      "ft: lane ",
      index,
      " does not exist; this process group has ",
      numLanes(),
      " lanes (0..",
      numLanes() - 1,
      "). Pass num_lanes when creating it.");
  return lanes_[index];
}

bool Generation::track(const c10::intrusive_ptr<FtWork>& work) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_) {
    return false;
  }
  inflight_.emplace(work.get(), work);
  return true;
}

void Generation::innerDone(FtWork* work) {
  c10::intrusive_ptr<FtWork> released;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = inflight_.find(work);
    if (it == inflight_.end()) {
      return;
    }
    released = std::move(it->second);
    inflight_.erase(it);
    if (inflight_.empty()) {
      drained_.notify_all();
    }
  }
  releaseLater(std::move(released));
}

namespace {

// Closes the lanes to new ops; true if no kernel of theirs can still touch a
// caller's tensor.
bool closeIfIdle(const std::vector<c10::intrusive_ptr<c10d::Backend>>& comms) {
  bool idle = true;
#ifdef FT_USE_NCCL
  for (const auto& comm : comms) {
    try {
      idle = static_cast<NcclLane*>(comm.get())->closeIfIdle() && idle;
    } catch (const std::exception&) {
      idle = false; // unsure: abort in place
    }
  }
#endif
  return idle; // a CPU-only build has no device lanes
}

// The lanes' NCCL communicators (none in a CPU-only build).
std::vector<c10::intrusive_ptr<c10d::Backend>> deviceCommsOf(const std::vector<Lane>& lanes) {
  std::vector<c10::intrusive_ptr<c10d::Backend>> comms;
  for (const auto& lane : lanes) {
    if (lane.nccl) {
      comms.push_back(lane.nccl);
    }
  }
  return comms;
}

} // namespace

void abortAll(const std::vector<c10::intrusive_ptr<c10d::Backend>>& comms) noexcept {
  auto abortOne = [](const c10::intrusive_ptr<c10d::Backend>& comm) noexcept {
    try {
      comm->abort();
    } catch (const std::exception& e) {
      // Best effort, like every abort: the communicator is unusable either way.
      TORCH_WARN("ft: aborting a device communicator failed: ", e.what());
    }
  };
  std::vector<std::thread> helpers;
  for (size_t i = 1; i < comms.size(); ++i) {
    try {
      helpers.emplace_back([&abortOne, comm = comms[i]] { abortOne(comm); });
    } catch (...) {
      abortOne(comms[i]); // no thread to spare: abort it here
    }
  }
  if (!comms.empty()) {
    abortOne(comms.front());
  }
  for (auto& helper : helpers) {
    helper.join();
  }
}

bool Generation::abort(FailureKind kind, const std::string& message,
                       bool deferIdleDeviceAbort) {
  std::vector<c10::intrusive_ptr<FtWork>> victims;
  std::vector<c10::intrusive_ptr<c10d::Backend>> deviceComms;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_) {
      return false;
    }
    failure_ = Failure{kind, message};
    victims.reserve(inflight_.size());
    for (auto& entry : inflight_) {
      victims.push_back(entry.second);
    }
    deviceComms = deviceCommsOf(lanes_);
  }
  // Cut the wires first: a stuck inner op then fails promptly, and no more
  // bytes can arrive for a receive that was posted into a caller's tensor.
  sockets_.sever();
  for (auto& work : victims) {
    work->fail(failureErrorFor(*work, message));
  }
  // Then stop the device side: ncclCommAbort ends the lanes' kernels (also a
  // communicator still initializing), so no more data lands in the caller's
  // tensors once abort() returns; where none can (idle lanes, and the caller
  // allows it) that waits for the Reaper. Works failed first, so waiters are
  // released even if an abort is slow.
  if (!(deferIdleDeviceAbort && closeIfIdle(deviceComms))) {
    abortAll(deviceComms);
  }
  return true;
}

std::exception_ptr Generation::failureErrorFor(
    const FtWork& work,
    const std::string& message) const {
  try {
    C10_THROW_ERROR(
        DistBackendError,
        "ft: " + work.description() + " on lane " + std::to_string(work.lane()) +
            " of generation " + std::to_string(id) + " failed: " + message);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

std::optional<Failure> Generation::failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

std::optional<Clock::time_point> Generation::enforceDeadlines(
    Clock::time_point now) {
  std::optional<Clock::time_point> next;
  const FtWork* expired = nullptr;
  std::string expiredMessage;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_) {
      return std::nullopt;
    }
    for (const auto& entry : inflight_) {
      const FtWork* work = entry.first;
      if (work->done()) {
        continue;
      }
      if (work->deadline() <= now) {
        expired = work;
        expiredMessage = work->description() + " on lane " +
            std::to_string(work->lane()) + " missed its deadline of " +
            std::to_string(work->timeout().count()) +
            " ms; the generation was aborted";
        break;
      }
      if (!next || work->deadline() < *next) {
        next = work->deadline();
      }
    }
  }
  if (expired != nullptr) {
    abort(FailureKind::kDeadline, expiredMessage);
    return std::nullopt;
  }
  return next;
}

bool Generation::waitInnerDrained(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  return drained_.wait_until(lock, deadline, [&] { return inflight_.empty(); });
}

void Generation::releaseLanes() {
  std::vector<Lane> lanes;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    lanes.swap(lanes_);
  }
  // A deferred device abort happens here (idempotent where it already did).
  abortAll(deviceCommsOf(lanes));
  // Destroying the inner communicators joins their threads.
  lanes.clear();
}

Reaper::Reaper(std::chrono::milliseconds drainTimeout)
    : drainTimeout_(drainTimeout), thread_([this] { run(); }) {}

Reaper::~Reaper() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) {
    thread_.join();
  }
}

void Reaper::reap(std::shared_ptr<Generation> generation) {
  if (!generation) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(generation));
  }
  cv_.notify_all();
}

void Reaper::setDrainTimeout(std::chrono::milliseconds drainTimeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  drainTimeout_ = drainTimeout;
}

bool Reaper::waitIdle(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  return idle_.wait_until(lock, deadline, [&] { return queue_.empty() && !busy_; });
}

size_t Reaper::pending() {
  std::lock_guard<std::mutex> lock(mutex_);
  return queue_.size() + (busy_ ? 1 : 0);
}

void Reaper::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) {
      return; // stop requested and nothing left to tear down
    }
    auto generation = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    const auto drainTimeout = drainTimeout_;
    lock.unlock();
    // The generation was aborted and its sockets severed, so inner ops fail
    // quickly; the bound only matters if Gloo ignores the severed sockets.
    generation->waitInnerDrained(Clock::now() + drainTimeout);
    generation->releaseLanes();
    generation.reset();
    lock.lock();
    busy_ = false;
    idle_.notify_all();
  }
}

} // namespace ft
