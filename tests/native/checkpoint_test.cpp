// One park step against the fake driver's checkpoint state machine: the
// target is a child process, registered in the fake's checkpoint directory.
#include "checkpoint.hpp"

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "errors.hpp"
#include "test_support.hpp"

#include <filesystem>
#include <system_error>

using gpucleanup::CheckpointStep;
using gpucleanup::checkpoint_step;
using gpucleanup::Driver;
using gpucleanup::testing::FakeCuda;
using json = nlohmann::json;

namespace {

// The directory must be set before the fake reads it (once per process).
const std::string kDirectory = [] {
  char name[] = "/tmp/gpucleanup-checkpoint-test-XXXXXX";
  const char* made = mkdtemp(name);
  const std::string dir = made == nullptr ? std::string("/tmp") : std::string(made);
  setenv("GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR", dir.c_str(), 1);
  return dir;
}();

// ctest runs each test in a process of its own: each removes its directory as it exits (the process that made it
// only, never a forked target), so that a run leaves nothing in /tmp.
struct RemovedAtExit {
  std::string dir;
  pid_t owner;
  ~RemovedAtExit() {
    if (getpid() != owner || dir == "/tmp") return;
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
};
const RemovedAtExit kRemovedAtExit{kDirectory, getpid()};

// A child that waits for a byte on a pipe, then makes one driver call
// (cuDeviceGetCount through the fake it inherited) and exits 0 if it succeeded.
class Target {
 public:
  explicit Target(FakeCuda& fake) {
    if (pipe(pipe_) != 0) throw std::runtime_error("pipe");
    void* handle = dlopen(fake.path().c_str(), RTLD_NOW | RTLD_LOCAL);
    auto count = reinterpret_cast<CUresult (*)(int*)>(dlsym(handle, "cuDeviceGetCount"));
    pid_ = fork();
    if (pid_ == 0) {
      char byte = 0;
      close(pipe_[1]);
      if (read(pipe_[0], &byte, 1) != 1) _exit(3);
      int n = 0;
      _exit(count(&n) == CUDA_SUCCESS ? 0 : 4);
    }
    close(pipe_[0]);
    update(fake, {{"state", "running"}});
  }
  ~Target() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    close(pipe_[1]);
  }
  int pid() const { return pid_; }
  void go() { (void)!write(pipe_[1], "x", 1); }
  bool exited() {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) != pid_) return false;
    reaped_ = true;
    status_ = status;
    return true;
  }
  int wait() {
    if (!reaped_) {
      waitpid(pid_, &status_, 0);
      reaped_ = true;
    }
    return WIFEXITED(status_) ? WEXITSTATUS(status_) : -1;
  }
  void update(FakeCuda& fake, const json& patch) {
    void* handle = dlopen(fake.path().c_str(), RTLD_NOW | RTLD_LOCAL);
    auto fn = reinterpret_cast<int (*)(int, const char*)>(dlsym(handle, "fake_cuda_checkpoint_update"));
    if (fn(pid_, patch.dump().c_str()) != 0) throw std::runtime_error("fake_cuda_checkpoint_update failed");
  }
  json record(FakeCuda& fake) {
    void* handle = dlopen(fake.path().c_str(), RTLD_NOW | RTLD_LOCAL);
    auto fn = reinterpret_cast<const char* (*)(int)>(dlsym(handle, "fake_cuda_checkpoint_record"));
    return json::parse(fn(pid_));
  }

 private:
  int pipe_[2] = {-1, -1};
  int pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
};

std::string error_of(const Driver& driver, int pid, CheckpointStep step) {
  try {
    checkpoint_step(driver, pid, step, 0);
  } catch (const gpucleanup::Error& error) {
    return error.what();
  }
  return "";
}

}  // namespace

TEST(Checkpoint, FullCycleMovesTheProcessThroughEveryState) {
  FakeCuda fake;
  fake.reset();
  Target target(fake);
  const Driver driver(FAKE_CUDA_PATH);
  const std::pair<CheckpointStep, const char*> steps[] = {{CheckpointStep::lock, "locked"},
                                                          {CheckpointStep::checkpoint, "checkpointed"},
                                                          {CheckpointStep::restore, "locked"},
                                                          {CheckpointStep::unlock, "running"}};
  std::string before = "running";
  for (const auto& [step, after] : steps) {
    const json out = checkpoint_step(driver, target.pid(), step, 1000);
    EXPECT_TRUE(out["ok"].get<bool>()) << out;
    EXPECT_EQ(out["result"], "CUDA_SUCCESS");
    EXPECT_EQ(out["state_before"], before);
    EXPECT_EQ(out["state"], after);
    EXPECT_EQ(out["pid"], target.pid());
    before = after;
  }
  const json record = target.record(fake);
  EXPECT_EQ(record["calls"]["cuCheckpointProcessLock"], 1);
  EXPECT_EQ(record["calls"]["cuCheckpointProcessRestore"], 1);
  // The helper initialised its own driver; the target's was never asked to.
  EXPECT_EQ(fake.counter("cuInit"), 4);
}

TEST(Checkpoint, StateStepReportsTheStateOnly) {
  FakeCuda fake;
  fake.reset();
  Target target(fake);
  target.update(fake, {{"state", "checkpointed"}});
  const json out = checkpoint_step(Driver(FAKE_CUDA_PATH), target.pid(), CheckpointStep::state, 0);
  EXPECT_TRUE(out["ok"].get<bool>());
  EXPECT_EQ(out["state"], "checkpointed");
  EXPECT_EQ(target.record(fake)["state"], "checkpointed");
}

TEST(Checkpoint, StepInTheWrongStateIsRefusedAndChangesNothing) {
  FakeCuda fake;
  fake.reset();
  Target target(fake);
  const json out = checkpoint_step(Driver(FAKE_CUDA_PATH), target.pid(), CheckpointStep::checkpoint, 0);
  EXPECT_FALSE(out["ok"].get<bool>());
  EXPECT_EQ(out["result"], "CUDA_ERROR_ILLEGAL_STATE");
  EXPECT_EQ(out["code"], 401);
  EXPECT_EQ(out["state"], "running");
}

TEST(Checkpoint, InjectedErrorLeavesTheStateOrSetsTheOneAsked) {
  FakeCuda fake;
  fake.reset();
  Target target(fake);
  const Driver driver(FAKE_CUDA_PATH);
  target.update(fake, {{"state", "locked"}, {"errors", {{"cuCheckpointProcessCheckpoint", 2}}}});
  json out = checkpoint_step(driver, target.pid(), CheckpointStep::checkpoint, 0);
  EXPECT_EQ(out["result"], "CUDA_ERROR_OUT_OF_MEMORY");
  EXPECT_EQ(out["state"], "locked");
  // As measured for JAX on two GPUs: the restore fails and the process stays checkpointed.
  target.update(fake, {{"state", "checkpointed"},
                       {"errors", {{"cuCheckpointProcessRestore", 1}}},
                       {"error_state", {{"cuCheckpointProcessRestore", "failed"}}}});
  out = checkpoint_step(driver, target.pid(), CheckpointStep::restore, 0);
  EXPECT_EQ(out["result"], "CUDA_ERROR_INVALID_VALUE");
  EXPECT_EQ(out["state_before"], "checkpointed");
  EXPECT_EQ(out["state"], "failed");
}

TEST(Checkpoint, LockTimesOutWhileTheProcessIsBusyAndLeavesItRunning) {
  FakeCuda fake;
  fake.reset();
  Target target(fake);
  target.update(fake, {{"busy", true}});
  const json out = checkpoint_step(Driver(FAKE_CUDA_PATH), target.pid(), CheckpointStep::lock, 20);
  EXPECT_EQ(out["result"], "CUDA_ERROR_NOT_READY");
  EXPECT_EQ(out["lock_timeout_ms"], 20);
  EXPECT_EQ(out["state"], "running");
}

TEST(Checkpoint, ProcessWithoutCudaIsInvalidValue) {
  FakeCuda fake;
  fake.reset();
  Target target(fake);
  const int pid = target.pid();
  ASSERT_EQ(unlink((kDirectory + "/" + std::to_string(pid) + ".json").c_str()), 0);
  const json out = checkpoint_step(Driver(FAKE_CUDA_PATH), pid, CheckpointStep::lock, 0);
  EXPECT_EQ(out["result"], "CUDA_ERROR_INVALID_VALUE");
  EXPECT_TRUE(out["state"].is_null());
}

TEST(Checkpoint, CallsOfALockedProcessWaitUntilItIsUnlocked) {
  FakeCuda fake;
  fake.reset();
  Target target(fake);
  const Driver driver(FAKE_CUDA_PATH);
  ASSERT_TRUE(checkpoint_step(driver, target.pid(), CheckpointStep::lock, 0)["ok"].get<bool>());
  target.go();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (target.record(fake)["calls_while_parked"].value("cuDeviceGetCount", 0) == 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(target.record(fake)["calls_while_parked"]["cuDeviceGetCount"], 1);
  EXPECT_FALSE(target.exited());  // still waiting in the driver
  ASSERT_TRUE(checkpoint_step(driver, target.pid(), CheckpointStep::unlock, 0)["ok"].get<bool>());
  EXPECT_EQ(target.wait(), 0);
}

TEST(Checkpoint, RefusesToParkItself) {
  FakeCuda fake;
  fake.reset();
  EXPECT_EQ(error_of(Driver(FAKE_CUDA_PATH), static_cast<int>(getpid()), CheckpointStep::lock),
            "[gpucleanup.park.603] pid " + std::to_string(getpid()) +
                " is not another process: a process is parked by a helper process, never by itself");
  EXPECT_EQ(fake.counter("cuInit"), 0);
}

TEST(Checkpoint, DriverWithoutCheckpointCallsIsRefusedWithASentence) {
  FakeCuda fake;
  fake.reset({{"driver_version", 12040}});
  Target target(fake);
  EXPECT_EQ(error_of(Driver(FAKE_CUDA_PATH), target.pid(), CheckpointStep::lock),
            std::string("[gpucleanup.park.602] the CUDA driver ") + FAKE_CUDA_PATH +
                " (CUDA 12.4) has no checkpoint calls (cuCheckpointProcessGetState, cuCheckpointProcessLock, "
                "cuCheckpointProcessCheckpoint, cuCheckpointProcessRestore, cuCheckpointProcessUnlock): parking "
                "needs a driver for CUDA 12.8 or newer (R570 or later); update the NVIDIA driver, or leave the "
                "kernel running");
  EXPECT_EQ(target.record(fake)["state"], "running");
  EXPECT_EQ(fake.counter("cuInit"), 0);
}

TEST(Checkpoint, FailedInitialisationOfTheHelperIsAnError) {
  FakeCuda fake;
  fake.reset({{"errors", {{"cuInit", 100}}}});
  Target target(fake);
  EXPECT_EQ(error_of(Driver(FAKE_CUDA_PATH), target.pid(), CheckpointStep::lock),
            "[gpucleanup.park.604] cuInit failed in the park helper with CUDA_ERROR_NO_DEVICE (100): the driver "
            "cannot be used here; check the GPU with nvidia-smi");
}

namespace {

// Sets GPUCLEANUP_PARK_RESTORE_MAP for one test and puts back what was there,
// so that no later test of this process restores under another test's setting.
class RestoreMapSetting {
 public:
  explicit RestoreMapSetting(const char* value) {
    if (const char* old = std::getenv(kName)) old_ = old;
    if (value == nullptr) {
      unsetenv(kName);
    } else {
      setenv(kName, value, 1);
    }
  }
  ~RestoreMapSetting() {
    if (old_) {
      setenv(kName, old_->c_str(), 1);
    } else {
      unsetenv(kName);
    }
  }
  RestoreMapSetting(const RestoreMapSetting&) = delete;
  RestoreMapSetting& operator=(const RestoreMapSetting&) = delete;

 private:
  static constexpr const char* kName = "GPUCLEANUP_PARK_RESTORE_MAP";
  std::optional<std::string> old_;
};

const json kThreeDevices = {{"devices", {json::object(), json::object(), json::object()}}};

// The fake's own restore entry point, for maps the library never builds.
using RestoreFn = CUresult (*)(int, CUcheckpointRestoreArgs*);
RestoreFn fake_restore(FakeCuda& fake) {
  void* handle = dlopen(fake.path().c_str(), RTLD_NOW | RTLD_LOCAL);
  return reinterpret_cast<RestoreFn>(dlsym(handle, "cuCheckpointProcessRestore"));
}

// The UUID the fake gives device `index` by default (tests/fake_cuda/scenario.cpp).
CUuuid fake_uuid(FakeCuda& fake, int index) {
  void* handle = dlopen(fake.path().c_str(), RTLD_NOW | RTLD_LOCAL);
  auto get = reinterpret_cast<CUresult (*)(CUuuid*, CUdevice)>(dlsym(handle, "cuDeviceGetUuid_v2"));
  CUuuid uuid{};
  if (get(&uuid, index) != CUDA_SUCCESS) throw std::runtime_error("cuDeviceGetUuid_v2 failed");
  return uuid;
}

}  // namespace

TEST(Checkpoint, RestorePassesAMapNamingEveryGpuTheHelperSees) {
  FakeCuda fake;
  fake.reset(kThreeDevices);
  const RestoreMapSetting unset(nullptr);
  Target target(fake);
  target.update(fake, {{"state", "checkpointed"}});
  const json out = checkpoint_step(Driver(FAKE_CUDA_PATH), target.pid(), CheckpointStep::restore, 0);
  EXPECT_TRUE(out["ok"].get<bool>()) << out;
  EXPECT_EQ(out["restore_map"], 3);
  EXPECT_EQ(out["state"], "locked");
  EXPECT_EQ(target.record(fake)["restore_map"], 3);  // what the driver was given, not only what was reported
}

TEST(Checkpoint, RestoreMapNonePassesNoMap) {
  FakeCuda fake;
  fake.reset(kThreeDevices);
  const RestoreMapSetting none("none");
  Target target(fake);
  target.update(fake, {{"state", "checkpointed"}});
  const json out = checkpoint_step(Driver(FAKE_CUDA_PATH), target.pid(), CheckpointStep::restore, 0);
  EXPECT_TRUE(out["ok"].get<bool>()) << out;
  EXPECT_EQ(out["restore_map"], 0);
  EXPECT_EQ(target.record(fake)["restore_map"], 0);
}

TEST(Checkpoint, OtherRestoreMapSettingsStillPassTheMap) {
  FakeCuda fake;
  fake.reset(kThreeDevices);
  const RestoreMapSetting other("None");  // only the exact word turns it off
  Target target(fake);
  target.update(fake, {{"state", "checkpointed"}});
  const json out = checkpoint_step(Driver(FAKE_CUDA_PATH), target.pid(), CheckpointStep::restore, 0);
  EXPECT_EQ(out["restore_map"], 3);
  EXPECT_EQ(target.record(fake)["restore_map"], 3);
}

TEST(Checkpoint, RestoreThatNeedsTheFullMapSucceedsWithTheIdentityMap) {
  FakeCuda fake;
  fake.reset(kThreeDevices);
  const RestoreMapSetting unset(nullptr);
  Target target(fake);
  const Driver driver(FAKE_CUDA_PATH);
  target.update(fake, {{"restore_needs_full_map", true}});
  for (const auto step : {CheckpointStep::lock, CheckpointStep::checkpoint, CheckpointStep::restore,
                          CheckpointStep::unlock}) {
    const json out = checkpoint_step(driver, target.pid(), step, 1000);
    EXPECT_TRUE(out["ok"].get<bool>()) << out;
  }
  EXPECT_EQ(target.record(fake)["state"], "running");
  EXPECT_EQ(target.record(fake)["restore_map"], 3);
}

TEST(Checkpoint, RestoreThatNeedsTheFullMapFailsWithoutOneAndStaysCheckpointed) {
  FakeCuda fake;
  fake.reset(kThreeDevices);
  const RestoreMapSetting none("none");
  Target target(fake);
  target.update(fake, {{"state", "checkpointed"}, {"restore_needs_full_map", true}});
  const json out = checkpoint_step(Driver(FAKE_CUDA_PATH), target.pid(), CheckpointStep::restore, 0);
  EXPECT_EQ(out["result"], "CUDA_ERROR_INVALID_VALUE");
  EXPECT_EQ(out["state"], "checkpointed");
  EXPECT_EQ(target.record(fake)["restore_map"], 0);
}

TEST(Checkpoint, HelperWithoutGpuUuidsRestoresWithNoMap) {
  FakeCuda fake;
  fake.reset({{"missing", {"cuDeviceGetUuid"}}, {"devices", {json::object(), json::object()}}});
  const RestoreMapSetting unset(nullptr);
  Target target(fake);
  target.update(fake, {{"state", "checkpointed"}});
  const json out = checkpoint_step(Driver(FAKE_CUDA_PATH), target.pid(), CheckpointStep::restore, 0);
  EXPECT_TRUE(out["ok"].get<bool>()) << out;
  EXPECT_EQ(out["restore_map"], 0);
  EXPECT_EQ(target.record(fake)["restore_map"], 0);
}

TEST(Checkpoint, FakeRestoreWantsEveryDeviceMappedToItself) {
  FakeCuda fake;
  fake.reset(kThreeDevices);
  Target target(fake);
  const RestoreFn restore = fake_restore(fake);
  const CUuuid uuids[] = {fake_uuid(fake, 0), fake_uuid(fake, 1), fake_uuid(fake, 2)};
  EXPECT_NE(std::memcmp(&uuids[0], &uuids[1], sizeof(CUuuid)), 0);  // distinct per device ...
  const CUuuid again = fake_uuid(fake, 2);
  EXPECT_EQ(std::memcmp(&uuids[2], &again, sizeof(CUuuid)), 0);  // ... and stable
  target.update(fake, {{"state", "checkpointed"}, {"restore_needs_full_map", true}});
  auto args_of = [](std::vector<CUcheckpointGpuPair>& pairs) {
    CUcheckpointRestoreArgs args;
    std::memset(&args, 0, sizeof args);
    args.gpuPairs = pairs.data();
    args.gpuPairsCount = static_cast<unsigned>(pairs.size());
    return args;
  };
  // Two of three devices: refused, still checkpointed.
  std::vector<CUcheckpointGpuPair> pairs = {{uuids[0], uuids[0]}, {uuids[1], uuids[1]}};
  CUcheckpointRestoreArgs args = args_of(pairs);
  EXPECT_EQ(restore(target.pid(), &args), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(target.record(fake)["restore_map"], 2);
  EXPECT_EQ(target.record(fake)["state"], "checkpointed");
  // Three pairs, one of them not an identity: refused.
  pairs = {{uuids[0], uuids[0]}, {uuids[1], uuids[2]}, {uuids[2], uuids[1]}};
  args = args_of(pairs);
  EXPECT_EQ(restore(target.pid(), &args), CUDA_ERROR_INVALID_VALUE);
  // Three pairs naming one device twice: refused.
  pairs = {{uuids[0], uuids[0]}, {uuids[1], uuids[1]}, {uuids[1], uuids[1]}};
  args = args_of(pairs);
  EXPECT_EQ(restore(target.pid(), &args), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(restore(target.pid(), nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(target.record(fake)["restore_map"], 0);
  // Every device, in any order, with a reserved byte set: refused whatever the map.
  pairs = {{uuids[2], uuids[2]}, {uuids[0], uuids[0]}, {uuids[1], uuids[1]}};
  args = args_of(pairs);
  args.reserved1 = 1;
  EXPECT_EQ(restore(target.pid(), &args), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(target.record(fake)["state"], "checkpointed");
  args.reserved1 = 0;
  EXPECT_EQ(restore(target.pid(), &args), CUDA_SUCCESS);
  EXPECT_EQ(target.record(fake)["state"], "locked");
  EXPECT_EQ(target.record(fake)["calls"]["cuCheckpointProcessRestore"], 6);
}

TEST(Checkpoint, StepsUnderWayAreNamedAndRefuseEveryOtherStep) {
  FakeCuda fake;
  fake.reset();
  Target target(fake);
  const Driver driver(FAKE_CUDA_PATH);
  for (const char* name : {"checkpointing", "restoring"}) {
    target.update(fake, {{"state", name}});
    const json state = checkpoint_step(driver, target.pid(), CheckpointStep::state, 0);
    EXPECT_TRUE(state["ok"].get<bool>()) << state;
    EXPECT_EQ(state["state"], name);
    for (const auto step : {CheckpointStep::lock, CheckpointStep::checkpoint, CheckpointStep::restore,
                            CheckpointStep::unlock}) {
      const json out = checkpoint_step(driver, target.pid(), step, 20);
      EXPECT_EQ(out["result"], "CUDA_ERROR_ILLEGAL_STATE") << out;
      EXPECT_EQ(out["state_before"], name);
      EXPECT_EQ(out["state"], name);
    }
    EXPECT_EQ(target.record(fake)["state"], name);
  }
}

TEST(Checkpoint, FakeRecordRefusesUnknownStatesAndANonBooleanFullMapFlag) {
  FakeCuda fake;
  fake.reset();
  Target target(fake);
  EXPECT_THROW(target.update(fake, {{"state", "parking"}}), std::runtime_error);
  EXPECT_THROW(target.update(fake, {{"restore_needs_full_map", "yes"}}), std::runtime_error);
  EXPECT_EQ(target.record(fake)["restore_needs_full_map"], false);
  EXPECT_TRUE(target.record(fake)["restore_map"].is_null());  // no restore made yet
}
