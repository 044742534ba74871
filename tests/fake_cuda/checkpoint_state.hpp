// The fake driver's checkpoint state machine, shared between processes through
// files (see checkpoint_state.cpp): what the rest of the fake needs of it.
#pragma once

#include <string>

namespace fake_cuda {

// $GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR, read once; "" when unset (then no
// process is a checkpointable CUDA process and nothing ever blocks).
const std::string& checkpoint_dir();

// Registers this process as a running CUDA process (when the directory is set).
void register_process();

// Called at the start of every driver call of this process: while a helper
// has it locked or checkpointed, the call is counted in the record and waits
// until the process runs again, as a real driver's call does.
void wait_while_parked(const char* entry);

// fake_cuda_checkpoint_update's work: merges a patch into <dir>/<pid>.json
// (creating it); false and a message for a malformed patch.
bool update_record(int pid, const std::string& patch_json, std::string& error);

// The record's JSON text, "null" when there is none.
std::string record_json(int pid);

}  // namespace fake_cuda
