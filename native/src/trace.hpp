// Raw allocations traced to their caller, on request (%gpumem --trace on).
//
// CUPTI's callback API calls us at the end of every driver call we enable: the
// allocation and free calls only (cuMemAlloc_v2, cuMemAllocPitch_v2,
// cuMemAllocManaged, cuMemCreate, cuMemAllocAsync, cuMemAllocFromPoolAsync and
// their per-thread-stream forms, cuMemPoolCreate; cuMemFree_v2, cuMemFreeAsync,
// cuMemRelease, cuMemPoolDestroy). Each live allocation is kept with its size,
// device, calling thread (the kernel's thread id, as Python's
// threading.Thread.native_id), the cell that was running, the shared object
// that called the driver and, when the calling thread holds the interpreter
// lock, a site id that the extension resolves to the Python file, line and
// function (its hook is called before any lock of ours is taken, so a
// collection it sets off may free GPU memory and come back here).
//
// libcupti is loaded with dlopen from the paths the caller gives (never
// linked). CUPTI before 13.3 allows one subscriber per process: when a profiler
// (torch.profiler's Kineto, Nsight Systems, compute-sanitizer) holds it,
// cuptiSubscribe returns CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED (39)
// and start() says so; the trace is then off and nothing else changes.
//
// Pools made with cuMemPoolCreate while tracing become known to the drain
// (pools_of), which trims them with the device's default pool.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace gpucleanup::trace {

// Called on the allocating thread while it holds the interpreter lock; returns
// an id the extension can turn back into a file and line (0: none).
using SiteFn = long long (*)();

// Loads libcupti from the first of `candidates` that loads, subscribes and
// enables the memory callbacks. Refused (with the reason) when the driver is not
// initialised in this process: tracing never initialises CUDA. Returns
// {"active": bool, "library": path, "error": text, "cupti_result": n, "tried": [...]}.
// Starting while active changes nothing but the site hook.
nlohmann::json start(const std::vector<std::string>& candidates, SiteFn site);

// Unsubscribes; what was recorded stays readable until the next start.
// Returns {"active": false, "stopped": bool}.
nlohmann::json stop();

bool active() noexcept;

// The cell now running (recorded with each allocation); -1 between cells.
void set_cell(std::int64_t cell) noexcept;

// Live traced allocations, grouped by (site, caller library, device, kind, cell):
// {"active", "library", "live_bytes", "live_allocations", "dropped",
//  "groups": [{"site", "caller", "device", "kind", "cell", "bytes", "count",
//              "threads": [tid, ...] (at most 16), "thread_count"}],
//  "pools": [{"handle", "device"}]}
// cell >= 0 keeps only allocations made during that cell.
nlohmann::json report(std::int64_t cell);

// Pools created with cuMemPoolCreate (and not destroyed) while tracing, on `device`.
std::vector<CUmemoryPool> pools_of(CUdevice device);

// For tests: the callback CUPTI calls, and forgetting everything recorded.
void on_callback(void* userdata, int domain, std::uint32_t cbid, const void* data) noexcept;
void reset_for_tests() noexcept;

}  // namespace gpucleanup::trace
