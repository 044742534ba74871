// One step of parking a process: the driver's checkpoint calls
// (cuCheckpointProcessLock, ...Checkpoint, ...Restore, ...Unlock, ...GetState),
// which act on another process named by its pid.
//
// Only the park helper calls this: a short-lived process of its own whose
// cuInit is its own (gpucleanup.park.native_step). The rule never to initialise CUDA
// is about the process gpucleanup cleans; a kernel never runs a step on
// itself (refused), and no long-lived process runs one either: a process that
// had itself called cuInit and done a cycle was seen to hang the next lock
// (share/FACTS.md §10).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "driver.hpp"

namespace gpucleanup {

enum class CheckpointStep { state, lock, checkpoint, restore, unlock, resume };

const char* to_string(CheckpointStep step) noexcept;
std::optional<CheckpointStep> parse_checkpoint_step(std::string_view name) noexcept;

// "running", "locked", "checkpointed", "failed" (CUprocessState 0..3), "checkpointing" (4) and "restoring"
// (5) (newer drivers: a step under way), else "CUprocessState <n>".
std::string process_state_name(int state);

// The checkpoint entry points this driver lacks (empty: it can park).
std::vector<std::string> missing_checkpoint_calls(const Driver& driver);

// Runs one step on `pid` and says what happened:
//   {"pid", "step", "ok", "result" (CUDA_SUCCESS or the error's name), "code",
//    "state_before", "state" (GetState before and after; null if it failed),
//    "seconds" (the step's call alone), "lock_timeout_ms" (lock only),
//    "restore_map" (restore only: how many GPUs the identity map named; 0: no map),
//    "driver_version" (cuDriverGetVersion, null if unknown), "restore_layout_known"
//    (the driver lays CUcheckpointRestoreArgs out as this build's cuda.h does:
//    CUDA 12.9 to 13.0; otherwise a restore passes NULL args, no GPU map)}
// The step "resume" is a restore and, when it succeeded, an unlock, with every
// other thread of the process held meanwhile (thread_hold.hpp): its "ok" and
// "result" are the restore's, "unlock" is {"ok", "result", "code"} (null
// result: not tried), "hold" is ThreadHold::report() or {"held": false,
// "why"} (no restore thread named, or holding turned off).
// A driver that refuses the step is a value ("ok": false), not an exception.
// Throws gpucleanup::Error for what no step can be run on:
//   gpucleanup.park.601  the driver is missing or unusable
//   gpucleanup.park.602  the driver has no checkpoint calls
//   gpucleanup.park.603  pid is not another process (<= 0, or this process)
//   gpucleanup.park.604  cuInit failed in this (helper) process
// lock_timeout_ms: the lock's own limit (0: none); the helper's caller bounds
// every step in time anyway.
nlohmann::json checkpoint_step(const Driver& driver, int pid, CheckpointStep step, unsigned lock_timeout_ms);

}  // namespace gpucleanup
