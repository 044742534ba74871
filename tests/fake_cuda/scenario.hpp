// The fake driver's scripted state (the "scenario" of fake_cuda_control.h) and
// its JSON form.
//
// One process-wide State, guarded by one mutex. Handles given to callers
// (CUcontext, CUmemoryPool) are addresses of Context and Pool objects owned
// here; objects of a replaced scenario are retired, never freed, so a stale
// handle can be recognised as stale and never aliases a new object.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "driver_exports.hpp"

namespace fake_cuda {

// A malformed scenario or patch; the message says where and why.
class ScenarioError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Pool {
  int device = 0;
  std::uint64_t reserved = 0;
  std::uint64_t used = 0;          // held by live allocations
  std::uint64_t pending_free = 0;  // freed asynchronously, not yet observed by a synchronize
  std::uint64_t reserved_high = 0;
  std::uint64_t used_high = 0;

  // What the driver reports as USED_MEM_CURRENT and cannot trim: frees whose
  // completion the host has not observed still count as outstanding.
  std::uint64_t outstanding() const { return used + pending_free; }
  void note_high_marks();
};

struct Context {
  int device = 0;
  bool primary = true;
  // A primary context destroyed by fake_cuda_reset_primary_context: its handle
  // is stale (push refuses it, calls made in it find no context).
  bool destroyed = false;
};

// An event (cuEventCreate): what the context had queued when it was last recorded.
struct Event {
  std::uint64_t generation = 0;  // the scenario it was made in: an older one's device is gone
  int device = 0;
  bool busy = false;  // recorded (cuCtxRecordEvent) while the device had queued work (sync_seconds != 0)
};

struct Device {
  int index = 0;
  std::string name;
  std::string uuid;  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", lower case
  CUuuid uuid_bytes{};
  std::uint64_t total = 0;
  std::uint64_t free = 0;
  // The scenario's primary_active: a reference held by someone outside the
  // code under test (a framework). Retains by the code under test come on top.
  bool external_primary_ref = false;
  int retained = 0;
  bool pools_supported = true;
  // Replaced by fake_cuda_reset_primary_context (cuDevicePrimaryCtxReset by a
  // framework): the new context has another handle, the old one is retired.
  std::unique_ptr<Context> primary_context;
  std::unique_ptr<Pool> default_pool;
  std::unique_ptr<Pool> current_pool;  // null: the default pool is current
  double sync_seconds = 0;             // negative: hang until released
  CUresult sticky_error = CUDA_SUCCESS;
  std::map<std::string, CUresult> errors;

  bool primary_active() const { return external_primary_ref || retained > 0; }
  Pool& pool_in_use() { return current_pool ? *current_pool : *default_pool; }
};

struct State {
  std::mutex mutex;
  std::condition_variable sync_cv;  // wakes synchronizes on release, reset and update

  // Bumped by every reset: thread context stacks and waiting synchronizes of
  // an older generation belong to a scenario that no longer exists.
  std::uint64_t generation = 0;
  bool loaded = false;

  bool initialized = true;
  int driver_version = 13000;
  std::set<std::string> missing;
  std::map<std::string, CUresult> errors;
  std::vector<std::unique_ptr<Device>> devices;

  // The scenario's current_context: bottom of the context stack of the first
  // thread to use the fake after the scenario was loaded.
  Context* base_context = nullptr;
  std::unique_ptr<Context> base_context_storage;  // when it is not a primary context
  bool base_context_claimed = false;

  bool sync_released = false;
  std::map<std::string, long long> counters;

  std::string state_json;
  std::string last_error;

  std::vector<std::unique_ptr<Device>> retired_devices;
  std::vector<std::unique_ptr<Context>> retired_contexts;
  // Events made and not yet destroyed, kept across resets (a handle stays valid until destroyed).
  std::map<const void*, std::unique_ptr<Event>> events;
  // Primary contexts of this scenario destroyed by reset_primary_context: their
  // handles can still be pushed (as on a real driver), calls in them fail.
  std::vector<Context*> destroyed_primaries;
  std::vector<std::unique_ptr<Pool>> retired_pools;

  Device* device(CUdevice ordinal) {
    if (ordinal < 0 || static_cast<std::size_t>(ordinal) >= devices.size()) return nullptr;
    return devices[static_cast<std::size_t>(ordinal)].get();
  }
  Context* find_context(CUcontext handle);
  Pool* find_pool(CUmemoryPool handle);
};

// The process-wide state. Never destroyed: a watchdog thread abandoned in a
// hanging cuCtxSynchronize may still wait on its condition variable at exit.
State& state();

// Locks the state, loading GPUCLEANUP_FAKE_CUDA_SCENARIO (or the default
// scenario) on first use.
std::unique_lock<std::mutex> lock_state();

// One entry of a thread's context stack; `pushed` tells a cuCtxPushCurrent
// apart from the scenario's current_context, which nobody pushed.
struct StackFrame {
  Context* context;
  bool pushed;
};

// The calling thread's context stack (call with the lock held). A stack of an
// older scenario is dropped; the first thread to ask after a scenario is
// loaded finds the scenario's current_context at the bottom.
std::vector<StackFrame>& thread_contexts(State& s);

// The entry point names that counters ("calls.<name>"), "errors" and
// "missing" accept: entry_points.inc plus cuInit and cuGetProcAddress.
const std::set<std::string>& entry_names();

// Replace the whole scenario (counters zeroed, hanging syncs released) or
// merge a patch into it. Both throw ScenarioError and leave the state as it
// was when the JSON is malformed.
void reset(State& s, const std::string& scenario_json);
void update(State& s, const std::string& patch_json);

// cuDevicePrimaryCtxReset as a framework calls it, as measured on a real
// driver (580.159.04, after CuPy had retained the context): the device's
// primary context is destroyed and the device is inactive afterwards
// (cuDevicePrimaryCtxGetState answers 0) until someone retains it again, which
// makes a new context with another handle. Every reference is void (a later
// release of one answers CUDA_ERROR_INVALID_CONTEXT). A thread that had it
// current still has the stale handle current: cuCtxGetCurrent and
// cuCtxGetDevice answer for it, cuMemGetInfo and cuCtxSynchronize in it fail
// with CUDA_ERROR_CONTEXT_IS_DESTROYED, and the stale handle can still be
// pushed. Throws ScenarioError for a device that does not exist.
void reset_primary_context(State& s, int device);

// Scenario-shaped state plus "counters".
std::string dump(const State& s);

}  // namespace fake_cuda
