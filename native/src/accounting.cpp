#include "accounting.hpp"
#include "trace.hpp"

#include <chrono>
#include <cstdio>

namespace gpucleanup {
namespace {

nlohmann::json bytes(const std::optional<std::uint64_t>& value) {
  return value ? nlohmann::json(*value) : nlohmann::json(nullptr);
}

const char* context_name(ContextKind kind) {
  switch (kind) {
    case ContextKind::primary: return "primary";
    case ContextKind::current: return "current";
    case ContextKind::none: break;
  }
  return nullptr;
}

nlohmann::json context_json(ContextKind kind) {
  const char* name = context_name(kind);
  return name != nullptr ? nlohmann::json(name) : nlohmann::json(nullptr);
}

nlohmann::json pool_json(const Driver& driver, const PoolRef& pool) {
  return {
      {"which", pool.which},
      {"handle", pool_handle_text(pool.handle)},
      {"reserved_bytes", bytes(pool_attribute(driver, pool.handle, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT))},
      {"reserved_high_bytes", bytes(pool_attribute(driver, pool.handle, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH))},
      {"used_bytes", bytes(pool_attribute(driver, pool.handle, CU_MEMPOOL_ATTR_USED_MEM_CURRENT))},
      {"used_high_bytes", bytes(pool_attribute(driver, pool.handle, CU_MEMPOOL_ATTR_USED_MEM_HIGH))},
  };
}

void mark_failed(nlohmann::json& entry, const Driver& driver, const DeviceUse& use, DeviceRecord& record,
                 const CallFailure& failure) {
  if (is_sticky(failure.code) && !record.sticky) record.sticky = failure;
  entry["state"] = is_sticky(failure.code) ? "unusable" : "error";
  entry["error"] = failure_json(driver, use.index, failure);
}

// Memory of one device in use: cuMemGetInfo inside its context, then its pools.
void mark_idle(nlohmann::json& entry) {
  entry["in_use"] = false;
  entry["context"] = nullptr;
  entry["state"] = "idle";
}

// The context is gone (a framework reset the device and left the stale handle
// current; or a current context was destroyed): not in use after all.
bool context_gone(const DeviceUse& use, const CallFailure& failure) {
  return failure.code == CUDA_ERROR_CONTEXT_IS_DESTROYED ||
         (use.context == ContextKind::current && failure.code == CUDA_ERROR_INVALID_CONTEXT);
}

void read_memory(nlohmann::json& entry, const Driver& driver, const DeviceUse& use, DeviceRecord& record) {
  ScopedContext scope(driver, use);
  if (scope.failure()) {
    if (context_gone(use, *scope.failure())) return mark_idle(entry);
    return mark_failed(entry, driver, use, record, *scope.failure());
  }
  if (!scope.entered()) return mark_idle(entry);  // released between the probe and now: idle after all
  const MemoryInfo info = memory_info(driver);
  if (info.failure && context_gone(use, *info.failure)) return mark_idle(entry);
  if (info.failure) return mark_failed(entry, driver, use, record, *info.failure);
  entry["free_bytes"] = bytes(info.free_bytes);
  entry["ctx_total_bytes"] = bytes(info.total_bytes);
  if (info.free_bytes && info.total_bytes && *info.total_bytes >= *info.free_bytes) {
    entry["used_bytes"] = *info.total_bytes - *info.free_bytes;
  }
  for (const PoolRef& pool : device_pools(driver, use.device)) entry["pools"].push_back(pool_json(driver, pool));
}

}  // namespace

nlohmann::json report_header(const char* kind) {
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  return {
      {"kind", kind},
      {"schema_version", 1},
      {"library_version", GPUCLEANUP_VERSION},
      {"time_ns", std::chrono::duration_cast<std::chrono::nanoseconds>(now).count()},
  };
}

std::vector<PoolRef> device_pools(const Driver& driver, CUdevice device) {
  const EntryPoints& api = driver.api();
  std::vector<PoolRef> pools;
  if (api.cuDeviceGetDefaultMemPool == nullptr) return pools;
  CUmemoryPool default_pool = nullptr;
  if (api.cuDeviceGetDefaultMemPool(&default_pool, device) != CUDA_SUCCESS || default_pool == nullptr) return pools;
  pools.push_back({"default", default_pool});
  CUmemoryPool current_pool = nullptr;
  if (api.cuDeviceGetMemPool != nullptr && api.cuDeviceGetMemPool(&current_pool, device) == CUDA_SUCCESS &&
      current_pool != nullptr && current_pool != default_pool) {
    pools.push_back({"current", current_pool});
  }
  // Pools the program made with cuMemPoolCreate, known only while allocations
  // are traced (no driver call lists a process's pools).
  for (CUmemoryPool created : trace::pools_of(device)) {
    if (created != default_pool && created != current_pool) pools.push_back({"created", created});
  }
  return pools;
}

std::optional<std::uint64_t> pool_attribute(const Driver& driver, CUmemoryPool pool, CUmemPool_attribute attribute) {
  cuuint64_t value = 0;
  if (driver.api().cuMemPoolGetAttribute == nullptr) return std::nullopt;
  if (driver.api().cuMemPoolGetAttribute(pool, attribute, &value) != CUDA_SUCCESS) return std::nullopt;
  return value;
}

std::string pool_handle_text(CUmemoryPool pool) {
  char text[32];
  std::snprintf(text, sizeof text, "%p", static_cast<void*>(pool));
  return text;
}

MemoryInfo memory_info(const Driver& driver) {
  MemoryInfo info;
  size_t free = 0;
  size_t total = 0;
  if (const CUresult got = driver.api().cuMemGetInfo(&free, &total); got != CUDA_SUCCESS) {
    info.failure = CallFailure{"cuMemGetInfo", got};
    return info;
  }
  info.free_bytes = free;
  info.total_bytes = total;
  return info;
}

nlohmann::json take_snapshot(const Driver& driver, DeviceRegistry& registry, SnapshotKind kind) {
  const bool full = kind == SnapshotKind::snapshot;
  // A full snapshot enters every device in use that is not unusable: retained
  // by the probe right after its state said active, once.
  RetainIf retain;
  if (full) retain = [&registry](const DeviceUse& use) { return !registry.refresh(use).sticky; };
  const Probe found = probe(driver, retain);
  nlohmann::json report = report_header(full ? "snapshot" : "probe");
  report["driver"] = describe_driver(driver, found);
  report["devices"] = nlohmann::json::array();
  for (const DeviceUse& use : found.devices) {
    DeviceRecord& record = registry.refresh(use);
    nlohmann::json entry = {
        {"index", use.index},
        {"in_use", use.in_use()},
        {"context", context_json(use.context)},
        {"state", use.in_use() ? "in_use" : "idle"},
        {"uuid", use.uuid ? nlohmann::json(*use.uuid) : nlohmann::json(nullptr)},
    };
    if (full) {
      read_static_facts(driver, use, record);
      entry["name"] = record.name ? nlohmann::json(*record.name) : nlohmann::json(nullptr);
      entry["total_bytes"] = bytes(record.total_bytes);
      entry["free_bytes"] = nullptr;
      entry["used_bytes"] = nullptr;
      entry["ctx_total_bytes"] = nullptr;
      entry["pools"] = nlohmann::json::array();
      entry["busy_for_s"] = nullptr;
      entry["error"] = nullptr;
    }
    if (record.sticky) {
      // Left alone: nothing but the probe touches this device again.
      entry["state"] = "unusable";
      entry["error"] = failure_json(driver, use.index, *record.sticky);
    } else if (use.failure) {
      entry["state"] = "error";
      entry["error"] = failure_json(driver, use.index, *use.failure);
    } else if (use.in_use()) {
      if (record.wait) {
        entry["state"] = "busy";
        entry["busy_for_s"] = record.wait->busy_for_s();
      }
      if (full) read_memory(entry, driver, use, record);
    }
    report["devices"].push_back(std::move(entry));
  }
  return report;
}

}  // namespace gpucleanup
