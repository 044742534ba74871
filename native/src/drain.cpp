#include "drain.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "accounting.hpp"
#include "process_state.hpp"

namespace gpucleanup {
namespace {

using Clock = std::chrono::steady_clock;

// Longest settle honoured: keeps deadline arithmetic far from overflow.
constexpr double kMaxTimeoutS = 1e7;

// Wakes the draining thread when any watchdog finishes. Shared with the
// watchdogs, which may outlive the drain.
struct Settling {
  std::mutex mutex;
  std::condition_variable finished;
};

enum class Settle { skipped, pending, done, timeout, still_busy, interrupted, error };

const char* to_string(Settle settle) {
  switch (settle) {
    case Settle::skipped: return "skipped";
    case Settle::pending: return "timeout";
    case Settle::done: return "done";
    case Settle::timeout: return "timeout";
    case Settle::still_busy: return "still_busy";
    case Settle::interrupted: return "interrupted";
    case Settle::error: return "error";
  }
  return "error";
}

struct Work {
  DeviceUse use;
  DeviceRecord* record = nullptr;
  nlohmann::json entry;
  std::vector<PoolRef> pools;
  std::vector<std::optional<std::uint64_t>> reserved_before;
  std::shared_ptr<DeviceWait> wait;
  Settle settle = Settle::skipped;
  double waited_s = 0;
  std::optional<double> busy_for_s;
  bool trim = false;
};

double seconds(Clock::duration d) { return std::max(0.0, std::chrono::duration<double>(d).count()); }

nlohmann::json bytes(const std::optional<std::uint64_t>& value) {
  return value ? nlohmann::json(*value) : nlohmann::json(nullptr);
}

std::string one_decimal(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", value);
  return text;
}

nlohmann::json base_entry(const DeviceUse& use, const DeviceRecord& record) {
  nlohmann::json entry = {
      {"index", use.index},
      {"name", record.name ? nlohmann::json(*record.name) : nlohmann::json(nullptr)},
      {"state", "drained"},
      {"pools", nlohmann::json::array()},
      {"free_before_bytes", nullptr},
      {"free_after_bytes", nullptr},
      {"released_bytes", 0},
      {"error", nullptr},
      {"message", nullptr},
  };
  if (use.context != ContextKind::none) entry["context"] = use.context == ContextKind::primary ? "primary" : "current";
  return entry;
}

void mark_failed(Work& work, const Driver& driver, const CallFailure& failure) {
  if (is_sticky(failure.code)) {
    if (!work.record->sticky) work.record->sticky = failure;
    work.entry["state"] = "unusable";
    work.trim = false;
  } else {
    work.entry["state"] = "error";
  }
  work.entry["error"] = failure_json(driver, work.use.index, failure);
  work.entry["message"] = failure_message(driver, work.use.index, failure);
}

// The watchdog: enters the device's context on its own thread and waits for
// its queued work. Everything it touches is owned by value or shared_ptr.
void watch(Driver driver, DeviceUse use, std::shared_ptr<DeviceWait> wait, std::shared_ptr<Settling> settling) {
  CUresult result = CUDA_SUCCESS;
  const char* call = "cuCtxSynchronize";
  try {
    ScopedContext scope(driver, use);
    if (scope.failure()) {
      result = scope.failure()->code;
      call = scope.failure()->call == "cuCtxPushCurrent" ? "cuCtxPushCurrent" : "cuDevicePrimaryCtxRetain";
    } else if (scope.entered() && !process_is_exiting()) {
      result = driver.api().cuCtxSynchronize();
    }
  } catch (...) {
    result = CUDA_ERROR_UNKNOWN;
  }
  {
    std::lock_guard lock(settling->mutex);
    wait->call.store(call);
    wait->result.store(result);
    wait->finished_ns.store(Clock::now().time_since_epoch().count());
    wait->finished.store(true, std::memory_order_release);
  }
  settling->finished.notify_all();
}

// Before the settle: what the pools hold and the device has free.
void measure_before(Work& work, const Driver& driver, bool& still_in_use) {
  ScopedContext scope(driver, work.use);
  if (scope.failure()) return mark_failed(work, driver, *scope.failure());
  if (!scope.entered()) {
    still_in_use = false;
    return;
  }
  work.trim = true;
  const MemoryInfo info = memory_info(driver);
  if (info.failure) {
    mark_failed(work, driver, *info.failure);
    if (!work.trim) return;
  }
  work.entry["free_before_bytes"] = bytes(info.free_bytes);
  work.pools = device_pools(driver, work.use.device);
  for (const PoolRef& pool : work.pools) {
    work.reserved_before.push_back(pool_attribute(driver, pool.handle, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT));
  }
}

void trim(Work& work, const Driver& driver, bool requested) {
  ScopedContext scope(driver, work.use);
  if (scope.failure()) return mark_failed(work, driver, *scope.failure());
  if (!scope.entered()) return;
  const EntryPoints& api = driver.api();
  std::uint64_t released = 0;
  for (std::size_t i = 0; i < work.pools.size(); ++i) {
    const PoolRef& pool = work.pools[i];
    bool trimmed = false;
    if (requested && api.cuMemPoolTrimTo != nullptr) {
      const CUresult result = api.cuMemPoolTrimTo(pool.handle, 0);
      trimmed = result == CUDA_SUCCESS;
      if (!trimmed) mark_failed(work, driver, CallFailure{"cuMemPoolTrimTo", result});
    }
    const auto after = pool_attribute(driver, pool.handle, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
    const auto& before = work.reserved_before[i];
    if (before && after && *before > *after) released += *before - *after;
    work.entry["pools"].push_back({
        {"which", pool.which},
        {"handle", pool_handle_text(pool.handle)},
        {"reserved_before_bytes", bytes(before)},
        {"reserved_after_bytes", bytes(after)},
        {"trimmed", trimmed},
    });
  }
  work.entry["released_bytes"] = released;
  if (requested && api.cuMemPoolTrimTo == nullptr && !work.pools.empty() && work.entry["message"].is_null()) {
    work.entry["message"] = "the CUDA driver has no cuMemPoolTrimTo: GPU" + std::to_string(work.use.index) +
                            "'s memory pools were not trimmed (update the NVIDIA driver to free them)";
  }
  const MemoryInfo info = memory_info(driver);
  if (info.failure) return mark_failed(work, driver, *info.failure);
  work.entry["free_after_bytes"] = bytes(info.free_bytes);
}

// Waits for every started watchdog, the deadline, or the progress callback's
// "stop", whichever comes first. Returns true when interrupted.
bool wait_for_settle(std::vector<Work>& works, Settling& settling, Clock::time_point start,
                     const DrainOptions& options) {
  const double limit_s = std::min(options.timeout_s, kMaxTimeoutS);
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(limit_s));
  auto next_progress = start + options.progress_after;
  std::unique_lock lock(settling.mutex);
  while (true) {
    const Work* waiting = nullptr;
    for (const Work& work : works) {
      if (work.settle == Settle::pending && !work.wait->finished.load(std::memory_order_acquire)) {
        waiting = &work;
        break;
      }
    }
    if (waiting == nullptr) return false;
    const auto now = Clock::now();
    if (now >= deadline) return false;
    if (options.progress && now >= next_progress) {
      const nlohmann::json report = {
          {"device", waiting->use.index}, {"waited_s", seconds(now - start)}, {"limit_s", limit_s}};
      lock.unlock();
      const bool stop = options.progress(report);
      lock.lock();
      if (stop) return true;
      next_progress = std::max(next_progress + options.progress_every, Clock::now());
      continue;
    }
    settling.finished.wait_until(lock, options.progress ? std::min(deadline, next_progress) : deadline);
  }
}

void finish_settle(Work& work, const Driver& driver, Clock::time_point start, bool interrupted) {
  if (work.wait->finished.load(std::memory_order_acquire)) {
    const Clock::time_point finished{Clock::duration(work.wait->finished_ns.load())};
    work.waited_s = seconds(finished - start);
    const auto result = static_cast<CUresult>(work.wait->result.load());
    work.record->wait.reset();
    if (result == CUDA_SUCCESS) {
      work.settle = Settle::done;
    } else {
      work.settle = Settle::error;
      mark_failed(work, driver, CallFailure{work.wait->call.load(), result});
    }
    return;
  }
  // Still waiting: the watchdog stays in the registry for the next call.
  work.settle = interrupted ? Settle::interrupted : Settle::timeout;
  work.waited_s = seconds(Clock::now() - start);
  work.busy_for_s = work.wait->busy_for_s();
  work.trim = false;
  work.entry["state"] = "busy";
  work.entry["message"] = "GPU" + std::to_string(work.use.index) + " is still busy after " +
                          one_decimal(work.waited_s) + " s" + (interrupted ? " (wait interrupted)" : "") +
                          ": its queued work keeps running and its memory was not trimmed";
}

}  // namespace

nlohmann::json drain(const Driver& driver, DeviceRegistry& registry, const DrainOptions& options) {
  const auto start = Clock::now();
  const Probe found = probe(driver);
  nlohmann::json report = report_header("drain");
  report["driver"] = describe_driver(driver, found);
  report["timeout_s"] = options.timeout_s;
  report["trim"] = options.trim;
  report["interrupted"] = false;
  report["devices"] = nlohmann::json::array();
  if (found.state != DriverState::ready) {
    report["elapsed_s"] = seconds(Clock::now() - start);
    return report;
  }

  std::vector<Work> works;
  for (const DeviceUse& use : found.devices) {
    DeviceRecord& record = registry.refresh(use);
    if (!use.in_use() && !record.sticky) continue;
    read_static_facts(driver, use, record);
    Work work;
    work.use = use;
    work.record = &record;
    work.entry = base_entry(use, record);
    if (record.sticky) {
      // Left alone: reported, never touched again.
      mark_failed(work, driver, *record.sticky);
    } else if (record.wait) {
      work.settle = Settle::still_busy;
      work.busy_for_s = record.wait->busy_for_s();
      work.entry["state"] = "busy";
      work.entry["message"] = "GPU" + std::to_string(use.index) + " is still busy with work queued " +
                              one_decimal(*work.busy_for_s) + " s ago: not waited for again, not trimmed";
    } else {
      bool still_in_use = true;
      measure_before(work, driver, still_in_use);
      if (!still_in_use) continue;
      if (work.trim && options.timeout_s > 0) work.settle = Settle::pending;
    }
    works.push_back(std::move(work));
  }

  bool interrupted = false;
  const bool settling_any =
      std::any_of(works.begin(), works.end(), [](const Work& w) { return w.settle == Settle::pending; });
  if (settling_any) {
    auto settling = std::make_shared<Settling>();
    const auto settle_start = Clock::now();
    for (Work& work : works) {
      if (work.settle != Settle::pending) continue;
      work.wait = std::make_shared<DeviceWait>();
      try {
        std::thread(watch, driver, work.use, work.wait, settling).detach();
        work.record->wait = work.wait;
      } catch (const std::system_error& e) {
        work.settle = Settle::error;
        work.entry["message"] = std::string("[gpucleanup.drain.301] could not start a watchdog thread (") +
                                e.what() + "): GPU" + std::to_string(work.use.index) +
                                " was trimmed without waiting for its queued work";
      }
    }
    interrupted = wait_for_settle(works, *settling, settle_start, options);
    for (Work& work : works) {
      if (work.settle == Settle::pending) finish_settle(work, driver, settle_start, interrupted);
    }
  }

  for (Work& work : works) {
    if (work.trim) trim(work, driver, options.trim);
    work.entry["settle"] = {
        {"status", to_string(work.settle)},
        {"waited_s", work.waited_s},
        {"busy_for_s", work.busy_for_s ? nlohmann::json(*work.busy_for_s) : nlohmann::json(nullptr)},
    };
    report["devices"].push_back(std::move(work.entry));
  }
  report["interrupted"] = interrupted;
  report["elapsed_s"] = seconds(Clock::now() - start);
  return report;
}

}  // namespace gpucleanup
