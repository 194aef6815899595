#include "work.hpp"

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <condition_variable>
#include <deque>
#include <thread>

namespace ft {

namespace {
std::vector<c10::Device> devicesOf(const std::vector<at::Tensor>& tensors) {
  std::vector<c10::Device> devices;
  for (const auto& t : tensors) {
    if (!t.device().is_cpu() &&
        std::find(devices.begin(), devices.end(), t.device()) ==
            devices.end()) {
      devices.push_back(t.device());
    }
  }
  return devices;
}
} // namespace

FtWork::FtWork(
    int rank,
    c10d::OpType opType,
    std::string description,
    std::vector<at::Tensor> outputs,
    Clock::time_point deadline,
    std::chrono::milliseconds timeout,
    int lane,
    uint64_t generation)
    : c10d::Work(rank, opType),
      description_(std::move(description)),
      outputs_(std::move(outputs)),
      deadline_(deadline),
      timeout_(timeout),
      lane_(lane),
      generation_(generation),
      deviceOp_(!devicesOf(outputs_).empty()),
      future_(
          c10::make_intrusive<c10::ivalue::Future>(
              c10::ListType::create(c10::TensorType::get()),
              devicesOf(outputs_))) {}

bool FtWork::isCompleted() {
  return done();
}

bool FtWork::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ && !exception_;
}

std::exception_ptr FtWork::exception() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return exception_;
}

std::vector<at::Tensor> FtWork::result() {
  return outputs_;
}

bool FtWork::wait(std::chrono::milliseconds timeout) {
  if (deviceOp_ && inner_) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (completed_ && exception_) {
        std::rethrow_exception(exception_);
      }
    }
    // Stream-ordered: the caller's current stream waits, the CPU does not.
    return inner_->wait(timeout);
  }
  return waitCompleted(timeout);
}

bool FtWork::waitCompleted(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  // Every op has a deadline enforced by the backend's watchdog, so an
  // unbounded wait here still ends by the op's deadline.
  if (timeout == kNoTimeout) {
    cv_.wait(lock, [&] { return completed_; });
  } else if (!cv_.wait_for(lock, timeout, [&] { return completed_; })) {
    C10_THROW_ERROR(
        DistBackendError,
        "ft: wait() timed out after " + std::to_string(timeout.count()) +
            " ms on " + description_ +
            " (the op is still pending; it will fail at its deadline)");
  }
  if (exception_) {
    std::rethrow_exception(exception_);
  }
  return true;
}

void FtWork::synchronize() {
  waitCompleted(kNoTimeout);
  if (deviceOp_ && inner_) {
    inner_->wait(kNoTimeout); // order the current stream after the op
  }
}

c10::intrusive_ptr<c10::ivalue::Future> FtWork::getFuture() {
  return future_;
}

bool FtWork::succeed(const std::function<void()>& finalize) {
  std::exception_ptr finalizeError;
  {
    std::lock_guard<std::mutex> commit(commitMutex_);
    if (done()) {
      return false;
    }
    if (finalize) {
      try {
        finalize();
      } catch (...) {
        finalizeError = std::current_exception();
      }
    }
    done_.store(true, std::memory_order_release);
  }
  finish(finalizeError);
  if (finalizeError) {
    future_->setError(finalizeError);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
  return true;
}

bool FtWork::fail(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> commit(commitMutex_);
    if (done()) {
      return false;
    }
    done_.store(true, std::memory_order_release);
  }
  finish(error);
  future_->setError(error);
  return true;
}

namespace {

class Releaser {
 public:
  Releaser() {
    // Detached: at process exit the queue may hold works whose tensors need
    // an interpreter that is already gone; leaking them is harmless.
    std::thread([this] { run(); }).detach();
  }

  void push(c10::intrusive_ptr<c10d::Work> work) {
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (leaking_) {
        // The interpreter is finalizing: a thread that asks for the GIL now
        // is killed by Python mid-destructor. Leak instead.
        (void)work.release();
        return;
      }
      queue_.push_back(std::move(work));
      wake = queue_.size() >= kBatch;
    }
    // Waking a thread per op costs a context switch on the hot path; batch
    // instead, with a short periodic drain.
    if (wake) {
      cv_.notify_one();
    }
  }

  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      cv_.wait_for(lock, kDrainPeriod, [&] {
        return stopping_ || queue_.size() >= kBatch;
      });
      if (stopping_) {
        return;
      }
      if (queue_.empty()) {
        continue;
      }
      std::deque<c10::intrusive_ptr<c10d::Work>> batch;
      batch.swap(queue_);
      busy_ = true;
      lock.unlock();
      batch.clear();
      lock.lock();
      busy_ = false;
      idle_.notify_all();
    }
  }

  // Drops everything queued on the calling thread (which holds the GIL), and
  // with `finalizing`, leaks whatever comes later.
  void drainNow(bool finalizing) {
    std::deque<c10::intrusive_ptr<c10d::Work>> batch;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      batch.swap(queue_);
      leaking_ = leaking_ || finalizing;
    }
    batch.clear();
  }

  // Stops the thread after its current batch. Call without the GIL: that
  // batch may need it.
  void quiesce() {
    std::unique_lock<std::mutex> lock(mutex_);
    stopping_ = true;
    cv_.notify_all();
    idle_.wait(lock, [&] { return !busy_; });
  }

  static constexpr size_t kBatch = 64;
  static constexpr std::chrono::milliseconds kDrainPeriod{20};
  std::mutex mutex_;
  std::condition_variable cv_;
  std::condition_variable idle_;
  std::deque<c10::intrusive_ptr<c10d::Work>> queue_;
  bool leaking_ = false;
  bool stopping_ = false;
  bool busy_ = false;
};

Releaser& releaser() {
  // Never destroyed: see the comment in the constructor.
  static Releaser* instance = new Releaser();
  return *instance;
}

} // namespace

void releaseLater(c10::intrusive_ptr<c10d::Work> work) {
  releaser().push(std::move(work));
}

void drainReleaser(bool finalizing) {
  releaser().drainNow(finalizing);
}

void quiesceReleaser() {
  releaser().quiesce();
}

} // namespace ft
