#include "deadline.hpp"

namespace ft {

DeadlineWatchdog::DeadlineWatchdog(
    Sweep sweep,
    std::chrono::milliseconds maxSleep)
    : sweep_(std::move(sweep)),
      maxSleep_(maxSleep),
      wakeAt_(Clock::now() + maxSleep),
      thread_([this] { run(); }) {}

DeadlineWatchdog::~DeadlineWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) {
    thread_.join();
  }
}

void DeadlineWatchdog::poke(Clock::time_point deadline) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (deadline >= wakeAt_) {
      return;
    }
    wakeAt_ = deadline;
  }
  cv_.notify_all();
}

void DeadlineWatchdog::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    cv_.wait_until(lock, wakeAt_, [&] {
      return stop_ || Clock::now() >= wakeAt_;
    });
    if (stop_) {
      break;
    }
    // Reset before sweeping so a poke() that races with the sweep is kept.
    wakeAt_ = Clock::now() + maxSleep_;
    lock.unlock();
    std::optional<Clock::time_point> next = sweep_();
    lock.lock();
    if (next && *next < wakeAt_) {
      wakeAt_ = *next;
    }
  }
}

} // namespace ft
