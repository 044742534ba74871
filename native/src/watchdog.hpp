// The settle's thread: one long-lived thread per device, started the first
// time the device needs a wait and reused by every later call.
//
// cuCtxSynchronize cannot be interrupted or given a timeout, so it runs on a
// thread of its own while the caller waits on a condition variable with a
// deadline. Jobs run one after another in the order given. The thread owns
// its queue through shared_ptr and outlives this handle: dropping the handle
// lets the thread end once its queue is empty (a wait that never ends keeps it,
// as before, without keeping the process from exiting: the thread is
// detached). The library's code is pinned in memory (RTLD_NODELETE) when the
// first thread starts, so a dlclose never unmaps code such a thread still runs.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

namespace gpucleanup {

class Watchdog {
 public:
  // Starts the thread; throws std::system_error when it cannot be started.
  Watchdog();
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Queues a job for the thread. A job must not throw (it is wrapped anyway).
  void submit(std::function<void()> job);

  // False in a child forked after the thread started: the thread does not
  // exist there, a new Watchdog is needed.
  bool alive() const noexcept;

 private:
  struct Queue;
  std::shared_ptr<Queue> queue_;
  std::uint64_t generation_;
};

// Watchdog threads started by this process so far (for the tests' counts).
std::uint64_t watchdog_threads_started() noexcept;

}  // namespace gpucleanup
