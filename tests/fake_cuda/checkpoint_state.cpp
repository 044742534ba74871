// The driver's checkpoint calls (cuCheckpointProcess*), over a state machine
// per process that lives in files, because the calls act on *another* process:
// a park helper locks a kernel, and the kernel's own fake must then block its
// CUDA calls, as the real driver does (share/FACTS.md §10).
//
// GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR names a directory; each process that loads
// the fake with it set registers as a CUDA process in <dir>/<pid>.json:
//
//   {"state": "running",          // running | locked | checkpointed | failed
//    "errors": {"cuCheckpointProcessCheckpoint": 2},  // the call returns this,
//                                                     // state unchanged ...
//    "error_state": {"cuCheckpointProcessRestore": "checkpointed"},
//                                  // ... or, when named here, this state after it
//    "hang": ["cuCheckpointProcessRestore"],  // the call blocks while listed
//    "busy": false,                // a CUDA call in flight: a lock waits for
//                                  // it, up to timeoutMs (0: for ever), then
//                                  // CUDA_ERROR_NOT_READY with state running
//    "device_bytes": 0,            // what the process holds on its devices
//    "calls": {...},               // checkpoint calls made on this pid
//    "calls_while_parked": {...}}  // the process's own driver calls made while
//                                  // it was not running (each blocked until it was)
//
// Every read-modify-write holds flock() on the file, so helpers and the
// process itself never lose each other's changes.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "checkpoint_state.hpp"
#include "driver_exports.hpp"
#include "scenario.hpp"

namespace fake_cuda {
namespace {

using nlohmann::json;

constexpr auto kPoll = std::chrono::milliseconds(5);

std::string record_path(int pid) {
  const std::string dir = checkpoint_dir();
  return dir.empty() ? std::string() : dir + "/" + std::to_string(pid) + ".json";
}

json default_record() {
  return json{{"state", "running"},    {"errors", json::object()}, {"error_state", json::object()},
              {"hang", json::array()}, {"busy", false},            {"device_bytes", 0},
              {"calls", json::object()}, {"calls_while_parked", json::object()}};
}

// The record of `pid` under flock, changed by `change` (which returns whether
// to write it back). Returns false when the directory is not set, or the pid
// has no record and `create` is false.
template <typename Change>
bool with_record(int pid, bool create, Change change) {
  const std::string path = record_path(pid);
  if (path.empty()) return false;
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC | (create ? O_CREAT : 0), 0600);
  if (fd < 0) return false;
  while (flock(fd, LOCK_EX) != 0 && errno == EINTR) {
  }
  std::string text;
  char buffer[4096];
  ssize_t n = 0;
  while ((n = pread(fd, buffer, sizeof buffer, static_cast<off_t>(text.size()))) > 0) text.append(buffer, static_cast<std::size_t>(n));
  json record = json::parse(text, nullptr, false);
  if (!record.is_object()) record = default_record();
  const json defaults = default_record();
  for (const auto& [key, value] : defaults.items()) {
    if (!record.contains(key)) record[key] = value;
  }
  if (change(record)) {
    const std::string out = record.dump();
    if (ftruncate(fd, 0) == 0) (void)!pwrite(fd, out.data(), out.size(), 0);
  }
  flock(fd, LOCK_UN);
  close(fd);
  return true;
}

std::optional<json> read_record(int pid) {
  std::optional<json> out;
  with_record(pid, false, [&](json& record) {
    out = record;
    return false;
  });
  return out;
}

bool alive(int pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

const char* kStateNames[] = {"running", "locked", "checkpointed", "failed"};

std::optional<CUprocessState> parse_state(const json& value) {
  if (!value.is_string()) return std::nullopt;
  for (int i = 0; i < 4; ++i) {
    if (value.get<std::string>() == kStateNames[i]) return static_cast<CUprocessState>(i);
  }
  return std::nullopt;
}

bool listed(const json& list, const std::string& entry) {
  if (!list.is_array()) return false;
  for (const auto& item : list) {
    if (item.is_string() && item.get<std::string>() == entry) return true;
  }
  return false;
}

// One checkpoint call on `pid`: counted, hung while the test says so, an
// injected error, then `transition` (which sees the state and returns the
// result, changing the state when it succeeds).
template <typename Transition>
CUresult checkpoint_call(const char* entry, int pid, Transition transition) {
  {
    // The caller's own driver answers first (an injected error, not initialised).
    auto lock = lock_state();
    auto& s = state();
    ++s.counters[std::string("calls.") + entry];
    if (auto it = s.errors.find(entry); it != s.errors.end()) return it->second;
    if (!s.initialized) return CUDA_ERROR_NOT_INITIALIZED;
  }
  if (pid <= 0 || pid == static_cast<int>(getpid())) return CUDA_ERROR_INVALID_VALUE;
  if (!alive(pid) || !read_record(pid)) return CUDA_ERROR_INVALID_VALUE;  // not a CUDA process
  bool counted = false;
  for (;;) {
    bool hanging = false;
    with_record(pid, false, [&](json& record) {
      if (!counted) record["calls"][entry] = record["calls"].value(entry, 0) + 1;
      hanging = listed(record["hang"], entry);
      return !counted;
    });
    counted = true;
    if (!hanging) break;
    if (!alive(pid)) return CUDA_ERROR_INVALID_VALUE;
    std::this_thread::sleep_for(kPoll);
  }
  CUresult result = CUDA_SUCCESS;
  bool found = with_record(pid, false, [&](json& record) {
    if (record["errors"].is_object() && record["errors"].contains(entry) && record["errors"][entry].is_number_integer() &&
        record["errors"][entry].get<int>() != 0) {
      result = static_cast<CUresult>(record["errors"][entry].get<int>());
      if (record["error_state"].is_object() && record["error_state"].contains(entry)) {
        record["state"] = record["error_state"][entry];
      }
      return true;
    }
    auto current = parse_state(record["state"]);
    if (!current) current = CU_PROCESS_STATE_FAILED;
    CUprocessState next = *current;
    result = transition(*current, next, record);
    record["state"] = kStateNames[next];
    return true;
  });
  return found ? result : CUDA_ERROR_INVALID_VALUE;
}

}  // namespace

const std::string& checkpoint_dir() {
  static const std::string dir = [] {
    const char* value = std::getenv("GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR");
    return std::string(value == nullptr ? "" : value);
  }();
  return dir;
}

void register_process() {
  // A pid reused by a new process starts running, whatever its predecessor left.
  with_record(static_cast<int>(getpid()), true, [](json& record) {
    record = default_record();
    return true;
  });
}

void wait_while_parked(const char* entry) {
  if (checkpoint_dir().empty()) return;
  const int pid = static_cast<int>(getpid());
  bool counted = false;
  for (;;) {
    bool running = true;
    if (!with_record(pid, false, [&](json& record) {
          running = record.value("state", std::string("running")) == "running";
          if (running || counted) return false;
          record["calls_while_parked"][entry] = record["calls_while_parked"].value(entry, 0) + 1;
          return true;
        })) {
      return;  // not registered (the record was removed): nothing parks this process
    }
    if (running) return;
    counted = true;
    std::this_thread::sleep_for(kPoll);
  }
}

bool update_record(int pid, const std::string& patch_json, std::string& error) {
  const json patch = json::parse(patch_json, nullptr, false);
  if (!patch.is_object()) {
    error = "checkpoint patch: expected a JSON object, got " + patch_json;
    return false;
  }
  const json defaults = default_record();
  for (const auto& [key, value] : patch.items()) {
    if (!defaults.contains(key)) {
      error = "checkpoint patch: unknown key \"" + key + "\"";
      return false;
    }
    if (key == "state" && !parse_state(value)) {
      error = "checkpoint patch: state must be running, locked, checkpointed or failed, got " + value.dump();
      return false;
    }
  }
  if (!with_record(pid, true, [&](json& record) {
        record.merge_patch(patch);
        return true;
      })) {
    error = "checkpoint patch: GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR is not set, or its file cannot be written";
    return false;
  }
  return true;
}

std::string record_json(int pid) {
  const auto record = read_record(pid);
  return record ? record->dump() : std::string("null");
}

}  // namespace fake_cuda

using fake_cuda::checkpoint_call;

extern "C" {

FAKE_CUDA_EXPORT CUresult CUDAAPI cuCheckpointProcessGetState(int pid, CUprocessState* state) {
  if (state == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return checkpoint_call("cuCheckpointProcessGetState", pid,
                         [&](CUprocessState current, CUprocessState&, nlohmann::json&) {
                           *state = current;
                           return CUDA_SUCCESS;
                         });
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuCheckpointProcessLock(int pid, CUcheckpointLockArgs* args) {
  const unsigned timeout_ms = args == nullptr ? 0 : args->timeoutMs;
  // A CUDA call in flight in the target: wait for it (outside the record's lock), up to the timeout.
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const auto record = fake_cuda::read_record(pid);
    if (!record || !record->value("busy", false)) break;
    if (timeout_ms != 0 && std::chrono::steady_clock::now() - start >= std::chrono::milliseconds(timeout_ms)) {
      // Counted like any call: the lock was asked for and timed out, the process still runs.
      return checkpoint_call("cuCheckpointProcessLock", pid,
                             [](CUprocessState current, CUprocessState&, nlohmann::json&) {
                               return current == CU_PROCESS_STATE_RUNNING ? CUDA_ERROR_NOT_READY
                                                                          : CUDA_ERROR_ILLEGAL_STATE;
                             });
    }
    std::this_thread::sleep_for(fake_cuda::kPoll);
  }
  return checkpoint_call("cuCheckpointProcessLock", pid, [](CUprocessState current, CUprocessState& next, nlohmann::json&) {
    if (current != CU_PROCESS_STATE_RUNNING) return CUDA_ERROR_ILLEGAL_STATE;
    next = CU_PROCESS_STATE_LOCKED;
    return CUDA_SUCCESS;
  });
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs*) {
  return checkpoint_call("cuCheckpointProcessCheckpoint", pid,
                         [](CUprocessState current, CUprocessState& next, nlohmann::json&) {
                           if (current != CU_PROCESS_STATE_LOCKED) return CUDA_ERROR_ILLEGAL_STATE;
                           next = CU_PROCESS_STATE_CHECKPOINTED;
                           return CUDA_SUCCESS;
                         });
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs*) {
  return checkpoint_call("cuCheckpointProcessRestore", pid,
                         [](CUprocessState current, CUprocessState& next, nlohmann::json&) {
                           if (current != CU_PROCESS_STATE_CHECKPOINTED) return CUDA_ERROR_ILLEGAL_STATE;
                           next = CU_PROCESS_STATE_LOCKED;
                           return CUDA_SUCCESS;
                         });
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs*) {
  return checkpoint_call("cuCheckpointProcessUnlock", pid,
                         [](CUprocessState current, CUprocessState& next, nlohmann::json&) {
                           if (current != CU_PROCESS_STATE_LOCKED) return CUDA_ERROR_ILLEGAL_STATE;
                           next = CU_PROCESS_STATE_RUNNING;
                           return CUDA_SUCCESS;
                         });
}

FAKE_CUDA_EXPORT int fake_cuda_checkpoint_update(int pid, const char* patch_json) {
  std::string error;
  if (fake_cuda::update_record(pid, patch_json == nullptr ? "{}" : patch_json, error)) return 0;
  auto lock = fake_cuda::lock_state();
  fake_cuda::state().last_error = error;
  return -1;
}

FAKE_CUDA_EXPORT const char* fake_cuda_checkpoint_record(int pid) {
  thread_local std::string text;
  text = fake_cuda::record_json(pid);
  return text.c_str();
}

}  // extern "C"
