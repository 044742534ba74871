#include "checkpoint.hpp"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>
#include <atomic>
#include <thread>

#include "errors.hpp"
#include "thread_hold.hpp"

namespace gpucleanup {
namespace {

using json = nlohmann::json;

constexpr const char* kStepNames[] = {"state", "lock", "checkpoint", "restore", "unlock", "resume"};
constexpr int kSteps = sizeof kStepNames / sizeof kStepNames[0];

// The driver's state of `pid` as an int: newer drivers answer values (4, 5)
// that CUDA 13.0's CUprocessState does not list, and reading such a value
// through the enum is undefined (UBSan stops on it); its bytes are copied out.
static_assert(sizeof(CUprocessState) == sizeof(int), "CUprocessState is read as an int");

CUresult get_state(const Driver& driver, int pid, int& out) {
  CUprocessState raw = CU_PROCESS_STATE_RUNNING;
  const CUresult result = driver.api().cuCheckpointProcessGetState(pid, &raw);
  std::memcpy(&out, &raw, sizeof out);
  return result;
}

json state_of(const Driver& driver, int pid) {
  int state = 0;
  if (get_state(driver, pid, state) != CUDA_SUCCESS) return nullptr;
  return process_state_name(state);
}

// The identity map of every GPU this helper sees: the restore's map must name
// every GPU the kernel-mode driver sees, or it fails with
// CUDA_ERROR_INVALID_VALUE (share/FACTS.md §10). The helper runs with
// CUDA_VISIBLE_DEVICES removed (gpucleanup.park), so what it sees is the
// machine's (or the container's) every GPU, whatever the parked process saw.
// Empty when a UUID cannot be read: the restore then passes no map.
std::vector<CUcheckpointGpuPair> identity_map(const Driver& driver) {
  const EntryPoints& api = driver.api();
  std::vector<CUcheckpointGpuPair> pairs;
  int count = 0;
  if (api.cuDeviceGetUuid == nullptr || api.cuDeviceGetCount(&count) != CUDA_SUCCESS || count <= 0) return pairs;
  for (int i = 0; i < count; ++i) {
    CUdevice device = 0;
    CUuuid uuid{};
    if (api.cuDeviceGet(&device, i) != CUDA_SUCCESS || api.cuDeviceGetUuid(&uuid, device) != CUDA_SUCCESS) return {};
    CUcheckpointGpuPair pair{};
    pair.oldUuid = uuid;
    pair.newUuid = uuid;
    pairs.push_back(pair);
  }
  return pairs;
}

// GPUCLEANUP_PARK_RESTORE_MAP=none restores with no map (the driver's default);
// anything else, or unset, passes the identity map of every GPU.
bool restore_with_map() {
  const char* mode = std::getenv("GPUCLEANUP_PARK_RESTORE_MAP");
  return mode == nullptr || std::string_view(mode) != "none";
}

// Whether this driver lays CUcheckpointRestoreArgs out as the CUDA 13.0 cuda.h
// this library is built with: the layout changed in CUDA 12.9, 13.1, 13.3 and
// 13.4 (share/FACTS.md §11), so drivers of CUDA 12.9 to 13.0 only.
bool known_restore_layout(const Driver& driver) {
  const auto version = driver.version();
  return version && *version >= 12090 && *version < 13010;
}

CUresult restore(const Driver& driver, int pid, json& out) {
  std::vector<CUcheckpointGpuPair> pairs;
  const bool known = known_restore_layout(driver);
  out["restore_layout_known"] = known;
  // An unknown layout is never filled in: NULL args (the driver's default, no map) are valid with every driver.
  if (restore_with_map() && known) pairs = identity_map(driver);
  CUcheckpointRestoreArgs args;
  std::memset(&args, 0, sizeof args);  // the reserved fields must be zero
  args.gpuPairs = pairs.empty() ? nullptr : pairs.data();
  args.gpuPairsCount = static_cast<unsigned int>(pairs.size());
  out["restore_map"] = pairs.size();
  return driver.api().cuCheckpointProcessRestore(pid, pairs.empty() ? nullptr : &args);
}

// The driver's restore thread in `pid` (the one thread a hold lets run), or 0
// with the reason in `why`.
pid_t restore_thread(const Driver& driver, int pid, std::string& why) {
  const EntryPoints& api = driver.api();
  if (api.cuCheckpointProcessGetRestoreThreadId == nullptr) {
    why = "the driver has no cuCheckpointProcessGetRestoreThreadId";
    return 0;
  }
  int tid = 0;
  const CUresult result = api.cuCheckpointProcessGetRestoreThreadId(pid, &tid);
  if (result != CUDA_SUCCESS || tid <= 0) {
    why = "the driver did not name the restore thread (" + driver.error_name(result) + ")";
    return 0;
  }
  return static_cast<pid_t>(tid);
}

// The park's hold while parked (thread_hold.hpp), whose threads the resume's
// hold leaves to it: GPUCLEANUP_PARK_HELD_BY, set by gpucleanup.park for the
// resume's helper only; 0 when unset or not a pid.
pid_t held_by() {
  const char* text = std::getenv("GPUCLEANUP_PARK_HELD_BY");
  if (text == nullptr || *text < '1' || *text > '9') return 0;
  char* end = nullptr;
  const long pid = std::strtol(text, &end, 10);
  return *end == '\0' && pid > 0 && pid <= 2147483647 ? static_cast<pid_t>(pid) : 0;
}

// How long a hold may take to come (the kernel's permission, every thread's stop).
std::chrono::milliseconds hold_limit() {
  // digits only, as the extension's load note checks them (a value it calls wrong is read as 5000 here too)
  const char* text = std::getenv("GPUCLEANUP_PARK_HOLD_MS");
  char* end = nullptr;
  const long ms = text == nullptr || *text < '0' || *text > '9' ? 5000 : std::strtol(text, &end, 10);
  if (end != nullptr && *end != '\0') return std::chrono::milliseconds(5000);
  return std::chrono::milliseconds(ms > 0 && ms <= 60000 ? ms : 5000);
}

// GPUCLEANUP_PARK_HOLD=off restores without holding the threads (for the GPU
// test that shows what the hold prevents); anything else holds them.
bool hold_wanted() {
  const char* mode = std::getenv("GPUCLEANUP_PARK_HOLD");
  return mode == nullptr || std::string_view(mode) != "off";
}

}  // namespace

const char* to_string(CheckpointStep step) noexcept { return kStepNames[static_cast<int>(step)]; }

std::optional<CheckpointStep> parse_checkpoint_step(std::string_view name) noexcept {
  for (int i = 0; i < kSteps; ++i) {
    if (name == kStepNames[i]) return static_cast<CheckpointStep>(i);
  }
  return std::nullopt;
}

std::string process_state_name(int state) {
  switch (state) {
    case CU_PROCESS_STATE_RUNNING: return "running";
    case CU_PROCESS_STATE_LOCKED: return "locked";
    case CU_PROCESS_STATE_CHECKPOINTED: return "checkpointed";
    case CU_PROCESS_STATE_FAILED: return "failed";
    // Newer drivers name the moments a step is under way (not in CUDA 13.0's cuda.h).
    case 4: return "checkpointing";
    case 5: return "restoring";
    default: return "CUprocessState " + std::to_string(state);
  }
}

std::vector<std::string> missing_checkpoint_calls(const Driver& driver) {
  const EntryPoints& api = driver.api();
  std::vector<std::string> missing;
  if (api.cuCheckpointProcessGetState == nullptr) missing.emplace_back("cuCheckpointProcessGetState");
  if (api.cuCheckpointProcessLock == nullptr) missing.emplace_back("cuCheckpointProcessLock");
  if (api.cuCheckpointProcessCheckpoint == nullptr) missing.emplace_back("cuCheckpointProcessCheckpoint");
  if (api.cuCheckpointProcessRestore == nullptr) missing.emplace_back("cuCheckpointProcessRestore");
  if (api.cuCheckpointProcessUnlock == nullptr) missing.emplace_back("cuCheckpointProcessUnlock");
  return missing;
}

json checkpoint_step(const Driver& driver, int pid, CheckpointStep step, unsigned lock_timeout_ms) {
  if (!driver.usable()) {
    GPUCLEANUP_FAIL("gpucleanup.park.601",
                    (driver.message().empty() ? std::string("no usable CUDA driver") : driver.message()) +
                        ": nothing can be parked on this machine");
  }
  if (const auto missing = missing_checkpoint_calls(driver); !missing.empty()) {
    std::string names;
    for (const auto& name : missing) names += (names.empty() ? "" : ", ") + name;
    const std::string version = driver.version() ? " (CUDA " + std::to_string(*driver.version() / 1000) + "." +
                                                       std::to_string(*driver.version() % 1000 / 10) + ")"
                                                 : std::string();
    GPUCLEANUP_FAIL("gpucleanup.park.602",
                    "the CUDA driver " + driver.path() + version + " has no checkpoint calls (" + names +
                        "): parking needs a driver for CUDA 12.8 or newer (R570 or later); update the NVIDIA "
                        "driver, or leave the kernel running");
  }
  if (pid <= 0 || pid == static_cast<int>(getpid())) {
    GPUCLEANUP_FAIL("gpucleanup.park.603", "pid " + std::to_string(pid) +
                                               " is not another process: a process is parked by a helper "
                                               "process, never by itself");
  }
  // The helper's own initialisation (the restore needs it unless persistence
  // mode is on); never made in a process that gpucleanup cleans.
  using Init = CUresult(CUDAAPI*)(unsigned int);
  auto init = reinterpret_cast<Init>(driver.resolve("cuInit", 2000, "cuInit"));
  const CUresult initialised = init == nullptr ? CUDA_ERROR_NOT_FOUND : init(0);
  if (initialised != CUDA_SUCCESS) {
    GPUCLEANUP_FAIL("gpucleanup.park.604", "cuInit failed in the park helper with " + driver.error_name(initialised) +
                                               " (" + std::to_string(static_cast<int>(initialised)) +
                                               "): the driver cannot be used here; check the GPU with nvidia-smi");
  }
  const EntryPoints& api = driver.api();
  json out{{"pid", pid},
           {"step", to_string(step)},
           {"driver_version", driver.version() ? json(*driver.version()) : json(nullptr)},
           {"restore_layout_known", known_restore_layout(driver)},
           {"state_before", step == CheckpointStep::state ? json(nullptr) : state_of(driver, pid)}};
  const auto start = std::chrono::steady_clock::now();
  CUresult result = CUDA_SUCCESS;
  switch (step) {
    case CheckpointStep::state: {
      int state = 0;
      result = get_state(driver, pid, state);
      if (result == CUDA_SUCCESS) out["state_before"] = process_state_name(state);
      if (result == CUDA_SUCCESS && state == CU_PROCESS_STATE_RUNNING) {
        // the one thread a hold while parked must leave running (its list is made by the kernel, which
        // cannot ask the driver itself)
        std::string why;
        const pid_t tid = restore_thread(driver, pid, why);
        out["restore_thread"] = tid > 0 ? json(tid) : json(nullptr);
      }
      break;
    }
    case CheckpointStep::lock: {
      CUcheckpointLockArgs args{};
      args.timeoutMs = lock_timeout_ms;
      out["lock_timeout_ms"] = lock_timeout_ms;
      result = api.cuCheckpointProcessLock(pid, &args);
      break;
    }
    case CheckpointStep::checkpoint:
      result = api.cuCheckpointProcessCheckpoint(pid, nullptr);
      break;
    case CheckpointStep::restore:
      result = restore(driver, pid, out);
      break;
    case CheckpointStep::resume: {
      // Restore, then unlock, with every other thread of the process held (DESIGN rule 12).
      std::string why;
      const pid_t spare = hold_wanted() ? restore_thread(driver, pid, why) : 0;
      if (!hold_wanted()) why = "holding was turned off (GPUCLEANUP_PARK_HOLD=off)";
      std::optional<ThreadHold> hold;
      if (spare > 0) hold.emplace(static_cast<pid_t>(pid), HoldChoice{{spare}, {}, false, held_by()}, hold_limit());
      json held = hold ? hold->report() : json{{"held", false}, {"threads", 0}, {"why", why}};
      json unlock{{"ok", false}, {"result", nullptr}, {"code", nullptr}};
      // The driver's calls on a thread of their own; this thread, the tracer, watches the held threads meanwhile
      // (a shutdown's SIGTERM lets them go; a killed kernel is reaped).
      std::atomic<bool> finished{false};
      json restored;
      std::thread driver_steps([&] {
        result = restore(driver, pid, restored);
        if (result == CUDA_SUCCESS) {
          const CUresult unlocked = api.cuCheckpointProcessUnlock(pid, nullptr);
          unlock = json{{"ok", unlocked == CUDA_SUCCESS}, {"result", driver.error_name(unlocked)},
                        {"code", static_cast<int>(unlocked)}};
        }
        finished = true;
      });
      while (!finished) {
        if (hold) hold->watch();
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      driver_steps.join();
      out["restore_map"] = restored.value("restore_map", json(nullptr));
      if (hold) {
        const json after = hold->report();
        if (after.contains("released")) held["released"] = after["released"];
      }
      if (hold) hold->release();
      out["unlock"] = std::move(unlock);
      out["hold"] = std::move(held);
      break;
    }
    case CheckpointStep::unlock:
      result = api.cuCheckpointProcessUnlock(pid, nullptr);
      break;
  }
  out["seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  out["ok"] = result == CUDA_SUCCESS;
  out["code"] = static_cast<int>(result);
  out["result"] = driver.error_name(result);
  out["state"] = step == CheckpointStep::state ? out["state_before"] : state_of(driver, pid);
  return out;
}

}  // namespace gpucleanup
