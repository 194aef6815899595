// FtWork: the Work handed to torch for every ft collective (docs/design.md,
// "Abort").
//
// Contract:
//  * Exactly one of succeed() / fail() takes effect; the other returns false.
//  * The finalizer passed to succeed() (the only place ft itself writes into
//  the
//    caller's tensors after the inner op, e.g. AVG's division or copying a
//    staged result out) runs under the same lock that fail() takes, so once
//    fail() has returned the finalizer can never run: an aborted op never
//    writes into the caller's tensors from ft's side.
//  * Completion (success or failure) marks the c10 Future and wakes wait().
//    Future callbacks run on the completing thread, outside the commit lock.
//  * Any thread may call any method.
//  * CUDA ops (outputs on a CUDA device): wait() does not block the CPU; it
//    raises if the op already failed, else hands over to the inner NCCL
//    Work's wait(), which makes the caller's current stream wait on the op's
//    completion event. synchronize() blocks the CPU until the op completed,
//    then orders the current stream after it. The future is CUDA-aware: it
//    is completed on the lane's stream once the op's event has fired.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace ft {

using Clock = std::chrono::steady_clock;

class FtWork : public c10d::Work {
 public:
  FtWork(
      int rank,
      c10d::OpType opType,
      std::string description,
      std::vector<at::Tensor> outputs,
      Clock::time_point deadline,
      std::chrono::milliseconds timeout,
      int lane,
      uint64_t generation);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // Runs `finalize` and completes successfully, unless the work already
  // failed. Returns whether it took effect.
  bool succeed(const std::function<void()>& finalize);
  // Fails the work with `error` unless it already completed.
  bool fail(std::exception_ptr error);

  // Keeps the inner op's Work (and with it every tensor the inner op holds)
  // alive for as long as this FtWork lives; see releaseLater().
  void holdInner(c10::intrusive_ptr<c10d::Work> inner) {
    inner_ = std::move(inner);
  }

  bool done() const {
    return done_.load(std::memory_order_acquire);
  }
  Clock::time_point deadline() const {
    return deadline_;
  }
  std::chrono::milliseconds timeout() const {
    return timeout_;
  }
  const std::string& description() const {
    return description_;
  }
  int lane() const {
    return lane_;
  }
  uint64_t generation() const {
    return generation_;
  }

 private:
  // Blocks the CPU until the op completed; rethrows its error.
  bool waitCompleted(std::chrono::milliseconds timeout);

  const std::string description_;
  std::vector<at::Tensor> outputs_;
  const Clock::time_point deadline_;
  const std::chrono::milliseconds timeout_;
  const int lane_;
  const uint64_t generation_;
  const bool deviceOp_;
  c10::intrusive_ptr<c10d::Work> inner_;
  std::mutex commitMutex_;
  std::atomic<bool> done_{false};
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// Drops a reference on a dedicated thread.
//
// Dropping a tensor reference can need the GIL (torch decrefs the tensor's
// PyObject when the C++ refcount falls to one). Inner communicator threads
// must never block on the GIL: a Python thread holding it may be waiting for
// them (Gloo's enqueue lock, say), which deadlocks. So the last references an
// op holds are released here, where nobody waits.
// Any Work: the NCCL lane's poller hands its references to inner Works here
// too. One FIFO thread, so a reference pushed after another is dropped after.
void releaseLater(c10::intrusive_ptr<c10d::Work> work);
// Releases everything queued now, on the calling thread (which must hold the
// GIL); with `finalizing`, later references are leaked instead (at exit).
void drainReleaser(bool finalizing);
// Stops the releaser thread after its current batch (at exit, without the GIL).
void quiesceReleaser();

} // namespace ft
