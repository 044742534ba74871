#include "devices.hpp"

#include <algorithm>
#include <cstdio>

#include "process_state.hpp"

namespace gpucleanup {
namespace {

std::string format_uuid(const CUuuid& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  char text[48];
  std::snprintf(text, sizeof text,
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
                b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
  return text;
}

Probe stop_here(DriverState state, std::string message) {
  Probe p;
  p.state = state;
  p.message = std::move(message);
  return p;
}

std::string failed_with(const Driver& driver, const char* call, CUresult code) {
  return std::string(call) + " failed with " + driver.error_name(code) + " (" +
         std::to_string(static_cast<int>(code)) + ")";
}

}  // namespace

const char* to_string(DriverState state) noexcept {
  switch (state) {
    case DriverState::no_driver: return "no_driver";
    case DriverState::not_initialized: return "not_initialized";
    case DriverState::ready: return "ready";
    case DriverState::unusable: return "unusable";
    case DriverState::exiting: return "exiting";
  }
  return "unusable";
}

ContextLease::~ContextLease() {
  if (process_is_exiting()) return;
  driver_.api().cuDevicePrimaryCtxRelease(device_);
}

int cuda_initialized(const Driver& driver) noexcept {
  if (process_is_exiting() || forked_after_driver_init() || !driver.loaded() || !driver.usable()) return -1;
  int count = 0;
  const CUresult counted = driver.api().cuDeviceGetCount(&count);
  if (counted == CUDA_ERROR_NOT_INITIALIZED) return 0;
  return counted == CUDA_SUCCESS ? 1 : -1;
}


Probe probe(const Driver& driver, const RetainIf& retain, const Enumeration* known) {
  if (process_is_exiting()) {
    return stop_here(DriverState::exiting,
                     "[gpucleanup.api.102] the process is exiting: gpucleanup makes no more driver calls");
  }
  if (forked_after_driver_init()) {
    return stop_here(DriverState::unusable,
                     "[gpucleanup.driver.105] CUDA was initialised before this process forked: CUDA cannot be "
                     "used in a forked child");
  }
  if (!driver.loaded()) return stop_here(DriverState::no_driver, driver.message());
  if (!driver.usable()) return stop_here(DriverState::unusable, driver.message());

  const EntryPoints& api = driver.api();
  // cuDeviceGetCount before anything else: it is the one call that tells
  // "nobody initialised CUDA" apart without initialising it (never cuInit).
  int count = 0;
  CUresult counted = CUDA_SUCCESS;
  if (known != nullptr) {
    count = static_cast<int>(known->size());  // an earlier probe found the driver ready: it stays initialised
  } else {
    counted = api.cuDeviceGetCount(&count);
  }
  if (counted == CUDA_ERROR_NOT_INITIALIZED) {
    return stop_here(DriverState::not_initialized,
                     "[gpucleanup.driver.103] nothing in this process has initialised CUDA: there is nothing to clean");
  }
  if (counted == CUDA_ERROR_DEINITIALIZED) {
    return stop_here(DriverState::exiting,
                     "[gpucleanup.driver.106] the CUDA driver is shutting down (CUDA_ERROR_DEINITIALIZED): nothing "
                     "can be cleaned any more");
  }
  if (counted != CUDA_SUCCESS) {
    return stop_here(DriverState::unusable, "[gpucleanup.driver.104] " +
                                                failed_with(driver, "cuDeviceGetCount", counted) +
                                                ": the driver cannot be used; check the GPU with nvidia-smi");
  }
  note_driver_initialized();

  Probe p;
  p.state = DriverState::ready;
  // A context current to this thread marks its device in use even when the
  // device's primary context is inactive (PyCUDA's autoinit makes such a one).
  CUcontext current = nullptr;
  CUdevice current_device = -1;
  bool device_asked = false;  // with `known`, cuCtxGetDevice waits until no retained primary context is current
  if (api.cuCtxGetCurrent(&current) != CUDA_SUCCESS) current = nullptr;
  if (current != nullptr && known == nullptr) {
    device_asked = true;
    if (api.cuCtxGetDevice(&current_device) != CUDA_SUCCESS) current = nullptr;
  }
  for (int i = 0; i < count; ++i) {
    DeviceUse use;
    use.index = i;
    use.key = "index:" + std::to_string(i);
    if (known != nullptr) {
      use.device = (*known)[i].device;
      use.uuid = (*known)[i].uuid;
      if (use.uuid) use.key = *use.uuid;
    } else if (const CUresult got = api.cuDeviceGet(&use.device, i); got != CUDA_SUCCESS) {
      use.failure = CallFailure{"cuDeviceGet", got};
      p.devices.push_back(std::move(use));
      continue;
    } else if (api.cuDeviceGetUuid != nullptr) {
      CUuuid uuid{};
      if (api.cuDeviceGetUuid(&uuid, use.device) == CUDA_SUCCESS) {
        use.uuid = format_uuid(uuid);
        use.key = *use.uuid;
      }
    }
    unsigned flags = 0;
    int active = 0;  // must start at 0: drivers have left garbage here for inactive contexts
    if (const CUresult state = api.cuDevicePrimaryCtxGetState(use.device, &flags, &active); state != CUDA_SUCCESS) {
      use.failure = CallFailure{"cuDevicePrimaryCtxGetState", state};
    } else if (active != 0) {
      use.context = ContextKind::primary;
      // At once after the state said active: a retain of an inactive primary
      // context would create one.
      if (retain && retain(use)) {
        CUcontext context = nullptr;
        if (const CUresult retained = api.cuDevicePrimaryCtxRetain(&context, use.device); retained != CUDA_SUCCESS) {
          use.failure = CallFailure{"cuDevicePrimaryCtxRetain", retained};
        } else {
          use.lease = std::make_shared<const ContextLease>(driver, use.device, context);
          use.lease_is_current = current != nullptr && context == current;
        }
      }
    } else if (current != nullptr && device_asked && current_device == use.device) {
      use.context = ContextKind::current;
      use.current = current;
    }
    p.devices.push_back(std::move(use));
  }
  // The deferred question: a current context that is no retained primary one marks its device in use when that
  // device's primary context is not active, as above.
  const auto is_current = [&](const DeviceUse& use) { return use.lease_is_current; };
  if (current != nullptr && !device_asked && std::none_of(p.devices.begin(), p.devices.end(), is_current) &&
      api.cuCtxGetDevice(&current_device) == CUDA_SUCCESS) {
    for (DeviceUse& use : p.devices) {
      if (!use.failure && use.context == ContextKind::none && use.device == current_device) {
        use.context = ContextKind::current;
        use.current = current;
      }
    }
  }
  return p;
}

nlohmann::json describe_driver(const Driver& driver, const Probe& probe) {
  nlohmann::json missing = nlohmann::json::array();
  for (const auto& name : driver.missing_optional()) missing.push_back(name);
  const bool loaded = driver.loaded();
  return {
      {"state", to_string(probe.state)},
      {"path", driver.path()},
      {"version", loaded && driver.version() ? nlohmann::json(*driver.version()) : nlohmann::json(nullptr)},
      {"resolver", loaded ? nlohmann::json(to_string(driver.resolver())) : nlohmann::json(nullptr)},
      {"missing_optional", missing},
      {"message", probe.message},
  };
}

double DeviceWait::busy_for_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
}

DeviceRecord& DeviceRegistry::at(const DeviceUse& use) { return records_[use.key]; }

DeviceRecord& DeviceRegistry::refresh(const DeviceUse& use) {
  DeviceRecord& record = at(use);
  if (record.wait && record.wait->finished.load(std::memory_order_acquire)) {
    const auto code = static_cast<CUresult>(record.wait->result.load(std::memory_order_acquire));
    if (is_sticky(code) && !record.sticky) record.sticky = CallFailure{record.wait->call.load(), code};
    record.wait.reset();
  }
  if (use.failure && is_sticky(use.failure->code) && !record.sticky) record.sticky = use.failure;
  return record;
}

void DeviceRegistry::remember_enumeration(const Probe& probe, bool uuids) {
  if (enumeration_ || probe.state != DriverState::ready) return;
  Enumeration known;
  for (const DeviceUse& use : probe.devices) {
    // A handle or a UUID that could not be read this time: asked again by the next probe, so that every record
    // stays under the key the others use.
    if ((use.failure && use.failure->call == "cuDeviceGet") || (uuids && !use.uuid)) return;
    known.push_back({use.device, use.uuid});
  }
  enumeration_ = std::move(known);
}

void read_static_facts(const Driver& driver, const DeviceUse& use, DeviceRecord& record) {
  if (use.failure && use.failure->call == "cuDeviceGet") return;
  const EntryPoints& api = driver.api();
  if (!record.name) {
    char name[256] = {};
    if (api.cuDeviceGetName(name, sizeof name - 1, use.device) == CUDA_SUCCESS) record.name = std::string(name);
  }
  if (!record.total_bytes) {
    size_t total = 0;
    if (api.cuDeviceTotalMem(&total, use.device) == CUDA_SUCCESS) record.total_bytes = total;
  }
}

namespace {

// A failed query counts as inactive: the device is then skipped, not touched.
bool primary_active(const Driver& driver, CUdevice device) {
  unsigned flags = 0;
  int active = 0;
  return driver.api().cuDevicePrimaryCtxGetState(device, &flags, &active) == CUDA_SUCCESS && active != 0;
}

}  // namespace

ScopedContext::ScopedContext(const Driver& driver, const DeviceUse& use) : driver_(driver), use_(use) {
  if (process_is_exiting() || !use.in_use()) return;
  const EntryPoints& api = driver.api();
  if (use.context == ContextKind::current) {
    CUcontext now = nullptr;
    if (api.cuCtxGetCurrent(&now) == CUDA_SUCCESS && now == use.current) {
      entered_ = true;
      return;
    }
    if (const CUresult pushed = api.cuCtxPushCurrent(use.current); pushed != CUDA_SUCCESS) {
      failure_ = CallFailure{"cuCtxPushCurrent", pushed};
      return;
    }
    pushed_ = entered_ = true;
    return;
  }
  if (use.lease) {
    // Retained by the probe right after its state said active.
    if (const CUresult pushed = api.cuCtxPushCurrent(use.lease->context()); pushed != CUDA_SUCCESS) {
      failure_ = CallFailure{"cuCtxPushCurrent", pushed};
      return;
    }
    pushed_ = entered_ = true;
    return;
  }
  // The probe's answer may be stale: a context released since then must not
  // be created again by the retain (that costs ~500 MiB of device memory).
  if (!primary_active(driver, use.device)) return;
  CUcontext context = nullptr;
  if (const CUresult retained = api.cuDevicePrimaryCtxRetain(&context, use.device); retained != CUDA_SUCCESS) {
    failure_ = CallFailure{"cuDevicePrimaryCtxRetain", retained};
    return;
  }
  retained_ = true;
  // Checked again with our reference held: if it is not active now, what we
  // hold is not the context the process was using; give it back untouched.
  if (!primary_active(driver, use.device)) return;
  if (const CUresult pushed = api.cuCtxPushCurrent(context); pushed != CUDA_SUCCESS) {
    failure_ = CallFailure{"cuCtxPushCurrent", pushed};
    return;
  }
  pushed_ = entered_ = true;
}

ScopedContext::~ScopedContext() {
  if (process_is_exiting()) return;
  const EntryPoints& api = driver_.api();
  if (pushed_) {
    CUcontext popped = nullptr;
    api.cuCtxPopCurrent(&popped);
  }
  if (retained_) api.cuDevicePrimaryCtxRelease(use_.device);
}

std::string failure_message(const Driver& driver, int index, const CallFailure& failure) {
  const std::string gpu = "GPU" + std::to_string(index);
  if (is_sticky(failure.code)) {
    return gpu + " is unusable after " + driver.error_name(failure.code) + ": restart the kernel";
  }
  return failed_with(driver, failure.call.c_str(), failure.code) + " on " + gpu +
         ": gpucleanup left the device alone this time";
}

nlohmann::json failure_json(const Driver& driver, int index, const CallFailure& failure) {
  const bool sticky = is_sticky(failure.code);
  const std::string id = sticky ? "gpucleanup.devices.201" : "gpucleanup.devices.202";
  return {
      {"id", id},
      {"code", static_cast<int>(failure.code)},
      {"name", driver.error_name(failure.code)},
      {"call", failure.call},
      {"message", "[" + id + "] " + failure_message(driver, index, failure)},
      {"sticky", sticky},
  };
}

}  // namespace gpucleanup
