// The status server's jobs: the snapshot and drain hooks, each run on a worker
// thread of its own, because they may block (the library serialises snapshot
// and drain, and a drain runs the kernel's cleanup, which can run the user's
// finalizers) and must never hold up the thread that answers. A status reply
// waits a bounded time for a fresh snapshot, else takes the last one, marked
// stale; a drain's result is picked up by the server thread when the drain's
// worker wakes it. Snapshots never queue behind a drain.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "server_config.hpp"

namespace gpucleanup {

class StatusJobs {
 public:
  StatusJobs(ServerHooks hooks, double snapshot_timeout_s);
  StatusJobs(const StatusJobs&) = delete;
  StatusJobs& operator=(const StatusJobs&) = delete;

  // Starts the workers. parked(): whether the kernel is parking or parked (then no snapshot is taken: a driver
  // call would wait for the restore); drain_done(): called on the worker when a drain's result is ready.
  void start(std::function<bool()> parked, std::function<void()> drain_done);
  // Forgets a drain not yet picked up and joins the workers (one under way finishes first).
  void stop() noexcept;

  // The freshest snapshot available within snapshot_timeout_s of the request that started it, into `reply`
  // ("snapshot", "snapshot_status", "snapshot_age_s", "snapshot_error"): a stuck hook makes replies stale,
  // never late.
  void add_snapshot(nlohmann::json& reply);
  bool drain_running() const;
  // Queues a drain; false when one is running already.
  bool start_drain(double timeout_s);
  // A finished drain, taken: {"result": ...} or {"error": "..."}; nullopt while none has finished.
  std::optional<nlohmann::json> take_drain_result();

 private:
  void work();        // snapshots
  void drain_work();  // drains

  const ServerHooks hooks_;
  const double snapshot_timeout_s_;
  std::function<bool()> parked_;
  std::function<void()> drain_done_;
  std::thread worker_;
  std::thread drain_worker_;
  mutable std::mutex mutex_;
  std::condition_variable job_cv_;
  std::condition_variable drain_cv_;
  std::condition_variable snapshot_cv_;
  bool stop_ = false;
  std::uint64_t snapshot_requested_ = 0;
  std::uint64_t snapshot_done_ = 0;
  std::chrono::steady_clock::time_point snapshot_started_{};
  nlohmann::json last_snapshot_;  // null until the first snapshot
  std::int64_t last_snapshot_ns_ = 0;
  std::string last_snapshot_error_;
  std::optional<double> drain_job_;           // timeout of a drain to run
  std::optional<nlohmann::json> drain_result_;  // finished drain (result or error)
  bool drain_running_ = false;
};

}  // namespace gpucleanup
