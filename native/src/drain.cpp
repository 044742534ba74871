#include "drain.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <sched.h>

#include "accounting.hpp"
#include "gil.hpp"
#include "process_state.hpp"
#include "watchdog.hpp"

namespace gpucleanup {
namespace {

using Clock = std::chrono::steady_clock;

// How long a wait keeps the caller's interpreter lock before giving it up (gil.hpp).
constexpr auto kHoldGilFor = std::chrono::milliseconds(2);

// How long the caller first watches for a watchdog's change without sleeping: an idle
// device's pass is done in tens of microseconds, and waking a sleeping caller costs about
// as much again (measured: tests/bench/driver_costs.cpp, BENCHMARKS.md). Only where the
// process may run on more than one CPU: on one, the watchdog needs the CPU the caller holds.
constexpr auto kWatchFor = std::chrono::microseconds(300);

// Longest settle honoured: keeps deadline arithmetic far from overflow.
constexpr double kMaxTimeoutS = 1e7;

enum class Mode { drain, after_cell, trim };

// Wakes the calling thread whenever a watchdog moves on. Shared with the
// watchdogs, which may outlive the call.
struct Settling {
  std::mutex mutex;
  std::condition_variable changed;
  std::atomic<std::uint64_t> changes{0};  // counted under mutex, read without it by a watching caller
};

bool several_cpus() {
  static const bool several = [] {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set) > 1;
    return std::thread::hardware_concurrency() > 1;
  }();
  return several;
}

// Where a device's pass is. The caller's limit applies before `settled`.
enum class Phase { queued, measuring, settling, settled, done };

enum class Settle { skipped, done, timeout, still_busy, interrupted, error };

const char* to_string(Settle settle) {
  switch (settle) {
    case Settle::skipped: return "skipped";
    case Settle::done: return "done";
    case Settle::timeout: return "timeout";
    case Settle::still_busy: return "still_busy";
    case Settle::interrupted: return "interrupted";
    case Settle::error: return "error";
  }
  return "error";
}

// One device's pass, inside one push of its context: memory before, the wait
// (settle), the trim, memory after. Inputs are fixed before it runs. Results
// are written by whoever runs it (a watchdog, or the calling thread) and read
// by the caller once `phase`, read under settling->mutex, says they are
// complete: the measurements of before at `settling`, everything at `done`.
struct Pass {
  Pass(const Driver& d, const DeviceUse& u) : driver(d), use(u) {}

  Driver driver;
  DeviceUse use;                   // with the probe's lease for a primary context
  bool on_probing_thread = false;  // a context current to this thread needs no push
  bool measure_before = true;
  bool settle = false;
  bool trim = false;               // cuMemPoolTrimTo requested
  bool read_after = true;          // false: what was read before is reported as after
  std::shared_ptr<DeviceWait> wait;       // when settle
  std::shared_ptr<Settling> settling;     // when run by a watchdog

  // Guarded by settling->mutex when run by a watchdog.
  Phase phase = Phase::queued;
  bool abandoned = false;  // the caller returned without it: no trim, nothing more reported

  // Results.
  bool stopped = false;    // a failure after which this pass leaves the device alone
  bool gone = false;       // its context was destroyed meanwhile: not in use after all
  bool synced = false;     // cuCtxSynchronize ran (its result is in `wait`)
  bool trim_ran = false;   // reached the trim step: pools and memory after are reported
  std::vector<CallFailure> failures;  // in the order they happened
  MemoryInfo before;
  MemoryInfo after;
  std::vector<PoolRef> pools;
  std::vector<std::optional<std::uint64_t>> reserved_before;
  std::vector<std::optional<std::uint64_t>> reserved_after;
  std::vector<bool> trimmed;
};

// Runs `change` under the pass's lock (when a watchdog runs it) and wakes the caller.
template <typename Change>
void under_lock(Pass& pass, Change&& change) {
  if (!pass.settling) {
    change();
    return;
  }
  {
    std::lock_guard lock(pass.settling->mutex);
    change();
    pass.settling->changes.fetch_add(1, std::memory_order_release);
  }
  pass.settling->changed.notify_all();
}

void finish_wait(DeviceWait& wait, CUresult result, const char* call) {
  wait.call.store(call);
  wait.result.store(result);
  wait.finished_ns.store(Clock::now().time_since_epoch().count());
  wait.finished.store(true, std::memory_order_release);
}

// The context the pass entered no longer exists: a framework reset the device
// (cuDevicePrimaryCtxReset; the thread that used it keeps the stale handle
// current, and calls in it answer CUDA_ERROR_CONTEXT_IS_DESTROYED, as measured
// on a real driver), or a context current to the calling thread was destroyed.
// Nothing to clean there: the device is not in use after all.
bool context_gone(const Pass& pass, CUresult code) {
  return code == CUDA_ERROR_CONTEXT_IS_DESTROYED ||
         (pass.use.context == ContextKind::current && code == CUDA_ERROR_INVALID_CONTEXT);
}

bool failed(Pass& pass, const std::optional<CallFailure>& failure) {
  if (!failure) return false;
  if (context_gone(pass, failure->code)) {
    pass.gone = pass.stopped = true;
    return true;
  }
  pass.failures.push_back(*failure);
  if (is_sticky(failure->code)) pass.stopped = true;
  return true;
}

// The memory read before the settle still holds after it: it was read, and every pool reserves
// what it did before (no free was let go at the sync, no trim gave anything back). A cuMemGetInfo
// is the dearest call of the pass (about 20 us on an H100), and an idle cell's pass needs none.
bool pools_unchanged(const Pass& pass) {
  if (!pass.measure_before || !pass.before.free_bytes || pass.before.failure) return false;
  for (std::size_t i = 0; i < pass.reserved_before.size(); ++i) {
    if (i >= pass.reserved_after.size() || !pass.reserved_before[i] || !pass.reserved_after[i] ||
        *pass.reserved_before[i] != *pass.reserved_after[i]) {
      return false;
    }
  }
  return true;
}

// The pass itself. Makes no driver call once the process is exiting; the
// lease's reference is given back by whoever drops the pass last.
void run_pass(Pass& pass) noexcept {
  try {
    bool abandoned = false;
    under_lock(pass, [&] {
      abandoned = pass.abandoned;
      pass.phase = abandoned ? Phase::done : Phase::measuring;
      if (abandoned && pass.wait) finish_wait(*pass.wait, CUDA_SUCCESS, "cuCtxSynchronize");
    });
    if (abandoned) return;

    const EntryPoints& api = pass.driver.api();
    bool pushed = false;
    if (process_is_exiting()) {
      pass.stopped = true;
    } else if (pass.use.context == ContextKind::current && pass.on_probing_thread) {
      // The probe found it current to this very thread: nothing to push.
    } else {
      const CUcontext context = pass.use.context == ContextKind::current ? pass.use.current
                                : pass.use.lease                        ? pass.use.lease->context()
                                                                        : nullptr;
      if (context == nullptr) {
        pass.stopped = true;
      } else if (const CUresult result = api.cuCtxPushCurrent(context); result != CUDA_SUCCESS) {
        failed(pass, CallFailure{"cuCtxPushCurrent", result});
        pass.stopped = true;
      } else {
        pushed = true;
      }
    }
    // A context current to the probing thread is checked before use even when
    // the free memory before is not wanted (the trim): it may be a stale one.
    if (!pass.stopped && (pass.measure_before || pass.use.context == ContextKind::current)) {
      pass.before = memory_info(pass.driver);
      failed(pass, pass.before.failure);
    }
    if (!pass.stopped) {
      pass.pools = device_pools(pass.driver, pass.use.device);
      for (const PoolRef& pool : pass.pools) {
        pass.reserved_before.push_back(pool_attribute(pass.driver, pool.handle, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT));
      }
    }

    if (pass.settle) {
      bool sync = false;
      under_lock(pass, [&] {
        abandoned = pass.abandoned;
        sync = !pass.stopped && !abandoned && !process_is_exiting();
        pass.phase = sync ? Phase::settling : Phase::settled;
        if (!sync) finish_wait(*pass.wait, CUDA_SUCCESS, "cuCtxSynchronize");
      });
      if (sync) {
        const CUresult result = api.cuCtxSynchronize();
        under_lock(pass, [&] {
          finish_wait(*pass.wait, result, "cuCtxSynchronize");
          pass.synced = true;
          pass.phase = Phase::settled;
          abandoned = pass.abandoned;
        });
        // Abandoned: the next call folds a sticky result in from the wait.
        if (!abandoned) failed(pass, result == CUDA_SUCCESS ? std::nullopt
                                                            : std::optional(CallFailure{"cuCtxSynchronize", result}));
      }
    }

    if (!pass.stopped && !abandoned && !process_is_exiting()) {
      pass.trim_ran = true;
      for (const auto& [which, handle] : pass.pools) {
        bool trimmed = false;
        if (pass.trim && api.cuMemPoolTrimTo != nullptr) {
          const CUresult result = api.cuMemPoolTrimTo(handle, 0);
          trimmed = result == CUDA_SUCCESS;
          if (!trimmed) failed(pass, CallFailure{"cuMemPoolTrimTo", result});
        }
        pass.trimmed.push_back(trimmed);
        pass.reserved_after.push_back(pass.read_after
                                          ? pool_attribute(pass.driver, handle, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
                                          : pass.reserved_before[pass.trimmed.size() - 1]);
      }
      if (pass.read_after && !pools_unchanged(pass)) {
        pass.after = memory_info(pass.driver);
        failed(pass, pass.after.failure);
      } else {
        pass.after = pass.before;
      }
    }
    if (pushed && !process_is_exiting()) {
      CUcontext popped = nullptr;
      api.cuCtxPopCurrent(&popped);
    }
    // Popped: the reference may go. The caller holds its own until it returns
    // (so a finished call has given everything back when it returns); a
    // watchdog the caller stopped waiting for gives it back here.
    pass.use.lease.reset();
    under_lock(pass, [&] { pass.phase = Phase::done; });
  } catch (...) {
    // Out of memory in a vector: the caller must still see the pass end.
    try {
      under_lock(pass, [&] {
        if (pass.wait && !pass.wait->finished.load()) finish_wait(*pass.wait, CUDA_ERROR_UNKNOWN, "cuCtxSynchronize");
        pass.stopped = true;
        pass.phase = Phase::done;
      });
    } catch (...) {
    }
  }
}

// A device listed in the reply.
struct Listed {
  DeviceUse use;
  DeviceRecord* record = nullptr;
  std::shared_ptr<Pass> pass;  // null: not touched this call
  bool on_watchdog = false;
  bool still_busy = false;
  Settle settle = Settle::skipped;
  double waited_s = 0;
  std::optional<double> busy_for_s;
  bool abandoned = false;
  Phase phase_at_abandon = Phase::queued;
  std::optional<std::string> watchdog_error;  // gpucleanup.drain.301
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

std::string gpu(const DeviceUse& use) { return "GPU" + std::to_string(use.index); }

void mark_failed(nlohmann::json& entry, const Driver& driver, const DeviceUse& use, DeviceRecord& record,
                 const CallFailure& failure) {
  if (is_sticky(failure.code)) {
    if (!record.sticky) record.sticky = failure;
    entry["state"] = "unusable";
  } else {
    entry["state"] = "error";
  }
  entry["error"] = failure_json(driver, use.index, failure);
  entry["message"] = failure_message(driver, use.index, failure);
}

// Gives up waiting for a pass still before or in its settle (lock held).
void abandon(Listed& listed, Clock::time_point start, bool interrupted) {
  Pass& pass = *listed.pass;
  pass.abandoned = true;
  listed.abandoned = true;
  listed.phase_at_abandon = pass.phase;
  listed.settle = interrupted ? Settle::interrupted : Settle::timeout;
  listed.waited_s = seconds(Clock::now() - start);
  listed.busy_for_s = pass.wait->busy_for_s();
}

// Waits for every pass given to a watchdog: without a limit once past its
// settle (a trim and two reads), else until the deadline or the progress
// callback's "stop". Returns true when interrupted.
bool wait_for_watchdogs(std::vector<Listed>& listed, Settling& settling, Clock::time_point start,
                        const DrainOptions& options) {
  const double limit_s = std::min(options.timeout_s, kMaxTimeoutS);
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(limit_s));
  auto next_progress = start + options.progress_after;
  bool interrupted = false;
  // A caller holding the interpreter lock keeps it for the first kHoldGilFor (an
  // idle device settles in tens of microseconds) and gives it up for the rest of
  // the wait. Declared before the lock: the interpreter lock is taken back after
  // settling.mutex is let go.
  std::optional<gil::Released> released;
  const auto hold_gil_until = Clock::now() + kHoldGilFor;
  const auto watch_until = several_cpus() ? Clock::now() + kWatchFor : Clock::now();
  std::unique_lock lock(settling.mutex);
  // Waits for a change until `until` (none: without a limit).
  auto wait_for_change = [&](std::optional<Clock::time_point> until) {
    if (Clock::now() < watch_until) {
      // Watched, not slept on: the caller looks at the passes again after any change, or once
      // the watch is over (then it sleeps on the condition variable as below).
      const std::uint64_t seen = settling.changes.load(std::memory_order_acquire);
      lock.unlock();
      while (settling.changes.load(std::memory_order_acquire) == seen && Clock::now() < watch_until &&
             (!until || Clock::now() < *until)) {
        std::this_thread::yield();
      }
      lock.lock();
      return;
    }
    if (!released) {
      if (Clock::now() < hold_gil_until) {
        settling.changed.wait_until(lock, until ? std::min(*until, hold_gil_until) : hold_gil_until);
        return;
      }
      lock.unlock();  // never wait for the interpreter lock while holding settling.mutex
      released.emplace();
      lock.lock();
      // A watchdog may have finished (and notified) while the mutex was let go: waiting now could wait for a
      // notification that has already come, forever when there is no limit. The caller looks at the passes again.
      return;
    }
    if (until) {
      settling.changed.wait_until(lock, *until);
    } else {
      settling.changed.wait(lock);
    }
  };
  auto abandon_unsettled = [&](bool by_progress) {
    for (Listed& l : listed) {
      if (l.on_watchdog && !l.abandoned && l.pass->phase < Phase::settled) abandon(l, start, by_progress);
    }
  };
  while (true) {
    const Listed* waiting = nullptr;
    bool pending = false;
    for (const Listed& l : listed) {
      if (!l.on_watchdog || l.abandoned || l.pass->phase == Phase::done) continue;
      pending = true;
      if (waiting == nullptr && l.pass->phase < Phase::settled) waiting = &l;
    }
    if (!pending) return interrupted;
    if (waiting == nullptr) {
      wait_for_change(std::nullopt);
      continue;
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      abandon_unsettled(false);
      continue;
    }
    if (options.progress && now >= next_progress) {
      const nlohmann::json report = {
          {"device", waiting->use.index}, {"waited_s", seconds(now - start)}, {"limit_s", limit_s}};
      lock.unlock();
      const bool stop = options.progress(report);
      lock.lock();
      if (stop) {
        interrupted = true;
        abandon_unsettled(true);
        continue;
      }
      next_progress = std::max(next_progress + options.progress_every, Clock::now());
      continue;
    }
    wait_for_change(options.progress ? std::min(deadline, next_progress) : deadline);
  }
}

// After the wait: how the settle of a pass that was not abandoned ended.
void finish_settle(Listed& listed, Clock::time_point start) {
  Pass& pass = *listed.pass;
  if (pass.synced) {
    const Clock::time_point finished{Clock::duration(pass.wait->finished_ns.load())};
    listed.waited_s = seconds(finished - start);
    listed.settle = pass.wait->result.load() == CUDA_SUCCESS ? Settle::done : Settle::error;
  } else {
    listed.settle = Settle::skipped;  // stopped before the wait (a sticky error, exiting)
  }
  listed.record->wait.reset();
}

bool before_known(const Listed& listed) {
  return listed.pass && (!listed.abandoned || listed.phase_at_abandon >= Phase::settling);
}

// The pools as the pass saw them: trimmed and read again, or (busy) as read before.
nlohmann::json pool_entries(const Pass& pass, bool after, std::uint64_t& released) {
  nlohmann::json pools = nlohmann::json::array();
  released = 0;
  for (std::size_t i = 0; i < pass.pools.size(); ++i) {
    const auto& before = pass.reserved_before[i];
    const auto& reserved = after ? pass.reserved_after[i] : before;
    if (before && reserved && *before > *reserved) released += *before - *reserved;
    pools.push_back({
        {"which", pass.pools[i].which},
        {"handle", pool_handle_text(pass.pools[i].handle)},
        {"reserved_before_bytes", bytes(before)},
        {"reserved_after_bytes", bytes(reserved)},
        {"trimmed", after && pass.trimmed[i]},
    });
  }
  return pools;
}

std::string still_busy_message(const Listed& listed, const char* what) {
  return gpu(listed.use) + " is still busy with work queued " + one_decimal(listed.busy_for_s.value_or(0)) +
         " s ago: " + what;
}

std::string busy_message(const Listed& listed) {
  return gpu(listed.use) + " is still busy after " + one_decimal(listed.waited_s) + " s" +
         (listed.settle == Settle::interrupted ? " (wait interrupted)" : "") +
         ": its queued work keeps running and its memory was not trimmed";
}

std::string no_trim_message(const DeviceUse& use) {
  return "the CUDA driver has no cuMemPoolTrimTo: " + gpu(use) +
         "'s memory pools were not trimmed (update the NVIDIA driver to free them)";
}

nlohmann::json context_json(ContextKind kind) {
  switch (kind) {
    case ContextKind::primary: return "primary";
    case ContextKind::current: return "current";
    case ContextKind::none: break;
  }
  return nullptr;
}

// Everything of one device but the mode's own fields: state, error and
// message from what the pass (or an earlier call) found.
void apply_outcome(nlohmann::json& entry, const Driver& driver, Listed& listed, const char* busy_state) {
  DeviceRecord& record = *listed.record;
  const DeviceUse& use = listed.use;
  if (!listed.pass) {
    if (record.sticky) {
      mark_failed(entry, driver, use, record, *record.sticky);  // left alone: reported, never touched again
    } else if (use.failure) {
      mark_failed(entry, driver, use, record, *use.failure);
    }
    if (listed.still_busy && !record.sticky && !use.failure) entry["state"] = busy_state;
    return;
  }
  const Pass& pass = *listed.pass;
  if (listed.watchdog_error) entry["message"] = *listed.watchdog_error;
  if (before_known(listed)) {
    for (const CallFailure& failure : pass.failures) mark_failed(entry, driver, use, record, failure);
  }
  if (listed.abandoned || listed.still_busy) {
    if (entry["state"] != "unusable") entry["state"] = busy_state;
  }
  if (pass.trim_ran && !listed.still_busy && pass.trim && driver.api().cuMemPoolTrimTo == nullptr &&
      !pass.pools.empty() && entry["message"].is_null()) {
    entry["message"] = no_trim_message(use);
  }
}

nlohmann::json settle_json(const Listed& listed) {
  return {
      {"status", to_string(listed.settle)},
      {"waited_s", listed.waited_s},
      {"busy_for_s", listed.busy_for_s ? nlohmann::json(*listed.busy_for_s) : nlohmann::json(nullptr)},
  };
}

// share/schema/drain.schema.json#/$defs/device, as it has always been.
nlohmann::json drain_entry(const Driver& driver, Listed& listed) {
  const DeviceRecord& record = *listed.record;
  nlohmann::json entry = {
      {"index", listed.use.index},
      {"name", record.name ? nlohmann::json(*record.name) : nlohmann::json(nullptr)},
      {"state", "drained"},
      {"pools", nlohmann::json::array()},
      {"free_before_bytes", nullptr},
      {"free_after_bytes", nullptr},
      {"released_bytes", 0},
      {"error", nullptr},
      {"message", nullptr},
  };
  if (listed.use.context != ContextKind::none) entry["context"] = context_json(listed.use.context);
  apply_outcome(entry, driver, listed, "busy");
  if (listed.still_busy && entry["state"] == "busy") {
    entry["message"] = still_busy_message(listed, "not waited for again, not trimmed");
  } else if (listed.abandoned && entry["state"] == "busy") {
    entry["message"] = busy_message(listed);
  }
  if (before_known(listed)) {
    const Pass& pass = *listed.pass;
    entry["free_before_bytes"] = bytes(pass.before.free_bytes);
    if (pass.trim_ran) {
      std::uint64_t released = 0;
      entry["pools"] = pool_entries(pass, true, released);
      entry["released_bytes"] = released;
      entry["free_after_bytes"] = bytes(pass.after.free_bytes);
    }
  }
  entry["settle"] = settle_json(listed);
  return entry;
}

void memory_after(nlohmann::json& entry, const MemoryInfo& info) {
  entry["free_bytes"] = bytes(info.free_bytes);
  if (info.free_bytes && info.total_bytes && *info.total_bytes >= *info.free_bytes) {
    entry["used_bytes"] = *info.total_bytes - *info.free_bytes;
  }
}

// share/schema/after_cell.schema.json#/$defs/device
nlohmann::json after_cell_entry(const Driver& driver, Listed& listed) {
  const DeviceRecord& record = *listed.record;
  nlohmann::json entry = {
      {"index", listed.use.index},
      {"uuid", listed.use.uuid ? nlohmann::json(*listed.use.uuid) : nlohmann::json(nullptr)},
      {"name", record.name ? nlohmann::json(*record.name) : nlohmann::json(nullptr)},
      {"context", context_json(listed.use.context)},
      {"state", "drained"},
      {"free_before_bytes", nullptr},
      {"released_bytes", 0},
      {"pools", nlohmann::json::array()},
      {"total_bytes", bytes(record.total_bytes)},
      {"used_bytes", nullptr},
      {"free_bytes", nullptr},
      {"error", nullptr},
      {"message", nullptr},
  };
  apply_outcome(entry, driver, listed, "busy");
  if (listed.still_busy && entry["state"] == "busy") {
    entry["message"] = still_busy_message(listed, "not waited for again, not trimmed");
  } else if (listed.abandoned && entry["state"] == "busy") {
    entry["message"] = busy_message(listed);
  }
  if (before_known(listed)) {
    const Pass& pass = *listed.pass;
    const bool busy = listed.abandoned || listed.still_busy;
    if (!listed.still_busy) entry["free_before_bytes"] = bytes(pass.before.free_bytes);
    if (busy) {
      // Not trimmed: the pools and the memory as read at the start of this call.
      std::uint64_t released = 0;
      entry["pools"] = pool_entries(pass, false, released);
      memory_after(entry, listed.still_busy ? pass.after : pass.before);
    } else if (pass.trim_ran) {
      std::uint64_t released = 0;
      entry["pools"] = pool_entries(pass, true, released);
      entry["released_bytes"] = released;
      memory_after(entry, pass.after);
    }
  }
  entry["settle"] = settle_json(listed);
  return entry;
}

// share/schema/after_cell.schema.json#/$defs/trimmed_device
nlohmann::json trim_entry(const Driver& driver, Listed& listed) {
  const DeviceRecord& record = *listed.record;
  nlohmann::json entry = {
      {"index", listed.use.index},
      {"uuid", listed.use.uuid ? nlohmann::json(*listed.use.uuid) : nlohmann::json(nullptr)},
      {"name", record.name ? nlohmann::json(*record.name) : nlohmann::json(nullptr)},
      {"context", context_json(listed.use.context)},
      {"state", "trimmed"},
      {"released_bytes", 0},
      {"pools", nlohmann::json::array()},
      {"total_bytes", bytes(record.total_bytes)},
      {"used_bytes", nullptr},
      {"free_bytes", nullptr},
      {"error", nullptr},
      {"message", nullptr},
  };
  apply_outcome(entry, driver, listed, "busy");
  if (listed.still_busy && entry["state"] == "busy") entry["message"] = still_busy_message(listed, "not trimmed");
  if (listed.pass && listed.pass->trim_ran) {
    std::uint64_t released = 0;
    entry["pools"] = pool_entries(*listed.pass, true, released);
    entry["released_bytes"] = released;
    memory_after(entry, listed.pass->after);
  }
  return entry;
}

// True when nothing is queued on the device now, asked without waiting: an event recorded over the whole
// context (cuCtxRecordEvent, CUDA 12.5+ drivers: every stream of it, its green contexts too) and queried at
// once. The after-cell pass of an idle device then runs on the calling thread: no watchdog is woken (in a
// kernel the hand-off costs 0.16-0.20 ms a cell, BENCHMARKS.md). False when it is busy or the driver cannot
// tell (no such calls, an error, a stream being captured): the watchdog's cuCtxSynchronize settles it.
// Also false while a driver pool of the device reserves memory: a stream-ordered free may count as in use until
// a synchronize has observed it, so only the sync lets the trim give it back (share/FACTS.md §1.5, §1.6).
//
// `free_out`: also the device's free memory, read inside the same push once nothing is queued (nullopt when
// cuMemGetInfo fails).
bool nothing_queued(const Driver& driver, const DeviceUse& use, std::optional<std::uint64_t>* free_out = nullptr) {
  const EntryPoints& api = driver.api();
  if (api.cuCtxRecordEvent == nullptr || api.cuEventCreate == nullptr || api.cuEventQuery == nullptr ||
      api.cuEventDestroy == nullptr || process_is_exiting()) {
    return false;
  }
  // A context current to this (the probing) thread is used as it is (a framework's thread has the primary context
  // current: no push and pop); another primary context is entered.
  const bool current = use.context == ContextKind::current || use.lease_is_current;
  const CUcontext context = use.context == ContextKind::current ? use.current : use.lease ? use.lease->context() : nullptr;
  if (context == nullptr || (!current && api.cuCtxPushCurrent(context) != CUDA_SUCCESS)) return false;
  bool idle = true;
  for (const PoolRef& pool : device_pools(driver, use.device)) {
    const auto reserved = pool_attribute(driver, pool.handle, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
    if (!reserved || *reserved > 0) idle = false;
  }
  CUevent event = nullptr;
  if (idle && api.cuEventCreate(&event, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS) {
    idle = api.cuCtxRecordEvent(context, event) == CUDA_SUCCESS && api.cuEventQuery(event) == CUDA_SUCCESS;
    api.cuEventDestroy(event);
  } else {
    idle = false;
  }
  if (idle && free_out != nullptr) *free_out = memory_info(driver).free_bytes;
  if (!current) {
    CUcontext popped = nullptr;
    api.cuCtxPopCurrent(&popped);
  }
  return idle;
}

const char* kind_of(Mode mode) {
  switch (mode) {
    case Mode::drain: return "drain";
    case Mode::after_cell: return "after_cell";
    case Mode::trim: return "trim";
  }
  return "drain";
}

nlohmann::json run(Mode mode, const Driver& driver, DeviceRegistry& registry, const DrainOptions& options) {
  const auto start = Clock::now();
  const bool settle = mode != Mode::trim && options.timeout_s > 0;
  // Retained by the probe right after its state said active, once per device
  // and call: the devices this call will enter.
  const Probe found = probe(driver, [&](const DeviceUse& use) {
    const DeviceRecord& record = registry.refresh(use);
    if (record.sticky) return false;
    if (record.wait) return mode == Mode::after_cell;  // busy: only the after-cell pass reads its memory
    return true;
  });
  registry.remember_enumeration(found, driver.loaded() && driver.api().cuDeviceGetUuid != nullptr);  // for quiet_since
  nlohmann::json report = report_header(kind_of(mode));
  report["driver"] = describe_driver(driver, found);
  if (mode != Mode::trim) {
    report["timeout_s"] = options.timeout_s;
    report["trim"] = options.trim;
    report["interrupted"] = false;
  }
  report["devices"] = nlohmann::json::array();
  if (found.state != DriverState::ready) {
    report["elapsed_s"] = seconds(Clock::now() - start);
    return report;
  }

  std::vector<Listed> listed;
  for (const DeviceUse& use : found.devices) {
    DeviceRecord& record = registry.refresh(use);
    if (!use.in_use() && !record.sticky) continue;
    read_static_facts(driver, use, record);
    Listed l;
    l.use = use;
    l.record = &record;
    if (!record.sticky && !use.failure) {
      // Busy as the probe saw it: a wait that ended since is seen by the next call.
      const bool unretained = use.context == ContextKind::primary && !use.lease;
      if (record.wait || unretained) {
        l.still_busy = true;
        l.settle = Settle::still_busy;
        if (record.wait) l.busy_for_s = record.wait->busy_for_s();
      }
      if (!l.still_busy || (mode == Mode::after_cell && !unretained)) {
        auto pass = std::make_shared<Pass>(driver, use);
        pass->on_probing_thread = true;
        pass->measure_before = mode != Mode::trim;
        pass->trim = !l.still_busy && (mode == Mode::trim || options.trim);
        pass->read_after = !l.still_busy;
        l.pass = std::move(pass);
      }
    }
    listed.push_back(std::move(l));
  }

  // The waits, each on its device's watchdog, all at once.
  auto settling = std::make_shared<Settling>();
  const auto settle_start = Clock::now();
  bool any_on_watchdog = false;
  if (settle) {
    for (Listed& l : listed) {
      if (!l.pass || l.still_busy) continue;
      if (mode == Mode::after_cell && nothing_queued(driver, l.use)) {
        l.settle = Settle::done;  // nothing to wait for: the pass runs on this thread below
        continue;
      }
      Pass& pass = *l.pass;
      DeviceRecord& record = *l.record;
      try {
        if (!record.watchdog || !record.watchdog->alive()) record.watchdog = std::make_shared<Watchdog>();
      } catch (const std::system_error& e) {
        l.settle = Settle::error;
        l.watchdog_error = std::string("[gpucleanup.drain.301] could not start a watchdog thread (") + e.what() +
                           "): " + gpu(l.use) + " was trimmed without waiting for its queued work";
        continue;
      }
      pass.on_probing_thread = false;
      pass.settle = true;
      pass.wait = std::make_shared<DeviceWait>();
      pass.wait->started = settle_start;  // busy since the wait began, as the limit counts
      pass.settling = settling;
      record.wait = pass.wait;
      l.on_watchdog = true;
      any_on_watchdog = true;
      record.watchdog->submit([keep = l.pass] { run_pass(*keep); });
    }
  }
  // Passes without a wait run here meanwhile; no thread is woken for them.
  for (Listed& l : listed) {
    if (l.pass && !l.on_watchdog) run_pass(*l.pass);
  }
  bool interrupted = false;
  if (any_on_watchdog) {
    interrupted = wait_for_watchdogs(listed, *settling, settle_start, options);
    std::lock_guard lock(settling->mutex);
    for (Listed& l : listed) {
      if (l.on_watchdog && !l.abandoned) finish_settle(l, settle_start);
    }
  }

  for (Listed& l : listed) {
    if (before_known(l) && l.pass->gone) continue;  // its context is gone: not in use after all
    switch (mode) {
      case Mode::drain: report["devices"].push_back(drain_entry(driver, l)); break;
      case Mode::after_cell: report["devices"].push_back(after_cell_entry(driver, l)); break;
      case Mode::trim: report["devices"].push_back(trim_entry(driver, l)); break;
    }
  }
  // A device marked unusable is never entered again: its watchdog is let go
  // (the thread ends once its queue is empty; a wait still blocked in the
  // driver keeps it until the driver returns).
  for (Listed& l : listed) {
    if (l.record->sticky) l.record->watchdog.reset();
  }
  if (mode != Mode::trim) report["interrupted"] = interrupted;
  report["elapsed_s"] = seconds(Clock::now() - start);
  return report;
}

}  // namespace

nlohmann::json drain(const Driver& driver, DeviceRegistry& registry, const DrainOptions& options) {
  return run(Mode::drain, driver, registry, options);
}

nlohmann::json after_cell(const Driver& driver, DeviceRegistry& registry, const DrainOptions& options) {
  return run(Mode::after_cell, driver, registry, options);
}

nlohmann::json trim_pools(const Driver& driver, DeviceRegistry& registry) {
  DrainOptions options;
  options.timeout_s = 0;
  return run(Mode::trim, driver, registry, options);
}

std::optional<QuietMark> quiet_mark(const nlohmann::json& report) {
  if (!report.is_object()) return std::nullopt;
  const auto driver = report.find("driver");
  const auto devices = report.find("devices");
  if (report.value("kind", "") != "after_cell" || driver == report.end() || !driver->is_object() ||
      driver->value("state", "") != "ready" || devices == report.end() || !devices->is_array()) {
    return std::nullopt;
  }
  // No device listed: the driver initialised and no context of this process (an empty mark, which holds
  // while none appears).
  QuietMark mark;
  for (const nlohmann::json& dev : *devices) {
    if (!dev.is_object()) return std::nullopt;
    const auto index = dev.find("index");
    const auto free = dev.find("free_bytes");
    const auto settle = dev.find("settle");
    const auto pools = dev.find("pools");
    if (index == dev.end() || !index->is_number_integer() || free == dev.end() || !free->is_number_unsigned() ||
        dev.value("context", nlohmann::json()) != "primary" || dev.value("state", "") != "drained" ||
        !dev.value("error", nlohmann::json()).is_null() || settle == dev.end() || !settle->is_object() ||
        settle->value("status", "") != "done" || pools == dev.end() || !pools->is_array()) {
      return std::nullopt;
    }
    for (const nlohmann::json& pool : *pools) {
      if (!pool.is_object()) return std::nullopt;
      const auto reserved = pool.find("reserved_after_bytes");
      if (reserved == pool.end() || !reserved->is_number_unsigned() || reserved->get<std::uint64_t>() != 0) {
        return std::nullopt;
      }
    }
    mark.push_back({index->get<int>(), free->get<std::uint64_t>()});
  }
  return mark;
}

bool quiet_since(const Driver& driver, DeviceRegistry& registry, const QuietMark& mark) {
  if (process_is_exiting()) return false;
  // Retained as the after-cell pass retains them: devices that are neither unusable nor busy.
  // The count, handles and UUIDs as the pass behind the mark enumerated them (it kept them).
  const Probe found = probe(
      driver,
      [&](const DeviceUse& use) {
        const DeviceRecord& record = registry.refresh(use);
        return !record.sticky && !record.wait;
      },
      registry.enumeration());
  if (found.state != DriverState::ready) return false;
  std::size_t matched = 0;
  for (const DeviceUse& use : found.devices) {
    const DeviceRecord& record = registry.refresh(use);
    if (!use.in_use() && !record.sticky) continue;
    if (record.sticky || record.wait || use.failure || use.context != ContextKind::primary || !use.lease) return false;
    const auto it = std::find_if(mark.begin(), mark.end(), [&](const QuietDevice& d) { return d.index == use.index; });
    if (it == mark.end()) return false;  // a device in use that the pass did not see: its first use
    std::optional<std::uint64_t> free;
    if (!nothing_queued(driver, use, &free) || free != it->free_bytes) return false;
    ++matched;
  }
  return matched == mark.size();  // fewer: a context went away
}

}  // namespace gpucleanup
