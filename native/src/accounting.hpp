// What the driver says about memory: per device cuMemGetInfo (device-wide,
// every process) and the stream-ordered pools' attributes, read only on
// devices already in use.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "devices.hpp"
#include "driver.hpp"

namespace gpucleanup {

enum class SnapshotKind { probe, snapshot };

// The fields every report starts with: kind, schema_version, library_version, time_ns.
nlohmann::json report_header(const char* kind);

struct PoolRef {
  const char* which;  // "default", "current" or "created" (cuMemPoolCreate, seen while tracing)
  CUmemoryPool handle;
};

// The device's default pool, then its current pool when that is another one.
// Empty where the driver has no pools (entry points missing, or
// CUDA_ERROR_NOT_SUPPORTED). Needs no context.
std::vector<PoolRef> device_pools(const Driver& driver, CUdevice device);

std::optional<std::uint64_t> pool_attribute(const Driver& driver, CUmemoryPool pool, CUmemPool_attribute attribute);
std::string pool_handle_text(CUmemoryPool pool);

struct MemoryInfo {
  std::optional<std::uint64_t> free_bytes;
  std::optional<std::uint64_t> total_bytes;
  std::optional<CallFailure> failure;
};

// cuMemGetInfo in the context current to the calling thread (enter a
// ScopedContext first).
MemoryInfo memory_info(const Driver& driver);

// The probe (kind probe: no memory queries) or the full snapshot, as
// share/schema/snapshot.schema.json. Idle devices get nothing that needs a
// context; unusable ones nothing but the static facts.
nlohmann::json take_snapshot(const Driver& driver, DeviceRegistry& registry, SnapshotKind kind);

}  // namespace gpucleanup
