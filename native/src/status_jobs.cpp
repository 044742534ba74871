#include "status_jobs.hpp"

#include <pthread.h>
#include <algorithm>
#include <exception>
#include <stdexcept>
#include <utility>

#include "kernel_state.hpp"

namespace gpucleanup {

using json = nlohmann::json;

StatusJobs::StatusJobs(ServerHooks hooks, double snapshot_timeout_s)
    : hooks_(std::move(hooks)), snapshot_timeout_s_(snapshot_timeout_s) {}

void StatusJobs::start(std::function<bool()> parked, std::function<void()> drain_done) {
  parked_ = std::move(parked);
  drain_done_ = std::move(drain_done);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = false;
  }
  worker_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "gpucleanup-job");  // named: see status_server.cpp
    work();
  });
  try {
    drain_worker_ = std::thread([this] {
      pthread_setname_np(pthread_self(), "gpucleanup-drn");
      drain_work();
    });
  } catch (...) {
    stop();
    throw;
  }
}

void StatusJobs::stop() noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    drain_job_.reset();
    drain_result_.reset();
    drain_running_ = false;
  }
  job_cv_.notify_all();
  drain_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  if (drain_worker_.joinable()) drain_worker_.join();
}

void StatusJobs::add_snapshot(json& reply) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!hooks_.snapshot) {
    reply["snapshot"] = nullptr;
    reply["snapshot_status"] = "unavailable";
    reply["snapshot_age_s"] = nullptr;
    reply["snapshot_error"] = "this server has no snapshot hook";
    return;
  }
  if (snapshot_done_ == snapshot_requested_) {
    ++snapshot_requested_;
    snapshot_started_ = std::chrono::steady_clock::now();
    job_cv_.notify_all();
  }
  const std::uint64_t target = snapshot_requested_;
  // Bounded: a timeout of centuries must not overflow the clock.
  const auto deadline = snapshot_started_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                std::chrono::duration<double>(std::min(snapshot_timeout_s_, 1e6)));
  const bool fresh = snapshot_cv_.wait_until(lock, deadline, [&] { return snapshot_done_ >= target; });
  reply["snapshot"] = last_snapshot_;
  if (last_snapshot_.is_null()) {
    reply["snapshot_status"] = "unavailable";
    reply["snapshot_age_s"] = nullptr;
  } else {
    reply["snapshot_status"] = fresh && last_snapshot_error_.empty() ? "fresh" : "stale";
    reply["snapshot_age_s"] = static_cast<double>(realtime_ns() - last_snapshot_ns_) / 1e9;
  }
  reply["snapshot_error"] = last_snapshot_error_.empty() ? json(nullptr) : json(last_snapshot_error_);
}

bool StatusJobs::drain_running() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return drain_running_;
}

bool StatusJobs::start_drain(double timeout_s) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (drain_running_) return false;
  drain_running_ = true;
  drain_job_ = timeout_s;
  drain_cv_.notify_all();
  return true;
}

std::optional<json> StatusJobs::take_drain_result() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!drain_result_) return std::nullopt;
  std::optional<json> result = std::move(drain_result_);
  drain_result_.reset();
  drain_running_ = false;
  return result;
}

void StatusJobs::work() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    job_cv_.wait(lock, [&] { return stop_ || snapshot_done_ < snapshot_requested_; });
    if (stop_) return;
    const std::uint64_t target = snapshot_requested_;
    lock.unlock();
    json snapshot;
    std::string error;
    try {
      // A parked process's driver calls wait until it is restored: none is made.
      if (parked_()) throw std::runtime_error("the kernel is parked: its GPU memory is in host memory, "
                                              "and no driver call is made until its next cell resumes it");
      snapshot = hooks_.snapshot();
    } catch (const std::exception& e) {
      error = e.what();
    } catch (...) {
      error = "unknown exception";
    }
    lock.lock();
    if (error.empty()) {
      last_snapshot_ = std::move(snapshot);
      last_snapshot_ns_ = realtime_ns();
      last_snapshot_error_.clear();
    } else {
      last_snapshot_error_ = "snapshot failed: " + error;
    }
    snapshot_done_ = target;
    snapshot_cv_.notify_all();
  }
}

void StatusJobs::drain_work() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    drain_cv_.wait(lock, [&] { return stop_ || drain_job_.has_value(); });
    if (stop_) return;
    const double timeout_s = *drain_job_;
    drain_job_.reset();
    lock.unlock();
    json outcome;
    try {
      if (!hooks_.drain) throw std::runtime_error("this server has no drain hook");
      outcome = json{{"result", hooks_.drain(timeout_s)}};
    } catch (const std::exception& e) {
      outcome = json{{"error", e.what()}};
    } catch (...) {
      outcome = json{{"error", "unknown exception"}};
    }
    lock.lock();
    drain_result_ = std::move(outcome);
    lock.unlock();
    drain_done_();
    lock.lock();
  }
}

}  // namespace gpucleanup
