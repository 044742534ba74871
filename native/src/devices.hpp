// Which devices this process already uses, and scoped access to them.
//
// Nothing here initialises CUDA or creates a context: the probe starts with
// cuDeviceGetCount (CUDA_ERROR_NOT_INITIALIZED means nothing in the process
// uses CUDA), a device is "in use" only when its primary context is already
// active or a context of it is current to the calling thread, and
// ScopedContext re-checks after retaining so a context released meanwhile is
// never brought back to life.
#pragma once

#include <cuda.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "driver.hpp"

namespace gpucleanup {

enum class DriverState { no_driver, not_initialized, ready, unusable, exiting };
const char* to_string(DriverState state) noexcept;

enum class ContextKind { none, primary, current };

// A driver call that did not return CUDA_SUCCESS.
struct CallFailure {
  std::string call;
  CUresult code = CUDA_SUCCESS;
};

// One reference to a device's primary context, taken by the probe right after
// cuDevicePrimaryCtxGetState said the context is active (so it never creates
// one) and given back (cuDevicePrimaryCtxRelease) when the last holder drops
// it: the call that probed, or the watchdog still waiting in it. Taken anew by
// every call: keeping a reference between calls would keep the context alive
// after the process released its own (a framework's close or release would no
// longer free its memory), and a handle kept without a reference goes stale
// when a framework resets the context.
class ContextLease {
 public:
  ContextLease(Driver driver, CUdevice device, CUcontext context)
      : driver_(std::move(driver)), device_(device), context_(context) {}
  ~ContextLease();  // no driver call once the process is exiting
  ContextLease(const ContextLease&) = delete;
  ContextLease& operator=(const ContextLease&) = delete;

  CUcontext context() const noexcept { return context_; }

 private:
  Driver driver_;
  CUdevice device_;
  CUcontext context_;
};

struct DeviceUse {
  int index = 0;
  CUdevice device = 0;
  std::optional<std::string> uuid;  // "GPU-xxxxxxxx-..." when cuDeviceGetUuid exists
  std::string key;                  // the uuid, else "index:<n>"
  ContextKind context = ContextKind::none;
  CUcontext current = nullptr;      // the calling thread's context, for ContextKind::current
  // ContextKind::primary with a lease whose context is the calling thread's current one (a framework's thread):
  // used as it is, without a push and a pop
  bool lease_is_current = false;
  std::optional<CallFailure> failure;  // the probe itself failed on this device
  // For ContextKind::primary, when the probe was asked to retain it.
  std::shared_ptr<const ContextLease> lease;

  bool in_use() const noexcept { return context != ContextKind::none; }
};

// 1: something in this process initialised CUDA; 0: nothing did (the probe's
// not_initialized); -1: the probe would stop for another reason. One
// cuDeviceGetCount at most, never cuInit.
int cuda_initialized(const Driver& driver) noexcept;

struct Probe {
  DriverState state = DriverState::no_driver;
  std::string message;
  std::vector<DeviceUse> devices;
};

// The devices of the process as a probe that found the driver ready enumerated them: each ordinal's handle and
// UUID. Fixed for the life of the process once the driver is initialised (CUDA_VISIBLE_DEVICES is read by
// cuInit, and a device is never added or renumbered afterwards), so the quiet check need not ask again.
struct EnumeratedDevice {
  CUdevice device = 0;
  std::optional<std::string> uuid;
};
using Enumeration = std::vector<EnumeratedDevice>;

// Asked by the probe for each device whose primary context is active (the
// device is keyed, not yet retained): true to retain it at once.
using RetainIf = std::function<bool(const DeviceUse&)>;

// The cheap probe: driver state and, when initialised, every device with
// whether it is in use. Makes no call at all while the process exits or in a
// child forked after the driver was initialised. With `retain`, a device in
// use through its primary context for which it answers true is retained right
// after its state was read (use.lease); a failed retain is use.failure.
//
// With `known` (an earlier probe's enumeration, DeviceRegistry::enumeration), the count, handles and UUIDs are
// taken from it instead of asked (cuDeviceGetCount, cuDeviceGet, cuDeviceGetUuid), and the current context's
// device (cuCtxGetDevice) is asked only when that context is none of the primary contexts retained: the quiet
// check's probe, which makes those calls on every idle cell.
Probe probe(const Driver& driver, const RetainIf& retain = {}, const Enumeration* known = nullptr);

// The "driver" object of the snapshot and drain schemas.
nlohmann::json describe_driver(const Driver& driver, const Probe& probe);

// A watchdog's wait for queued work on one device. Shared between the thread
// that waits (which may outlive the drain that started it) and the registry.
struct DeviceWait {
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  std::atomic<bool> finished{false};
  std::atomic<int> result{CUDA_SUCCESS};
  std::atomic<const char*> call{"cuCtxSynchronize"};  // the call that produced result
  std::atomic<std::int64_t> finished_ns{0};  // steady clock, when finished

  double busy_for_s() const;
};

class Watchdog;  // watchdog.hpp

// What is remembered about a device between calls.
struct DeviceRecord {
  std::optional<CallFailure> sticky;   // once set, the device is left alone
  std::shared_ptr<DeviceWait> wait;    // a settle still running (or finished, not yet seen)
  std::optional<std::string> name;     // static facts, read once
  std::optional<std::uint64_t> total_bytes;
  std::shared_ptr<Watchdog> watchdog;  // the device's settle thread, started on first need
};

// Per-device memory of the library, keyed by UUID (stable across renumbering
// by CUDA_VISIBLE_DEVICES within a process), else by index. Not synchronised:
// its owner serialises access (the C ABI's mutex).
class DeviceRegistry {
 public:
  DeviceRecord& at(const DeviceUse& use);

  // Folds a finished wait into the record: a sticky result marks the device
  // unusable; the wait is then forgotten. Returns the record.
  DeviceRecord& refresh(const DeviceUse& use);

  // Keeps the enumeration of a probe that found the driver ready and every device's handle, and with `uuids`
  // (the driver has cuDeviceGetUuid) every device's UUID; a probe that missed one is not kept. nullptr until then.
  void remember_enumeration(const Probe& probe, bool uuids);
  const Enumeration* enumeration() const noexcept { return enumeration_ ? &*enumeration_ : nullptr; }

 private:
  std::map<std::string, DeviceRecord> records_;
  std::optional<Enumeration> enumeration_;
};

// Reads (and caches in the record) the name and total memory; no context.
void read_static_facts(const Driver& driver, const DeviceUse& use, DeviceRecord& record);

// Retain -> re-check -> push on construction, pop -> release on destruction,
// on the calling thread. entered() is false when the device is no longer in use
// (its primary context went inactive) or a call failed (failure()). A use that
// carries a lease (the probe retained it) is only pushed and popped.
class ScopedContext {
 public:
  ScopedContext(const Driver& driver, const DeviceUse& use);
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

  bool entered() const noexcept { return entered_; }
  const std::optional<CallFailure>& failure() const noexcept { return failure_; }

 private:
  const Driver& driver_;
  const DeviceUse& use_;
  bool retained_ = false;
  bool pushed_ = false;
  bool entered_ = false;
  std::optional<CallFailure> failure_;
};

// JSON error object (schema "error") and the user's one-line message.
// Sticky: "GPU0 is unusable after CUDA_ERROR_ILLEGAL_ADDRESS: restart the kernel".
std::string failure_message(const Driver& driver, int index, const CallFailure& failure);
nlohmann::json failure_json(const Driver& driver, int index, const CallFailure& failure);

}  // namespace gpucleanup
