// The fake driver's entry points: the prototypes of cuda.h over the scripted
// state of scenario.hpp, with the behaviour measured on real drivers
// (share/FACTS.md §1 and §7).
//
// Every entry point begins with a Call: it takes the state's lock, counts the
// call, and answers for the driver as a whole (an injected error, then "not
// initialised") before the entry point looks at its arguments.
#include <chrono>
#include <cstring>
#include <string>

#include "checkpoint_state.hpp"
#include "driver_exports.hpp"
#include "scenario.hpp"

namespace fake_cuda {
namespace {

class Call {
 public:
  // A process that a park helper has locked or checkpointed waits here, before
  // taking the state's lock, until it runs again (checkpoint_state.cpp).
  explicit Call(const char* entry)
      : lock_((wait_while_parked(entry), lock_state())), s_(fake_cuda::state()), entry_(entry) {
    ++s_.counters[std::string("calls.") + entry];
    thread_contexts(s_);  // the first thread to call finds the scenario's current context
  }

  State& state() { return s_; }
  std::unique_lock<std::mutex>& lock() { return lock_; }

  // What the driver answers before looking at the arguments, or CUDA_SUCCESS:
  // an error injected for this entry point (globally or on `device`, the
  // device the call is about when there is one), then CUDA_ERROR_NOT_INITIALIZED.
  CUresult refuse(const Device* device, bool needs_init = true) const {
    if (auto it = s_.errors.find(entry_); it != s_.errors.end()) return it->second;
    if (device != nullptr) {
      if (auto it = device->errors.find(entry_); it != device->errors.end()) return it->second;
    }
    if (needs_init && !s_.initialized) return CUDA_ERROR_NOT_INITIALIZED;
    return CUDA_SUCCESS;
  }

  // The context current to the calling thread, or null.
  Context* current() {
    auto& frames = thread_contexts(s_);
    return frames.empty() ? nullptr : frames.back().context;
  }

  // The current context when it can be used: a primary context whose last
  // reference was released is destroyed, as on a real driver.
  Context* usable_current() {
    Context* context = current();
    if (context == nullptr || context->destroyed) return nullptr;
    if (context->primary && !s_.device(context->device)->primary_active()) return nullptr;
    return context;
  }

  Device* device_of(const Context* context) { return context == nullptr ? nullptr : s_.device(context->device); }

  // The current context is a primary context destroyed by a reset.
  bool current_destroyed() {
    Context* context = current();
    return context != nullptr && context->destroyed;
  }

 private:
  std::unique_lock<std::mutex> lock_;
  State& s_;
  std::string entry_;
};

// Waits as long as the device's scripted synchronize takes. The lock is
// released while waiting, so the control API (and fake_cuda_release_sync)
// stays usable. Returns false when the scenario was replaced meanwhile.
bool wait_for_queued_work(Call& call, Device& device) {
  State& s = call.state();
  const auto generation = s.generation;
  const auto start = std::chrono::steady_clock::now();
  bool waiting = false;
  for (;;) {
    if (s.generation != generation) return false;
    if (s.sync_released || device.sync_seconds == 0) break;
    if (!waiting) {
      ++s.counters["syncs_in_flight"];
      waiting = true;
    }
    if (device.sync_seconds < 0) {
      s.sync_cv.wait(call.lock());
      continue;
    }
    const auto deadline = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                      std::chrono::duration<double>(device.sync_seconds));
    if (std::chrono::steady_clock::now() >= deadline) break;
    s.sync_cv.wait_until(call.lock(), deadline);
  }
  if (waiting) --s.counters["syncs_in_flight"];
  return true;
}

}  // namespace
}  // namespace fake_cuda

using fake_cuda::Call;
using fake_cuda::Context;
using fake_cuda::Device;
using fake_cuda::Pool;

extern "C" {

FAKE_CUDA_EXPORT CUresult CUDAAPI cuInit(unsigned int flags) {
  Call call("cuInit");
  auto& s = call.state();
  ++s.counters["cuInit"];
  if (auto refused = call.refuse(nullptr, /*needs_init=*/false)) return refused;
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (s.devices.empty()) return CUDA_ERROR_NO_DEVICE;
  // From now on the process is a CUDA process that a park helper can act on.
  if (!s.initialized && !fake_cuda::checkpoint_dir().empty()) fake_cuda::register_process();
  s.initialized = true;
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuDriverGetVersion(int* driverVersion) {
  Call call("cuDriverGetVersion");
  if (auto refused = call.refuse(nullptr, /*needs_init=*/false)) return refused;
  if (driverVersion == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *driverVersion = call.state().driver_version;
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuDeviceGetCount(int* count) {
  Call call("cuDeviceGetCount");
  if (auto refused = call.refuse(nullptr)) return refused;
  if (count == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *count = static_cast<int>(call.state().devices.size());
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuDeviceGet(CUdevice* device, int ordinal) {
  Call call("cuDeviceGet");
  if (auto refused = call.refuse(call.state().device(ordinal))) return refused;
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (call.state().device(ordinal) == nullptr) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuDeviceGetName(char* name, int len, CUdevice dev) {
  Call call("cuDeviceGetName");
  Device* device = call.state().device(dev);
  if (auto refused = call.refuse(device)) return refused;
  if (name == nullptr || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (device == nullptr) return CUDA_ERROR_INVALID_DEVICE;
  // Truncated to fit and always terminated, as the driver does.
  const std::size_t n = std::min(device->name.size(), static_cast<std::size_t>(len) - 1);
  std::memcpy(name, device->name.data(), n);
  name[n] = '\0';
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev) {
  Call call("cuDeviceTotalMem");
  Device* device = call.state().device(dev);
  if (auto refused = call.refuse(device)) return refused;
  if (bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (device == nullptr) return CUDA_ERROR_INVALID_DEVICE;
  *bytes = device->total;
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuDeviceGetUuid_v2(CUuuid* uuid, CUdevice dev) {
  Call call("cuDeviceGetUuid");
  Device* device = call.state().device(dev);
  if (auto refused = call.refuse(device)) return refused;
  if (uuid == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (device == nullptr) return CUDA_ERROR_INVALID_DEVICE;
  *uuid = device->uuid_bytes;
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuDeviceGetAttribute(int* pi, CUdevice_attribute attrib, CUdevice dev) {
  Call call("cuDeviceGetAttribute");
  Device* device = call.state().device(dev);
  if (auto refused = call.refuse(device)) return refused;
  if (pi == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (device == nullptr) return CUDA_ERROR_INVALID_DEVICE;
  // Only the attribute gpucleanup asks about is scripted; the rest read 0.
  *pi = attrib == CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED ? (device->pools_supported ? 1 : 0) : 0;
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active) {
  Call call("cuDevicePrimaryCtxGetState");
  Device* device = call.state().device(dev);
  if (auto refused = call.refuse(device)) return refused;
  if (flags == nullptr || active == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (device == nullptr) return CUDA_ERROR_INVALID_DEVICE;
  *flags = 0;
  *active = device->primary_active() ? 1 : 0;
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* pctx, CUdevice dev) {
  Call call("cuDevicePrimaryCtxRetain");
  auto& s = call.state();
  Device* device = s.device(dev);
  if (auto refused = call.refuse(device)) return refused;
  if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (device == nullptr) return CUDA_ERROR_INVALID_DEVICE;
  // Retaining an inactive primary context creates it: what "never create a context" forbids.
  if (!device->primary_active()) ++s.counters["contexts_created"];
  ++device->retained;
  ++s.counters["retained"];
  *pctx = reinterpret_cast<CUcontext>(device->primary_context.get());
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  Call call("cuDevicePrimaryCtxRelease");
  auto& s = call.state();
  Device* device = s.device(dev);
  if (auto refused = call.refuse(device)) return refused;
  if (device == nullptr) return CUDA_ERROR_INVALID_DEVICE;
  // The scenario's own reference (primary_active) belongs to someone else:
  // releasing more than was retained here is the documented error.
  if (device->retained == 0) return CUDA_ERROR_INVALID_CONTEXT;
  --device->retained;
  --s.counters["retained"];
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuCtxGetCurrent(CUcontext* pctx) {
  Call call("cuCtxGetCurrent");
  Context* context = call.current();
  if (auto refused = call.refuse(call.device_of(context))) return refused;
  if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *pctx = reinterpret_cast<CUcontext>(context);  // NULL and success when nothing is bound
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuCtxGetDevice(CUdevice* device) {
  Call call("cuCtxGetDevice");
  // A destroyed context still names its device (as on a real driver).
  Context* context = call.current_destroyed() ? call.current() : call.usable_current();
  if (auto refused = call.refuse(call.device_of(context))) return refused;
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (context == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  *device = context->device;
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuCtxPushCurrent_v2(CUcontext ctx) {
  Call call("cuCtxPushCurrent");
  auto& s = call.state();
  Context* context = s.find_context(ctx);
  if (auto refused = call.refuse(call.device_of(context))) return refused;
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (context == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  // A destroyed primary context's stale handle is pushed as it is; calls made in it fail.
  if (context->primary && !context->destroyed && !s.device(context->device)->primary_active()) {
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  fake_cuda::thread_contexts(s).push_back({context, true});
  ++s.counters["pushed"];
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuCtxPopCurrent_v2(CUcontext* pctx) {
  Call call("cuCtxPopCurrent");
  auto& s = call.state();
  auto& frames = fake_cuda::thread_contexts(s);
  if (auto refused = call.refuse(call.device_of(call.current()))) return refused;
  if (frames.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  const auto frame = frames.back();
  frames.pop_back();
  if (frame.pushed) --s.counters["pushed"];
  if (pctx != nullptr) *pctx = reinterpret_cast<CUcontext>(frame.context);
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuCtxSynchronize(void) {
  Call call("cuCtxSynchronize");
  Context* context = call.usable_current();
  Device* device = call.device_of(context);
  if (auto refused = call.refuse(device)) return refused;
  if (call.current_destroyed()) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  if (context == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  if (device->sticky_error != CUDA_SUCCESS) return device->sticky_error;
  if (!fake_cuda::wait_for_queued_work(call, *device)) return CUDA_SUCCESS;  // scenario replaced meanwhile
  // The host has now observed every asynchronous free on this device.
  for (Pool* pool : {device->default_pool.get(), device->current_pool.get()}) {
    if (pool != nullptr) pool->pending_free = 0;
  }
  return CUDA_SUCCESS;
}

// Events: enough for "is anything queued in this context now?" (cuCtxRecordEvent then cuEventQuery). A device
// has queued work while its scripted synchronize would wait (sync_seconds != 0 and not released).
namespace fake_cuda {
namespace {
bool has_queued_work(const State& s, const Device& device) { return !s.sync_released && device.sync_seconds != 0; }

Event* find_event(State& s, CUevent handle) {
  const auto it = s.events.find(handle);
  return it == s.events.end() ? nullptr : it->second.get();
}
}  // namespace
}  // namespace fake_cuda

FAKE_CUDA_EXPORT CUresult CUDAAPI cuEventCreate(CUevent* event, unsigned int /*flags*/) {
  Call call("cuEventCreate");
  auto& s = call.state();
  Context* context = call.usable_current();
  Device* device = call.device_of(context);
  if (auto refused = call.refuse(device)) return refused;
  if (call.current_destroyed()) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  if (context == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  if (event == nullptr) return CUDA_ERROR_INVALID_VALUE;
  auto made = std::make_unique<fake_cuda::Event>();
  made->generation = s.generation;
  made->device = context->device;
  *event = reinterpret_cast<CUevent>(made.get());
  s.events[made.get()] = std::move(made);
  ++s.counters["events"];  // made and not yet destroyed
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuEventDestroy_v2(CUevent event) {
  Call call("cuEventDestroy");
  auto& s = call.state();
  if (auto refused = call.refuse(nullptr)) return refused;
  if (s.events.erase(event) == 0) return CUDA_ERROR_INVALID_HANDLE;
  --s.counters["events"];
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuCtxRecordEvent(CUcontext ctx, CUevent handle) {
  Call call("cuCtxRecordEvent");
  auto& s = call.state();
  Context* context = s.find_context(ctx);
  Device* device = call.device_of(context);
  if (auto refused = call.refuse(device)) return refused;
  if (context == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  if (context->destroyed) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  fake_cuda::Event* event = fake_cuda::find_event(s, handle);
  if (event == nullptr || event->generation != s.generation || event->device != context->device) {
    return CUDA_ERROR_INVALID_HANDLE;
  }
  if (device->sticky_error != CUDA_SUCCESS) return device->sticky_error;
  event->busy = fake_cuda::has_queued_work(s, *device);
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuEventQuery(CUevent handle) {
  Call call("cuEventQuery");
  auto& s = call.state();
  fake_cuda::Event* event = fake_cuda::find_event(s, handle);
  Device* device = event != nullptr && event->generation == s.generation ? s.device(event->device) : nullptr;
  if (auto refused = call.refuse(device)) return refused;
  if (device == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (device->sticky_error != CUDA_SUCCESS) return device->sticky_error;
  return event->busy && fake_cuda::has_queued_work(s, *device) ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuMemGetInfo_v2(size_t* free, size_t* total) {
  Call call("cuMemGetInfo");
  Context* context = call.usable_current();
  Device* device = call.device_of(context);
  if (auto refused = call.refuse(device)) return refused;
  if (call.current_destroyed()) return CUDA_ERROR_CONTEXT_IS_DESTROYED;  // 709, after a reset
  if (context == nullptr) return CUDA_ERROR_INVALID_CONTEXT;  // 201, share/FACTS.md §7.4
  if (device->sticky_error != CUDA_SUCCESS) return device->sticky_error;
  if (free == nullptr || total == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *free = device->free;
  *total = device->total;
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuDeviceGetDefaultMemPool(CUmemoryPool* pool_out, CUdevice dev) {
  Call call("cuDeviceGetDefaultMemPool");
  Device* device = call.state().device(dev);
  if (auto refused = call.refuse(device)) return refused;
  if (pool_out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (device == nullptr) return CUDA_ERROR_INVALID_DEVICE;
  if (!device->pools_supported) return CUDA_ERROR_NOT_SUPPORTED;
  *pool_out = reinterpret_cast<CUmemoryPool>(device->default_pool.get());
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuDeviceGetMemPool(CUmemoryPool* pool_out, CUdevice dev) {
  Call call("cuDeviceGetMemPool");
  Device* device = call.state().device(dev);
  if (auto refused = call.refuse(device)) return refused;
  if (pool_out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (device == nullptr) return CUDA_ERROR_INVALID_DEVICE;
  if (!device->pools_supported) return CUDA_ERROR_NOT_SUPPORTED;
  *pool_out = reinterpret_cast<CUmemoryPool>(&device->pool_in_use());
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuMemPoolTrimTo(CUmemoryPool handle, size_t minBytesToKeep) {
  Call call("cuMemPoolTrimTo");
  auto& s = call.state();
  Pool* pool = s.find_pool(handle);
  Device* device = pool == nullptr ? nullptr : s.device(pool->device);
  if (auto refused = call.refuse(device)) return refused;
  if (pool == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!device->pools_supported) return CUDA_ERROR_NOT_SUPPORTED;
  // Memory backing outstanding allocations, including frees not yet observed
  // by a synchronize, cannot go back to the OS.
  const std::uint64_t keep = std::max<std::uint64_t>(pool->outstanding(), minBytesToKeep);
  if (pool->reserved > keep) {
    device->free += pool->reserved - keep;
    pool->reserved = keep;
  }
  return CUDA_SUCCESS;
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuMemPoolGetAttribute(CUmemoryPool handle, CUmemPool_attribute attr, void* value) {
  Call call("cuMemPoolGetAttribute");
  auto& s = call.state();
  Pool* pool = s.find_pool(handle);
  Device* device = pool == nullptr ? nullptr : s.device(pool->device);
  if (auto refused = call.refuse(device)) return refused;
  if (pool == nullptr || value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!device->pools_supported) return CUDA_ERROR_NOT_SUPPORTED;
  auto* bytes = static_cast<cuuint64_t*>(value);
  switch (attr) {
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *bytes = pool->reserved; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *bytes = pool->reserved_high; break;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *bytes = pool->outstanding(); break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *bytes = pool->used_high; break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *bytes = 0; break;  // the driver's default
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: *static_cast<int*>(value) = 1; break;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

}  // extern "C"
