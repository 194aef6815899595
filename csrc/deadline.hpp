// DeadlineWatchdog: one thread that enforces op deadlines in C++
// (docs/design.md, "Deadlines and the watchdog").
//
// Contract:
//  * `sweep` is called on the watchdog thread whenever the earliest known
//    deadline may have passed (and at least every `maxSleep`). It enforces
//    every expired deadline itself and returns the next deadline to wake for,
//    or nullopt when nothing is pending.
//  * poke(deadline) may be called from any thread; it makes the watchdog wake
//    no later than `deadline`.
//  * The destructor stops and joins the thread; sweep is never called after.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

namespace ft {

class DeadlineWatchdog {
 public:
  using Clock = std::chrono::steady_clock;
  using Sweep = std::function<std::optional<Clock::time_point>()>;

  explicit DeadlineWatchdog(
      Sweep sweep,
      std::chrono::milliseconds maxSleep = std::chrono::milliseconds(1000));
  ~DeadlineWatchdog();

  DeadlineWatchdog(const DeadlineWatchdog&) = delete;
  DeadlineWatchdog& operator=(const DeadlineWatchdog&) = delete;

  void poke(Clock::time_point deadline);

 private:
  void run();

  Sweep sweep_;
  const std::chrono::milliseconds maxSleep_;
  std::mutex mutex_;
  std::condition_variable cv_;
  Clock::time_point wakeAt_;
  bool stop_ = false;
  std::thread thread_;
};

} // namespace ft
