// The C ABI: argument checks, status codes, the thread's last error, JSON out.
// Nothing may escape as an exception; every entry point ends in a catch(...).
#include "sigterm_cleanup.hpp"
#include "gpucleanup/gpucleanup.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <atomic>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <string_view>

#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include "accounting.hpp"
#include "checkpoint.hpp"
#include "thread_hold.hpp"
#include "api_input.hpp"
#include "devices.hpp"
#include "drain.hpp"
#include "driver.hpp"
#include "errors.hpp"
#include "gil.hpp"
#include "process_state.hpp"
#include "status_server.hpp"
#include "trace.hpp"

namespace gpucleanup {
namespace {

thread_local std::string last_error;

// Everything the C ABI keeps between calls, fresh in a forked child.
struct ApiState {
  // Serialises probe, snapshot, drain, after_cell and trim; timed so the status server's thread
  // can give up instead of waiting out a long drain.
  std::timed_mutex cleanup;
  // A drain asked for through the status server holds `cleanup` while it waits
  // for queued work (up to its timeout, 60 s at most). The kernel's own calls
  // must never wait on it: they ask it to stop, and it does within one poll.
  std::atomic<bool> outside_drain{false};
  std::atomic<bool> stop_outside_drain{false};
  DeviceRegistry registry;
  // What the last after-cell pass left, for gpucleanup_quiet (nullopt: nothing it can compare with).
  std::optional<QuietMark> quiet;
  std::mutex server_mutex;
  std::unique_ptr<StatusServer> server;
};

// The kernel's part of a drain from outside (gpucleanup_set_drain_hook). Set
// from Python, read by the server's helper thread; a set is never freed, so a
// reader never sees one half replaced (at most a few per process, as gil.cpp's).
struct DrainHook {
  gpucleanup_drain_hook_fn fn;
  void* user;
};
std::atomic<const DrainHook*> g_drain_hook{nullptr};

// The most the kernel's part may write: a few frameworks per device.
constexpr std::size_t kDrainHookCapacity = 256 * 1024;

PerProcess<ApiState>& api_state() {
  static auto* state = new PerProcess<ApiState>();  // leaked: no destructor at exit
  return *state;
}

template <typename Body>
gpucleanup_status guarded(Body&& body) noexcept {
  try {
    try {
      last_error.clear();
      body();
      return GPUCLEANUP_OK;
    } catch (const Failure& failure) {
      last_error = failure.message();
      return failure.status();
    } catch (const Error& error) {
      last_error = error.what();
      return GPUCLEANUP_ERR_INTERNAL;
    } catch (const std::bad_alloc&) {
      last_error = "[gpucleanup.api.108] out of memory: free host memory and try again";
      return GPUCLEANUP_ERR_INTERNAL;
    } catch (const std::exception& e) {
      last_error = std::string("[gpucleanup.api.109] internal error: ") + e.what() + ": please report this";
      return GPUCLEANUP_ERR_INTERNAL;
    } catch (...) {
      last_error = "[gpucleanup.api.109] internal error: unknown exception: please report this";
      return GPUCLEANUP_ERR_INTERNAL;
    }
  } catch (...) {
    // Even recording the message failed (out of memory).
    return GPUCLEANUP_ERR_INTERNAL;
  }
}

void require_out(char** json_out) {
  if (json_out == nullptr) {
    fail(GPUCLEANUP_ERR_INVALID_ARGUMENT, "[gpucleanup.api.101] json_out is NULL: pass the address of a char*");
  }
  *json_out = nullptr;
}

void require_running() {
  if (process_is_exiting()) {
    fail(GPUCLEANUP_ERR_EXITING, "[gpucleanup.api.102] the process is exiting: gpucleanup makes no more driver calls");
  }
}

// The process-wide driver, or GPUCLEANUP_ERR_DRIVER when it lacks a required
// entry point. A missing driver is not an error: the probe reports no_driver.
const Driver& usable_driver() {
  const Driver& driver = Driver::process();
  if (driver.loaded() && !driver.usable()) fail(GPUCLEANUP_ERR_DRIVER, driver.message());
  return driver;
}

// Runs `use` on the running status server under its lock (taken with the
// interpreter lock given up if it has to wait), or fails with api.107.
template <class Use>
void on_server(Use&& use) {
  ApiState& state = api_state().get();
  gil::lock(state.server_mutex);
  std::lock_guard lock(state.server_mutex, std::adopt_lock);
  if (!state.server) {
    fail(GPUCLEANUP_ERR_SERVER,
         "[gpucleanup.api.107] the status server is not running: call gpucleanup_server_start first");
  }
  use(*state.server);
}

void hand_out(const nlohmann::json& value, char** json_out) {
  const std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  char* copy = strdup(text.c_str());
  if (copy == nullptr) throw std::bad_alloc();
  *json_out = copy;
}

// How long the kernel's own calls wait for a drain from outside to give way:
// asked to stop, it leaves its wait within one poll (25 ms) and then trims only
// what had settled.
constexpr auto kOutsideDrainPatience = std::chrono::milliseconds(500);
constexpr auto kOutsideDrainPoll = std::chrono::milliseconds(25);

// The lock for a call made by the kernel itself (its hooks, %gpumem): never
// queued behind a drain from outside for longer than kOutsideDrainPatience.
// Called with the interpreter lock held (ctypes.PyDLL), it gives that up while it
// waits: the holder may be a drain of the kernel's own on another Python thread,
// whose progress callback needs the interpreter lock to finish.
std::unique_lock<std::timed_mutex> kernel_lock(ApiState& state) {
  std::unique_lock lock(state.cleanup, std::defer_lock);
  if (lock.try_lock()) return lock;
  gil::Released released;
  const auto deadline = std::chrono::steady_clock::now() + kOutsideDrainPatience;
  while (!lock.try_lock_for(std::chrono::milliseconds(2))) {
    if (!state.outside_drain.load()) continue;  // a status snapshot: microseconds
    state.stop_outside_drain.store(true);
    if (std::chrono::steady_clock::now() >= deadline) {
      fail(GPUCLEANUP_ERR_BUSY,
           "[gpucleanup.api.111] a drain asked for with gpucleanup drain is still finishing: this call was "
           "skipped so that the kernel does not wait for it; the next one runs as usual");
    }
  }
  return lock;
}

// Hooks for the status server's thread. The server bounds how long it waits
// for a snapshot (and answers with its last one, marked stale), so waiting here
// behind a drain is fine; a drain request does not queue behind another.
nlohmann::json server_snapshot() {
  ApiState& state = api_state().get();
  std::lock_guard lock(state.cleanup);
  return take_snapshot(Driver::process(), state.registry, SnapshotKind::snapshot);
}

// The kernel's part of a drain from outside: the hook's JSON object, or an
// object that says why it is missing; nullopt when no hook is set.
std::optional<nlohmann::json> run_drain_hook(double timeout_s) {
  const DrainHook* hook = g_drain_hook.load();
  if (hook == nullptr || process_is_exiting()) return std::nullopt;
  std::string buffer(kDrainHookCapacity, '\0');
  const long long written = hook->fn(timeout_s, buffer.data(), buffer.size(), hook->user);
  const auto failed = [](const std::string& why) {
    return nlohmann::json{{"ran", false}, {"skipped", nullptr}, {"error", why}};
  };
  if (written < 0) return failed("the kernel's cleanup failed without a message");
  if (static_cast<unsigned long long>(written) > buffer.size()) {
    return failed("the kernel's cleanup wrote more than " + std::to_string(buffer.size()) + " bytes");
  }
  buffer.resize(static_cast<std::size_t>(written));
  nlohmann::json part = nlohmann::json::parse(buffer, nullptr, false);
  if (!part.is_object()) return failed("the kernel's cleanup did not answer with a JSON object");
  return part;
}

// Errors leave through gpucleanup::Error, which the server turns into replies.
nlohmann::json server_drain(double timeout_s) {
  GPUCLEANUP_EXPECTS(!process_is_exiting(), "gpucleanup.api.102",
                     "the process is exiting: gpucleanup makes no more driver calls");
  GPUCLEANUP_EXPECTS(std::isfinite(timeout_s) && timeout_s >= 0, "gpucleanup.api.103",
                     "timeout_s must be a finite number of seconds >= 0");
  ApiState& state = api_state().get();
  const auto started = std::chrono::steady_clock::now();
  nlohmann::json result;
  {
    // The wait for queued work and the trim: a cell that starts ends the wait at once.
    std::unique_lock lock(state.cleanup, std::chrono::seconds(1));
    GPUCLEANUP_EXPECTS(lock.owns_lock(), "gpucleanup.api.110", "a drain is already running: try again when it ends");
    state.stop_outside_drain.store(false);
    state.outside_drain.store(true);
    struct Done {
      ApiState& state;
      ~Done() { state.outside_drain.store(false); }
    } done{state};
    DrainOptions options;
    options.timeout_s = timeout_s;
    // Polled, not reported: the kernel (a cell starting, %unload_ext, exit) can
    // end the wait at once through stop_outside_drain.
    options.progress_after = kOutsideDrainPoll;
    options.progress_every = kOutsideDrainPoll;
    options.progress = [&state](const nlohmann::json&) {
      return state.stop_outside_drain.load() || process_is_exiting();
    };
    result = drain(Driver::process(), state.registry, options);
  }
  // Then the kernel's own cleanup (the frameworks' caches, and the driver's
  // pools again after them), with no lock of the library held: it calls the
  // library itself, and it needs the interpreter lock. Its queued work was
  // waited for just above: it waits for none. It can run the user's
  // finalizers, for any time: the hook runs it on a thread of the kernel's
  // and waits for it only as long as this request's time limit has left (the
  // hook's own least), then answers that it still runs.
  const double spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (std::optional<nlohmann::json> kernel_part = run_drain_hook(std::max(0.0, timeout_s - spent))) {
    result["kernel"] = std::move(*kernel_part);
  }
  return result;
}

void stop_server() noexcept {
  try {
    ApiState& state = api_state().get();
    state.stop_outside_drain.store(true);  // stop() joins the worker that may be running one
    std::unique_ptr<StatusServer> server;
    {
      std::lock_guard lock(state.server_mutex);
      server = std::move(state.server);
    }
    if (server) server->stop();
  } catch (...) {
  }
}

// The library's destructor: runs during exit() or dlclose; from here on no
// driver call is made (the driver may be unloading itself).
[[gnu::destructor]] void on_unload() {
  mark_process_exiting();
  stop_server();
}

// The state object gpucleanup_server_set_state would take for these fields (kind already checked).
nlohmann::json state_value(int kind, long long cell, long long since_ns, int device) {
  static const char* const names[] = {"idle", "running", "draining", "waiting"};
  nlohmann::json value = nlohmann::json::object();
  value["state"] = names[kind];
  value["since_ns"] = static_cast<std::int64_t>(since_ns);
  if (kind != GPUCLEANUP_STATE_IDLE) {
    value["cell"] = cell < 0 ? nlohmann::json(nullptr) : nlohmann::json(static_cast<std::int64_t>(cell));
  }
  if (kind == GPUCLEANUP_STATE_WAITING && device >= 0) value["device"] = device;
  return value;
}

}  // namespace
}  // namespace gpucleanup

using namespace gpucleanup;

extern "C" {

const char* gpucleanup_version(void) { return GPUCLEANUP_VERSION; }

int gpucleanup_abi_version(void) { return GPUCLEANUP_ABI_VERSION; }

// The list of entry points as text, made by the preprocessor from entry_points.def (its comments gone): each
// entry spelt as the file spells it, so one parser reads either.
#define GPUCLEANUP_ENTRY(result, name, parameters) "GPUCLEANUP_ENTRY(" #result ", " #name ", " #parameters ")\n"
#define GPUCLEANUP_ENTRY_ADDED(result, name, parameters) \
    "GPUCLEANUP_ENTRY_ADDED(" #result ", " #name ", " #parameters ")\n"
const char* gpucleanup_entry_points(void) {
    return
#include "gpucleanup/entry_points.def"
        ;
}
#undef GPUCLEANUP_ENTRY
#undef GPUCLEANUP_ENTRY_ADDED

void gpucleanup_free(char* json) { std::free(json); }

const char* gpucleanup_last_error(void) { return last_error.c_str(); }

gpucleanup_status gpucleanup_probe(char** json_out) {
  return guarded([&] {
    require_out(json_out);
    require_running();
    ApiState& state = api_state().get();
    auto lock = kernel_lock(state);
    hand_out(take_snapshot(usable_driver(), state.registry, SnapshotKind::probe), json_out);
  });
}

int gpucleanup_cuda_initialized(void) {
  try {
    return cuda_initialized(Driver::process());
  } catch (...) {
    return -1;
  }
}

long long gpucleanup_file_size(const char* path) {
  struct stat info {};
  if (path == nullptr || ::lstat(path, &info) != 0 || !S_ISREG(info.st_mode)) return -1;
  return static_cast<long long>(info.st_size);
}

gpucleanup_status gpucleanup_snapshot(char** json_out) {
  return guarded([&] {
    require_out(json_out);
    require_running();
    ApiState& state = api_state().get();
    auto lock = kernel_lock(state);
    hand_out(take_snapshot(usable_driver(), state.registry, SnapshotKind::snapshot), json_out);
  });
}

namespace {

using DrainEntry = nlohmann::json (*)(const Driver&, DeviceRegistry&, const DrainOptions&);

gpucleanup_status drain_call(double timeout_s, gpucleanup_progress_fn progress, void* user, char** json_out,
                             bool trim, DrainEntry entry) {
  return guarded([&] {
    require_out(json_out);
    if (!std::isfinite(timeout_s) || timeout_s < 0) {
      char shown[64];
      std::snprintf(shown, sizeof shown, "%g", timeout_s);
      fail(GPUCLEANUP_ERR_INVALID_ARGUMENT, std::string("[gpucleanup.api.103] timeout_s is ") + shown +
                                                ": pass a finite number of seconds >= 0 (0 skips the wait)");
    }
    require_running();
    ApiState& state = api_state().get();
    auto lock = kernel_lock(state);
    DrainOptions options;
    options.timeout_s = timeout_s;
    options.trim = trim;
    if (progress != nullptr) {
      options.progress = [progress, user](const nlohmann::json& report) {
        const std::string text = report.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
        return progress(text.c_str(), user) != 0;
      };
    }
    const nlohmann::json report = entry(usable_driver(), state.registry, options);
    if (entry == &after_cell) state.quiet = quiet_mark(report);
    hand_out(report, json_out);
  });
}

}  // namespace

gpucleanup_status gpucleanup_drain(double timeout_s, gpucleanup_progress_fn progress, void* user,
                                   char** json_out) {
  return drain_call(timeout_s, progress, user, json_out, true, &drain);
}

gpucleanup_status gpucleanup_settle(double timeout_s, gpucleanup_progress_fn progress, void* user,
                                    char** json_out) {
  return drain_call(timeout_s, progress, user, json_out, false, &drain);
}

gpucleanup_status gpucleanup_after_cell(double timeout_s, int trim, gpucleanup_progress_fn progress, void* user,
                                        char** json_out) {
  return drain_call(timeout_s, progress, user, json_out, trim != 0, &after_cell);
}

gpucleanup_status gpucleanup_quiet(int* quiet_out) {
  return guarded([&] {
    if (quiet_out == nullptr) fail(GPUCLEANUP_ERR_INVALID_ARGUMENT, "[gpucleanup.api.135] quiet_out is NULL: pass the address of an int");
    *quiet_out = 0;
    require_running();
    ApiState& state = api_state().get();
    auto lock = kernel_lock(state);
    if (state.quiet) *quiet_out = quiet_since(usable_driver(), state.registry, *state.quiet) ? 1 : 0;
  });
}

gpucleanup_status gpucleanup_trim(char** json_out) {
  return guarded([&] {
    require_out(json_out);
    require_running();
    ApiState& state = api_state().get();
    auto lock = kernel_lock(state);
    hand_out(trim_pools(usable_driver(), state.registry), json_out);
  });
}

gpucleanup_status gpucleanup_checkpoint_step(int pid, const char* step, unsigned int lock_timeout_ms,
                                             char** json_out) {
  return guarded([&] {
    require_out(json_out);
    require_running();
    const auto parsed = step == nullptr ? std::nullopt : parse_checkpoint_step(step);
    if (!parsed) {
      fail(GPUCLEANUP_ERR_INVALID_ARGUMENT,
           "[gpucleanup.park.605] step is not one of state, lock, checkpoint, restore, unlock, resume");
    }
    try {
      hand_out(checkpoint_step(Driver::process(), pid, *parsed, lock_timeout_ms), json_out);
    } catch (const Error& error) {
      fail(error.id() == "gpucleanup.park.603" ? GPUCLEANUP_ERR_INVALID_ARGUMENT : GPUCLEANUP_ERR_DRIVER, error.what());
    }
  });
}

gpucleanup_status gpucleanup_allow_tracer(int tracer, int* errno_out) {
  return guarded([&] {
    if (errno_out == nullptr) fail(GPUCLEANUP_ERR_INVALID_ARGUMENT, "[gpucleanup.api.136] errno_out is NULL: pass the address of an int");
    if (tracer < 0) fail(GPUCLEANUP_ERR_INVALID_ARGUMENT, "[gpucleanup.api.137] tracer must be a process id, or 0 to take the permission back");
    *errno_out = allow_tracer(static_cast<pid_t>(tracer));
  });
}

gpucleanup_status gpucleanup_hold_while_parked(int pid, const char* tids_json, unsigned int limit_ms, int report_fd,
                                               char** json_out) {
  return guarded([&] {
    require_out(json_out);
    if (pid <= 0 || pid == static_cast<int>(getpid())) {
      fail(GPUCLEANUP_ERR_INVALID_ARGUMENT, "[gpucleanup.park.606] pid " + std::to_string(pid) +
                                                " is not another process: a hold is made by a helper process");
    }
    if (limit_ms < 1 || limit_ms > 60000) {
      fail(GPUCLEANUP_ERR_INVALID_ARGUMENT, "[gpucleanup.park.607] limit_ms must be from 1 to 60000");
    }
    std::set<pid_t> tids;
    const nlohmann::json list = nlohmann::json::parse(tids_json == nullptr ? "" : tids_json, nullptr, false);
    if (!list.is_array() || list.size() > 65536) {
      fail(GPUCLEANUP_ERR_INVALID_ARGUMENT, "[gpucleanup.park.608] tids_json must be a JSON array of thread ids");
    }
    for (const auto& tid : list) {
      if (!tid.is_number_integer() || tid.get<std::int64_t>() < 1 || tid.get<std::int64_t>() > 2147483647) {
        fail(GPUCLEANUP_ERR_INVALID_ARGUMENT, "[gpucleanup.park.608] tids_json must be a JSON array of thread ids");
      }
      tids.insert(static_cast<pid_t>(tid.get<std::int64_t>()));
    }
    hand_out(hold_while_parked(static_cast<pid_t>(pid), tids, std::chrono::milliseconds(limit_ms), report_fd),
             json_out);
  });
}

gpucleanup_status gpucleanup_sigterm_cleanup(const char* paths_json) {
  return guarded([&] { set_sigterm_cleanup(paths_json); });
}

void gpucleanup_shutdown(void) {
  mark_process_exiting();
  stop_server();
}

gpucleanup_status gpucleanup_server_start(const char* config_json, char** json_out) {
  return guarded([&] {
    require_out(json_out);
    const nlohmann::json config = parse_object(config_json, "config_json");
    require_running();
    ServerConfig settings;
    try {
      settings = server_config_from_json(config);
    } catch (const Error& e) {
      fail(GPUCLEANUP_ERR_INVALID_ARGUMENT, e.what());
    }
    ApiState& state = api_state().get();
    std::lock_guard lock(state.server_mutex);
    if (state.server) {
      fail(GPUCLEANUP_ERR_SERVER,
           "[gpucleanup.api.106] the status server is already running: call gpucleanup_server_stop first");
    }
    auto server = std::make_unique<StatusServer>(std::move(settings), ServerHooks{server_snapshot, server_drain});
    nlohmann::json bound;
    try {
      bound = server->start();
    } catch (const Error& e) {
      fail(GPUCLEANUP_ERR_SERVER, e.what());
    }
    state.server = std::move(server);
    hand_out(bound, json_out);
  });
}

gpucleanup_status gpucleanup_server_stop(void) {
  return guarded([] { stop_server(); });
}

gpucleanup_status gpucleanup_server_connections(char** json_out) {
  return guarded([&] {
    require_out(json_out);
    on_server([&](StatusServer& server) { hand_out(server.connections(), json_out); });
  });
}

gpucleanup_status gpucleanup_server_set_state(const char* state_json) {
  return guarded([&] {
    nlohmann::json value = parse_object(state_json, "state_json");
    on_server([&](StatusServer& server) { server.set_state(std::move(value)); });
  });
}

gpucleanup_status gpucleanup_server_state(int kind, long long cell, long long since_ns, int device) {
  return guarded([&] {
    if (kind < GPUCLEANUP_STATE_IDLE || kind > GPUCLEANUP_STATE_WAITING) {
      fail(GPUCLEANUP_ERR_INVALID_ARGUMENT, "[gpucleanup.api.112] state is " + std::to_string(kind) +
                                                ": pass a GPUCLEANUP_STATE_* value (0 idle, 1 running, 2 draining, 3 waiting)");
    }
    nlohmann::json value = state_value(kind, cell, since_ns, device);
    on_server([&](StatusServer& server) { server.set_state(std::move(value)); });
  });
}

int gpucleanup_server_cell(int running, long long cell) {
  int parked = -1;
  const gpucleanup_status status = guarded([&] {
    // A park in place keeps its state, and is answered: "running" can no longer let one begin.
    on_server([&](StatusServer& server) { parked = server.set_cell_state(running != 0, cell); });
  });
  return status == GPUCLEANUP_OK ? parked : -1;
}

gpucleanup_status gpucleanup_server_park(const char* step, long long bytes, const char* then_json, char** json_out) {
  return guarded([&] {
    require_out(json_out);
    if (step == nullptr) {
      fail(GPUCLEANUP_ERR_INVALID_ARGUMENT, "[gpucleanup.api.133] park step is NULL: pass begin, parked, failed or resumed");
    }
    const std::optional<std::int64_t> moved = bytes < 0 ? std::nullopt : std::optional<std::int64_t>(bytes);
    std::optional<nlohmann::json> then;
    if (then_json != nullptr) then = parse_object(then_json, "then_json");
    on_server([&](StatusServer& server) {
      hand_out(server.park_step(step, moved, then ? &*then : nullptr), json_out);
    });
  });
}

int gpucleanup_server_background(int begin) {
  int answer = -1;
  const gpucleanup_status status = guarded([&] {
    on_server([&](StatusServer& server) { answer = server.background(begin == 1 ? 1 : begin == 2 ? 2 : 0); });
  });
  return status == GPUCLEANUP_OK ? answer : -1;
}

int gpucleanup_server_park_blocker(const char* why) {
  const gpucleanup_status status = guarded([&] {
    on_server([&](StatusServer& server) { server.set_park_blocker(why == nullptr ? std::string() : std::string(why)); });
  });
  return status == GPUCLEANUP_OK ? 0 : -1;
}

int gpucleanup_server_parked(void) {
  try {
    ApiState& state = api_state().get();
    gil::lock(state.server_mutex);
    std::lock_guard lock(state.server_mutex, std::adopt_lock);
    return state.server ? state.server->park_state() : 0;
  } catch (...) {
    return 0;
  }
}

void gpucleanup_set_drain_hook(gpucleanup_drain_hook_fn hook, void* user) {
  if (hook == nullptr) {
    g_drain_hook.store(nullptr);
    return;
  }
  const DrainHook* current = g_drain_hook.load();
  if (current != nullptr && current->fn == hook && current->user == user) return;
  g_drain_hook.store(new (std::nothrow) DrainHook{hook, user});
}

void gpucleanup_set_gil_hooks(gpucleanup_gil_check_fn check, gpucleanup_gil_save_fn save,
                              gpucleanup_gil_restore_fn restore) {
  gil::set_hooks(check, save, restore);
}

gpucleanup_status gpucleanup_server_publish(const char* record_json) {
  return guarded([&] {
    std::string text = checked_object_text(record_json, "record_json");
    on_server([&](StatusServer& server) { server.publish_text(std::move(text)); });
  });
}

gpucleanup_status gpucleanup_trace_start(const char* candidates_json, gpucleanup_trace_site_fn site,
                                         char** json_out) {
  return guarded([&] {
    require_out(json_out);
    require_running();
    hand_out(trace::start(parse_trace_candidates(candidates_json), site), json_out);
  });
}

gpucleanup_status gpucleanup_trace_stop(char** json_out) {
  return guarded([&] {
    require_out(json_out);
    hand_out(trace::stop(), json_out);
  });
}

void gpucleanup_trace_set_cell(long long cell) { trace::set_cell(cell); }

gpucleanup_status gpucleanup_trace_report(long long cell, char** json_out) {
  return guarded([&] {
    require_out(json_out);
    hand_out(trace::report(cell), json_out);
  });
}

}  // extern "C"
