#include "generation.hpp"

#include <c10/util/Exception.h>

#include <algorithm>

namespace ft {

Generation::Generation(
    uint64_t id,
    int rank,
    int size,
    int numLanes,
    Transports transports)
    : id(id),
      rank(rank),
      size(size),
      numLanes_(numLanes),
      transports_(std::move(transports)) {}

void Generation::checkLane(int index) const {
  TORCH_CHECK_VALUE(
      index >= 0 && index < numLanes(),
      "ft: lane ",
      index,
      " does not exist; this process group has ",
      numLanes(),
      " lanes (0..",
      numLanes() - 1,
      "). Pass num_lanes when creating it.");
}

Generation::Lease Generation::lease() {
  std::lock_guard<std::mutex> lock(mutex_);
  ++leases_;
  return Lease(*this, transports_);
}

Generation::Lease::~Lease() {
  // Dropped before the count: releaseTransports() then holds the last
  // reference, and the transport is destroyed on its thread.
  transports_.clear();
  std::lock_guard<std::mutex> lock(generation_.mutex_);
  if (--generation_.leases_ == 0) {
    generation_.leasesEnded_.notify_all();
  }
}

Transport* Generation::Lease::serving(const c10::Device& device) const {
  for (const auto& transport : transports_) {
    if (transport->serves(device)) {
      return transport.get();
    }
  }
  return nullptr;
}

size_t Generation::socketCount() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t count = 0;
  for (const auto& transport : transports_) {
    count += transport->socketCount();
  }
  return count;
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

bool Generation::abort(
    FailureKind kind,
    const std::string& message,
    bool deferIdleDeviceAbort) {
  std::vector<c10::intrusive_ptr<FtWork>> victims;
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
  }
  // Empty if the Reaper already released them, which severed and aborted
  // them first.
  auto transports = lease();
  // Cut the wires first: a stuck inner op then fails promptly, and no more
  // bytes can arrive for a receive that was posted into a caller's tensor.
  for (const auto& transport : transports.all()) {
    transport->sever();
  }
  for (auto& work : victims) {
    work->fail(failureErrorFor(*work, message));
  }
  // Then stop the device side: ncclCommAbort ends the lanes' kernels (also a
  // communicator still initializing), so no more data lands in the caller's
  // tensors once abort() returns; where none can (idle transports, and the
  // caller allows it) that waits for the Reaper. Works failed first, so
  // waiters are released even if an abort is slow.
  bool idle = deferIdleDeviceAbort;
  if (idle) {
    for (const auto& transport : transports.all()) {
      idle = transport->closeIfIdle() && idle; // closes every one
    }
  }
  if (!idle) {
    for (const auto& transport : transports.all()) {
      transport->abort();
    }
  }
  return true;
}

std::exception_ptr Generation::failureErrorFor(
    const FtWork& work,
    const std::string& message) const {
  try {
    C10_THROW_ERROR(
        DistBackendError,
        "ft: " + work.description() + " on lane " +
            std::to_string(work.lane()) + " of generation " +
            std::to_string(id) + " failed: " + message);
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

void Generation::releaseTransports() {
  Transports transports;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    transports.swap(transports_);
  }
  // A deferred abort happens here (idempotent where abort() already did it).
  for (const auto& transport : transports) {
    transport->sever();
    transport->abort();
  }
  {
    std::unique_lock<std::mutex> lock(mutex_);
    leasesEnded_.wait(lock, [&] { return leases_ == 0; });
  }
  // Destroying the transports joins their communicators' threads.
  transports.clear();
}

Reaper::Reaper(std::chrono::milliseconds drainTimeout, size_t workers)
    : drainTimeout_(drainTimeout) {
  try {
    for (size_t i = 0; i < std::max<size_t>(workers, 1); ++i) {
      workers_.emplace_back([this] { run(); });
    }
  } catch (...) {
    stopAndJoin(); // no joinable thread may outlive a failed constructor
    throw;
  }
}

Reaper::~Reaper() {
  stopAndJoin();
}

void Reaper::stopAndJoin() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& worker : workers_) {
    if (worker.joinable()) {
      worker.join();
    }
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
  return idle_.wait_until(lock, deadline, [&] {
    return queue_.empty() && busy_ == 0;
  });
}

size_t Reaper::pending() {
  std::lock_guard<std::mutex> lock(mutex_);
  return queue_.size() + busy_;
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
    ++busy_;
    const auto drainTimeout = drainTimeout_;
    lock.unlock();
    // The generation was aborted and its sockets severed, so inner ops fail
    // quickly; the bound only matters if Gloo ignores the severed sockets.
    generation->waitInnerDrained(Clock::now() + drainTimeout);
    generation->releaseTransports();
    generation.reset();
    lock.lock();
    --busy_;
    idle_.notify_all();
  }
}

} // namespace ft
