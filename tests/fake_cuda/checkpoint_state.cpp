// The driver's checkpoint calls (cuCheckpointProcess*), over a state machine
// per process that lives in files, because the calls act on *another* process:
// a park helper locks a kernel, and the kernel's own fake must then block its
// CUDA calls, as the real driver does (share/FACTS.md §10).
//
// GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR names a directory; each process that loads
// the fake with it set registers as a CUDA process in <dir>/<pid>.json:
//
//   {"state": "running",          // running | locked | checkpointed | failed
//                                 // (CUprocessState 0..3), or checkpointing |
//                                 // restoring (4, 5: newer drivers' step under
//                                 // way; only a test sets them): GetState
//                                 // answers them, every other call
//                                 // CUDA_ERROR_ILLEGAL_STATE, state unchanged
//    "errors": {"cuCheckpointProcessCheckpoint": 2},  // the call returns this,
//                                                     // state unchanged ...
//    "error_state": {"cuCheckpointProcessRestore": "checkpointed"},
//                                  // ... or, when named here, this state after it
//    "hang": ["cuCheckpointProcessRestore"],  // the call blocks while listed
//    "busy": false,                // a CUDA call in flight: a lock waits for
//                                  // it, up to timeoutMs (0: for ever), then
//                                  // CUDA_ERROR_NOT_READY with state running
//    "restore_needs_full_map": false,
//                                  // true: a restore succeeds only with a GPU
//                                  // map naming every device the *caller's*
//                                  // fake exposes, each UUID (as its
//                                  // cuDeviceGetUuid gives it) mapped to
//                                  // itself; else CUDA_ERROR_INVALID_VALUE,
//                                  // state checkpointed: the rule the
//                                  // library's restore is written for
//                                  // (identity_map in native/src/checkpoint.cpp,
//                                  // share/FACTS.md §10); false keeps the
//                                  // older tests' restore with no map working
//    "restore_map": null,          // set by each restore that reaches the
//                                  // record: its args' gpuPairsCount, 0 for
//                                  // NULL args (what the helper passed)
//    "device_bytes": 0,            // what the process holds on its devices
//    "calls": {...},               // checkpoint calls made on this pid
//    "calls_while_parked": {...},  // the process's own driver calls made while
//                                  // it was not running (each blocked until it was)
//    "restore_tid": 0,             // the process's "restore thread", a thread the
//                                  // fake starts in it at registration, which
//                                  // cuCheckpointProcessGetRestoreThreadId names
//    "running_at_restore": null,   // set by each restore and unlock that reaches
//    "running_at_unlock": null}    // the record: the process's threads, the
//                                  // restore thread left out, that were not
//                                  // stopped (/proc/<pid>/task/*/stat state
//                                  // neither t nor T) as the call ran: [] when
//                                  // a hold kept the restore alone
//
// A restore whose args have a non-zero reserved byte, or pairs counted but not
// given, is CUDA_ERROR_INVALID_VALUE (after the record's injected errors),
// state unchanged: the driver documents the reserved fields as must-be-zero,
// and the fake should catch a caller that forgets to clear them.
//
// Every read-modify-write holds flock() on the file, so helpers and the
// process itself never lose each other's changes.
#include <dirent.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <thread>
#include <atomic>

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
  return json{{"state", "running"},
              {"errors", json::object()},
              {"error_state", json::object()},
              {"hang", json::array()},
              {"busy", false},
              {"restore_needs_full_map", false},
              {"restore_map", nullptr},
              {"device_bytes", 0},
              {"calls", json::object()},
              {"calls_while_parked", json::object()},
              {"restore_tid", 0},
              {"running_at_restore", nullptr},
              {"running_at_unlock", nullptr}};
}

// The threads of `pid` that are not stopped now, `spare` left out.
json running_threads(int pid, int spare) {
  json out = json::array();
  const std::string task = "/proc/" + std::to_string(pid) + "/task";
  DIR* dir = opendir(task.c_str());
  if (dir == nullptr) return out;
  while (const dirent* entry = readdir(dir)) {
    const int tid = std::atoi(entry->d_name);
    if (tid <= 0 || tid == spare) continue;
    std::ifstream stat(task + "/" + entry->d_name + "/stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const auto close = text.rfind(')');
    if (close == std::string::npos || close + 2 >= text.size()) continue;  // gone meanwhile
    const char state = text[close + 2];
    if (state != 't' && state != 'T') out.push_back(tid);
  }
  closedir(dir);
  return out;
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

// Indexed by CUprocessState. 4 and 5 are not in CUDA 13.0's cuda.h, so states
// are ints here: a value outside an enum's range must not be held in the enum.
const char* const kStateNames[] = {"running", "locked", "checkpointed", "failed", "checkpointing", "restoring"};
constexpr int kStates = sizeof kStateNames / sizeof kStateNames[0];
constexpr int kCheckpointing = 4;
constexpr int kRestoring = 5;

std::optional<int> parse_state(const json& value) {
  if (!value.is_string()) return std::nullopt;
  for (int i = 0; i < kStates; ++i) {
    if (value.get<std::string>() == kStateNames[i]) return i;
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

// One checkpoint call on `pid`: counted, hung while the test says so, `note`
// (which writes what the call was given into the record), an injected error,
// then `transition` (which sees the state and returns the result, changing the
// state when it succeeds).
template <typename Transition, typename Note>
CUresult checkpoint_call(const char* entry, int pid, Transition transition, Note note) {
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
    note(record);
    if (record["errors"].is_object() && record["errors"].contains(entry) && record["errors"][entry].is_number_integer() &&
        record["errors"][entry].get<int>() != 0) {
      result = static_cast<CUresult>(record["errors"][entry].get<int>());
      if (record["error_state"].is_object() && record["error_state"].contains(entry)) {
        record["state"] = record["error_state"][entry];
      }
      return true;
    }
    const int current = parse_state(record["state"]).value_or(CU_PROCESS_STATE_FAILED);
    int next = current;
    // A step under way (4, 5) takes no other step (assumed of the real driver,
    // not measured): only GetState answers, which is how tests see it reported.
    const bool under_way = current == kCheckpointing || current == kRestoring;
    if (under_way && std::strcmp(entry, "cuCheckpointProcessGetState") != 0) {
      result = CUDA_ERROR_ILLEGAL_STATE;
    } else {
      result = transition(current, next, record);
    }
    record["state"] = kStateNames[next];
    return true;
  });
  return found ? result : CUDA_ERROR_INVALID_VALUE;
}

template <typename Transition>
CUresult checkpoint_call(const char* entry, int pid, Transition transition) {
  return checkpoint_call(entry, pid, transition, [](json&) {});
}

// Whether `args` is a GPU map naming every device of this (the caller's) fake,
// each mapped to itself: what a record with "restore_needs_full_map" wants.
bool names_every_device(const CUcheckpointRestoreArgs* args) {
  auto lock = lock_state();
  const auto& devices = state().devices;
  if (args == nullptr || args->gpuPairs == nullptr || args->gpuPairsCount != devices.size()) return false;
  for (const auto& device : devices) {
    bool named = false;
    for (unsigned i = 0; i < args->gpuPairsCount && !named; ++i) {
      const CUcheckpointGpuPair& pair = args->gpuPairs[i];
      named = std::memcmp(&pair.oldUuid, &device->uuid_bytes, sizeof(CUuuid)) == 0 &&
              std::memcmp(&pair.newUuid, &device->uuid_bytes, sizeof(CUuuid)) == 0;
    }
    if (!named) return false;
  }
  return true;
}

// The driver wants the reserved fields zero, and pairs wherever a count is given.
bool restore_args_valid(const CUcheckpointRestoreArgs* args) {
  if (args == nullptr) return true;
  if (args->gpuPairsCount != 0 && args->gpuPairs == nullptr) return false;
  for (const char byte : args->reserved) {
    if (byte != 0) return false;
  }
  return args->reserved1 == 0;
}

}  // namespace

const std::string& checkpoint_dir() {
  static const std::string dir = [] {
    const char* value = std::getenv("GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR");
    return std::string(value == nullptr ? "" : value);
  }();
  return dir;
}

namespace {

// The process's stand-in for the driver's restore thread: started once per
// process (a forked child starts its own), it only waits.
int restore_thread_tid() {
  static pid_t started_in = 0;
  static std::atomic<int> tid{0};
  if (started_in != getpid()) {
    started_in = getpid();
    tid = 0;
    std::thread([] {
      tid = static_cast<int>(syscall(SYS_gettid));
      for (;;) pause();
    }).detach();
    while (tid.load() == 0) std::this_thread::yield();
  }
  return tid.load();
}

}  // namespace

void register_process() {
  // A pid reused by a new process starts running, whatever its predecessor left.
  const int restore_tid = restore_thread_tid();
  with_record(static_cast<int>(getpid()), true, [&](json& record) {
    record = default_record();
    record["restore_tid"] = restore_tid;
    return true;
  });
}

// Read without the record's lock once the call is counted: a thread held
// (stopped by a park helper's hold) while it owned the flock would stop the
// helper's restore; a torn read fails to parse and is read again.
std::optional<std::string> unlocked_state(int pid) {
  std::ifstream file(record_path(pid));
  if (!file) return std::nullopt;
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const json record = json::parse(text, nullptr, false);
  if (!record.is_object()) return std::string("?");
  return record.value("state", std::string("running"));
}

void wait_while_parked(const char* entry) {
  if (checkpoint_dir().empty()) return;
  const int pid = static_cast<int>(getpid());
  // Running (the usual case) is read without the record's lock: a thread a park's hold stops while it owned the
  // flock would stop every helper step, which takes that flock too.
  if (const auto now = unlocked_state(pid); now && *now == "running") return;
  bool running = true;
  if (!with_record(pid, false, [&](json& record) {
        running = record.value("state", std::string("running")) == "running";
        if (running) return false;
        record["calls_while_parked"][entry] = record["calls_while_parked"].value(entry, 0) + 1;
        return true;
      })) {
    return;  // not registered (the record was removed): nothing parks this process
  }
  while (!running) {
    std::this_thread::sleep_for(kPoll);
    const auto state = unlocked_state(pid);
    if (!state) return;  // the record was removed
    running = *state == "running";
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
      error = "checkpoint patch: state must be running, locked, checkpointed, failed, checkpointing or restoring, "
              "got " + value.dump();
      return false;
    }
    if (key == "restore_needs_full_map" && !value.is_boolean()) {
      error = "checkpoint patch: restore_needs_full_map must be true or false, got " + value.dump();
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
  return checkpoint_call("cuCheckpointProcessGetState", pid, [&](int current, int&, nlohmann::json&) {
    // Copied as bytes: 4 and 5 are outside the enum of CUDA 13.0's cuda.h.
    std::memcpy(state, &current, sizeof *state);
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
                             [](int current, int&, nlohmann::json&) {
                               return current == CU_PROCESS_STATE_RUNNING ? CUDA_ERROR_NOT_READY
                                                                          : CUDA_ERROR_ILLEGAL_STATE;
                             });
    }
    std::this_thread::sleep_for(fake_cuda::kPoll);
  }
  return checkpoint_call("cuCheckpointProcessLock", pid, [](int current, int& next, nlohmann::json&) {
    if (current != CU_PROCESS_STATE_RUNNING) return CUDA_ERROR_ILLEGAL_STATE;
    next = CU_PROCESS_STATE_LOCKED;
    return CUDA_SUCCESS;
  });
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs*) {
  return checkpoint_call("cuCheckpointProcessCheckpoint", pid, [](int current, int& next, nlohmann::json&) {
    if (current != CU_PROCESS_STATE_LOCKED) return CUDA_ERROR_ILLEGAL_STATE;
    next = CU_PROCESS_STATE_CHECKPOINTED;
    return CUDA_SUCCESS;
  });
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs* args) {
  const bool valid = fake_cuda::restore_args_valid(args);
  // Read before the record's lock: the caller's device list has a lock of its own.
  const bool full_map = fake_cuda::names_every_device(args);
  const unsigned pairs = args == nullptr ? 0 : args->gpuPairsCount;
  return checkpoint_call(
      "cuCheckpointProcessRestore", pid,
      [&](int current, int& next, nlohmann::json& record) {
        if (!valid) return CUDA_ERROR_INVALID_VALUE;
        if (current != CU_PROCESS_STATE_CHECKPOINTED) return CUDA_ERROR_ILLEGAL_STATE;
        const auto& needs = record["restore_needs_full_map"];
        if (needs.is_boolean() && needs.get<bool>() && !full_map) return CUDA_ERROR_INVALID_VALUE;
        next = CU_PROCESS_STATE_LOCKED;
        return CUDA_SUCCESS;
      },
      [&](nlohmann::json& record) {
        record["restore_map"] = pairs;
        record["running_at_restore"] = fake_cuda::running_threads(pid, record.value("restore_tid", 0));
      });
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs*) {
  return checkpoint_call(
      "cuCheckpointProcessUnlock", pid,
      [](int current, int& next, nlohmann::json&) {
        if (current != CU_PROCESS_STATE_LOCKED) return CUDA_ERROR_ILLEGAL_STATE;
        next = CU_PROCESS_STATE_RUNNING;
        return CUDA_SUCCESS;
      },
      [&](nlohmann::json& record) {
        record["running_at_unlock"] = fake_cuda::running_threads(pid, record.value("restore_tid", 0));
      });
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuCheckpointProcessGetRestoreThreadId(int pid, int* tid) {
  if (tid == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return checkpoint_call("cuCheckpointProcessGetRestoreThreadId", pid, [&](int, int&, nlohmann::json& record) {
    *tid = record.value("restore_tid", 0);
    return *tid > 0 ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
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
