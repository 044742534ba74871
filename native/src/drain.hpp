// Drain and the after-cell pass: a bounded settle, then the driver's pools
// trimmed, on every device in use.
//
// cuCtxSynchronize cannot be interrupted or given a timeout, so a device's
// settle runs on its watchdog (watchdog.hpp: one long-lived thread per device,
// started on first need), all devices at once under one overall limit, while
// the calling thread waits on a condition variable with the deadline. The
// watchdog does the device's whole pass inside one push of the context that
// the probe retained (memory before, the wait, the trim, memory after), so a
// call retains and pushes each device once. At the limit the call returns
// whether or not the GPU has finished; the watchdog keeps waiting in the
// background, owns what it uses through shared_ptr, and the next call reports
// the device busy instead of starting a second wait. A busy device is not
// trimmed: memory freed by its queued work is not yet observed and cannot be
// released anyway. Without a wait (timeout 0, gpucleanup_trim) the pass runs on
// the calling thread and no thread is woken.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "devices.hpp"
#include "driver.hpp"

namespace gpucleanup {

struct DrainOptions {
  double timeout_s = 30.0;  // finite, >= 0 (checked by the caller); 0 skips the settle
  // false: settle only; the pools are reported as they are, never trimmed
  // (the extension's driver_pools = False).
  bool trim = true;
  // Called on the calling thread with {"device", "waited_s", "limit_s"} once a
  // wait passes progress_after, then every progress_every; returning true
  // abandons the waits.
  std::function<bool(const nlohmann::json&)> progress;
  std::chrono::milliseconds progress_after{2000};
  std::chrono::milliseconds progress_every{1000};
};

// share/schema/drain.schema.json
nlohmann::json drain(const Driver& driver, DeviceRegistry& registry, const DrainOptions& options);

// share/schema/after_cell.schema.json, kind "after_cell": the probe, the
// settle, the trim (options.trim) and what each device in use has free
// afterwards, in one pass. Not initialised, or nothing in use: the probe only.
nlohmann::json after_cell(const Driver& driver, DeviceRegistry& registry, const DrainOptions& options);

// share/schema/after_cell.schema.json, kind "trim": cuMemPoolTrimTo(pool, 0)
// on every device in use that is not busy, on the calling thread, no wait;
// released bytes and free memory afterwards.
nlohmann::json trim_pools(const Driver& driver, DeviceRegistry& registry);

// What an after-cell pass left on one device, for quiet_since().
struct QuietDevice {
  int index = 0;
  std::uint64_t free_bytes = 0;
};
using QuietMark = std::vector<QuietDevice>;

// The mark of an after_cell() report, when quiet_since() can compare with it: the driver ready and each device
// listed through its primary context, drained, settled ("done"), without an error, with no driver pool reserving
// memory after the trim and its free memory known; none listed (initialised, no context of this process) is an
// empty mark. nullopt otherwise: the next pass runs whole.
std::optional<QuietMark> quiet_mark(const nlohmann::json& report);

// True when nothing changed on the devices this process uses since the pass that left `mark`, as far as the
// driver tells without waiting: the same devices in use, each through its primary context and not busy or
// unusable; nothing queued on any (nothing_queued: an event recorded over the context, CUDA 12.5+ drivers; no
// driver pool reserving memory); and the same free memory on each (one cuMemGetInfo). False when anything
// differs or cannot be told. An empty mark holds while no device is in use. No wait, no trim, no JSON; the
// probe's calls, never cuInit.
bool quiet_since(const Driver& driver, DeviceRegistry& registry, const QuietMark& mark);

}  // namespace gpucleanup
