// FtWork: the Work handed to torch for every ft collective.
//
// Contract:
//  * Exactly one of succeed() / fail() takes effect; the other returns false.
//  * The finalizer passed to succeed() (the only place ft itself writes into the
//    caller's tensors after the inner op, e.g. AVG's division or copying a
//    staged result out) runs under the same lock that fail() takes, so once
//    fail() has returned the finalizer can never run: an aborted op never
//    writes into the caller's tensors from ft's side.
//  * Completion (success or failure) marks the c10 Future and wakes wait().
//    Future callbacks run on the completing thread, outside the commit lock.
//  * Any thread may call any method.
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
  const std::string description_;
  std::vector<at::Tensor> outputs_;
  const Clock::time_point deadline_;
  const std::chrono::milliseconds timeout_;
  const int lane_;
  const uint64_t generation_;
  std::mutex commitMutex_;
  std::atomic<bool> done_{false};
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace ft
