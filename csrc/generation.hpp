// Generation: one configuration of the ft backend (store prefix, rank, world
// size) with its transports (each with one communicator per lane) and the
// ops in flight on them.
// (docs/design.md, "Generations", "Abort", "The Reaper")
//
// Contract:
//  * abort() is idempotent and callable from any thread. The first call
//    records the sticky error, severs the transports, and fails every
//    in-flight FtWork before returning, then aborts the transports (see
//    transport.hpp). Later ops on this generation are refused.
//  * track() refuses new work once aborted, so no op can slip in after abort.
//  * The transports are used through a Lease and released only by
//    releaseTransports(), which the Reaper calls on its own thread once inner
//    ops have drained: it waits for every lease to end, so a transport is
//    never destroyed on another thread (nor on one of its communicator's own).
//  * Knows no transport by name: which ones exist is makeTransports()'s
//    choice.
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

#include "transport.hpp"
#include "work.hpp"

namespace ft {

enum class FailureKind : int {
  kNone = 0,
  kAborted = 1,       // abort() by the user, or a reconfigure
  kDeadline = 2,      // an op missed its deadline
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
      int numLanes,
      Transports transports);

  const uint64_t id;
  const int rank;
  const int size;

  int numLanes() const {
    return numLanes_;
  }
  // Throws a clear error for an out-of-range lane.
  void checkLane(int index) const;

  // The transports, kept alive while the lease lives (empty once released).
  class Lease {
   public:
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease();
    const Transports& all() const {
      return transports_;
    }
    // The transport serving `device`, or null.
    Transport* serving(const c10::Device& device) const;

   private:
    friend class Generation;
    Lease(Generation& generation, Transports transports)
        : generation_(generation), transports_(std::move(transports)) {}
    Generation& generation_;
    Transports transports_;
  };
  Lease lease();

  // Registers an op issued on an inner communicator. Returns false if the
  // generation is already aborted (the caller must not issue the op).
  bool track(const c10::intrusive_ptr<FtWork>& work);
  // Called once the inner op has finished (successfully or not).
  void innerDone(FtWork* work);

  // With `deferIdleDeviceAbort` and every transport idle (closeIfIdle), the
  // transports are aborted later by releaseTransports() (the Reaper) instead
  // of before returning: nothing runs on the device then, so nothing can
  // still land in a caller's tensor, and ncclCommAbort is slow (about 750 ms
  // each on an H200 with NCCL 2.28), which a reconfigure should not wait for.
  bool abort(
      FailureKind kind,
      const std::string& message,
      bool deferIdleDeviceAbort = false);
  std::optional<Failure> failure() const;
  // The error an in-flight `work` fails with once the generation failed: it
  // names the cause (a missed deadline, an abort, ...), not the transport error
  // that cutting the wires then produces in the inner op.
  std::exception_ptr failureErrorFor(
      const FtWork& work,
      const std::string& message) const;

  // Aborts the generation if an in-flight op is past its deadline. Returns the
  // earliest remaining deadline.
  std::optional<Clock::time_point> enforceDeadlines(Clock::time_point now);

  // Blocks until no inner op is pending or `deadline` passes.
  bool waitInnerDrained(Clock::time_point deadline);
  // Severs and aborts the transports (idempotent where abort() did), waits
  // for every lease to end, and destroys them on the calling thread.
  void releaseTransports();
  size_t socketCount() const;

 private:
  const int numLanes_;

  mutable std::mutex mutex_;
  Transports transports_;
  int leases_ = 0;
  std::condition_variable leasesEnded_;
  std::condition_variable drained_;
  // Every op whose inner op has not finished yet; the deadline applies to
  // those whose FtWork is not yet done.
  std::unordered_map<FtWork*, c10::intrusive_ptr<FtWork>> inflight_;
  std::optional<Failure> failure_;
};

// Tears down old generations off the caller's path.
//
// Contract:
//  * reap() queues an aborted generation. Up to `workers` of them are torn
//    down at once, each on one of the Reaper's threads: a generation's
//    deferred device abort takes about 0.6 s (ncclCommAbort) and must not
//    wait for another's, nor for another's drain.
//  * The constructor starts every worker thread; the destructor tears down
//    what is still queued, then joins them all.
//  * pending() counts generations queued or being torn down; waitIdle()
//    waits (bounded) until there are none.
class Reaper {
 public:
  Reaper(std::chrono::milliseconds drainTimeout, size_t workers);
  ~Reaper();
  void reap(std::shared_ptr<Generation> generation);
  void setDrainTimeout(std::chrono::milliseconds drainTimeout);
  // Blocks until every queued generation is torn down, or `deadline`.
  bool waitIdle(Clock::time_point deadline);
  size_t pending();

 private:
  void run();
  void stopAndJoin();
  std::mutex mutex_;
  std::condition_variable cv_;
  std::condition_variable idle_;
  std::deque<std::shared_ptr<Generation>> queue_;
  std::chrono::milliseconds drainTimeout_;
  size_t busy_ = 0; // generations being torn down
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

} // namespace ft
