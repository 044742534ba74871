// Drain: a bounded settle, then the driver's pools trimmed, on every device in
// use.
//
// cuCtxSynchronize cannot be interrupted or given a timeout, so each device's
// wait runs on a watchdog thread of its own (all devices at once, one overall
// limit). At the limit the drain returns whether or not the GPU has finished;
// the watchdog keeps waiting in the background, owns what it uses through
// shared_ptr, and the next drain or snapshot reports the device busy instead of
// starting a second wait. A busy device is not trimmed: memory freed by its
// queued work is not yet observed and cannot be released anyway.
#pragma once

#include <chrono>
#include <functional>

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

}  // namespace gpucleanup
