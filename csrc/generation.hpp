// Generation: one configuration of the ft backend (store prefix, rank, world
// size) with its lanes and the ops in flight on them.
//
// Contract:
//  * abort() is idempotent and callable from any thread. The first call
//    records the sticky error, severs the generation's sockets, and fails
//    every in-flight FtWork before returning. Later ops on this generation
//    are refused.
//  * track() refuses new work once aborted, so no op can slip in after abort.
//  * Lanes (the inner communicators) are released only by releaseLanes(),
//    which the Reaper calls on its own thread once inner ops have drained:
//    a Gloo communicator must never be destroyed on one of its own threads.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "gloo_comm.hpp"
#include "lane.hpp"
#include "work.hpp"

namespace ft {

enum class FailureKind : int {
  kNone = 0,
  kAborted = 1, // abort() by the user, or a reconfigure
  kDeadline = 2, // an op missed its deadline
  kCommunication = 3, // the inner communicator reported an error
  kShutdown = 4,
};

struct Failure {
  FailureKind kind = FailureKind::kNone;
  std::string message;
};

class Generation {
 public:
  Generation(
      uint64_t id,
      int rank,
      int size,
      std::vector<Lane> lanes,
      OwnedSockets sockets);

  const uint64_t id;
  const int rank;
  const int size;

  int numLanes() const {
    return static_cast<int>(lanes_.size());
  }
  // Throws a clear error for an out-of-range lane.
  Lane& lane(int index);

  // Registers an op issued on an inner communicator. Returns false if the
  // generation is already aborted (the caller must not issue the op).
  bool track(const c10::intrusive_ptr<FtWork>& work);
  // Called once the inner op has finished (successfully or not).
  void innerDone(FtWork* work);

  // With `deferIdleDeviceAbort` and no kernel running, the NCCL communicators
  // are aborted later by releaseLanes() (the Reaper) instead of before
  // returning: nothing runs on the device then, so nothing can still land in
  // a caller's tensor, and ncclCommAbort is slow (about 750 ms each on an H200
  // with NCCL 2.28), which a reconfigure should not wait for.
  bool abort(FailureKind kind, const std::string& message,
             bool deferIdleDeviceAbort = false);
  std::optional<Failure> failure() const;
  // The error an in-flight `work` fails with once the generation failed: it names the
  // cause (a missed deadline, an abort, ...), not the transport error that cutting the
  // wires then produces in the inner op.
  std::exception_ptr failureErrorFor(const FtWork& work, const std::string& message) const;

  // Aborts the generation if an in-flight op is past its deadline. Returns the
  // earliest remaining deadline.
  std::optional<Clock::time_point> enforceDeadlines(Clock::time_point now);

  // Blocks until no inner op is pending or `deadline` passes.
  bool waitInnerDrained(Clock::time_point deadline);
  void releaseLanes();
  size_t socketCount() const {
    return sockets_.size();
  }

 private:
  std::vector<Lane> lanes_;
  OwnedSockets sockets_;

  mutable std::mutex mutex_;
  std::condition_variable drained_;
  // Every op whose inner op has not finished yet; the deadline applies to
  // those whose FtWork is not yet done.
  std::unordered_map<FtWork*, c10::intrusive_ptr<FtWork>> inflight_;
  std::optional<Failure> failure_;
};

// Aborts device communicators concurrently (one thread each beyond the
// first): each ncclCommAbort waits on its own proxy threads.
void abortAll(const std::vector<c10::intrusive_ptr<c10d::Backend>>& comms) noexcept;

// Tears down old generations off the caller's path.
class Reaper {
 public:
  explicit Reaper(std::chrono::milliseconds drainTimeout);
  ~Reaper();
  void reap(std::shared_ptr<Generation> generation);
  void setDrainTimeout(std::chrono::milliseconds drainTimeout);
  // Blocks until every queued generation is torn down, or `deadline`.
  bool waitIdle(Clock::time_point deadline);
  size_t pending();

 private:
  void run();
  std::mutex mutex_;
  std::condition_variable cv_;
  std::condition_variable idle_;
  std::deque<std::shared_ptr<Generation>> queue_;
  std::chrono::milliseconds drainTimeout_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread thread_;
};

} // namespace ft
