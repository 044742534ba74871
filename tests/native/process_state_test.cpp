// Process exit and fork: no driver call while exiting; a forked child starts
// with clean state and never uses a driver its parent had initialised.
#include "process_state.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>

#include "devices.hpp"
#include "test_support.hpp"

using gpucleanup::Driver;
using gpucleanup::DriverState;
using gpucleanup::testing::FakeCuda;

namespace {

// Runs `child` in a forked child and returns its exit status.
template <typename Body>
int in_forked_child(Body child) {
  const pid_t pid = fork();
  if (pid == 0) _exit(child());
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100;
}

}  // namespace

TEST(ProcessState, ForkedChildOfAnInitialisedParentReportsUnusableAndMakesNoDriverCalls) {
  FakeCuda fake;
  fake.reset({{"devices", {{{"primary_active", true}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  ASSERT_EQ(gpucleanup::probe(driver).state, DriverState::ready);
  const int status = in_forked_child([&] {
    const long long calls = fake.counter("calls.cuDeviceGetCount");
    const auto found = gpucleanup::probe(driver);
    if (found.state != DriverState::unusable) return 1;
    if (found.message !=
        "[gpucleanup.driver.105] CUDA was initialised before this process forked: CUDA cannot be used in a forked "
        "child") {
      return 2;
    }
    if (!found.devices.empty()) return 3;
    if (fake.counter("calls.cuDeviceGetCount") != calls) return 4;
    return 0;
  });
  EXPECT_EQ(status, 0);
  // The parent is not affected.
  EXPECT_EQ(gpucleanup::probe(driver).state, DriverState::ready);
}

TEST(ProcessStateDeathTest, ForkedChildOfAnUninitialisedParentProbesNormally) {
  // A fresh process (re-executed), in which no probe has seen CUDA initialised.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        FakeCuda fake;
        fake.reset({{"initialized", false}});
        const Driver driver(FAKE_CUDA_PATH);
        if (gpucleanup::probe(driver).state != DriverState::not_initialized) std::exit(1);
        const int status = in_forked_child([&] {
          fake.reset({{"devices", {{{"primary_active", true}}}}});
          return gpucleanup::probe(driver).state == DriverState::ready ? 0 : 1;
        });
        std::exit(status == 0 ? 0 : 2);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(ProcessState, ForkedChildGetsFreshPerProcessState) {
  static gpucleanup::PerProcess<int> value;
  value.get() = 42;
  const int status = in_forked_child([&] {
    if (value.get() != 0) return 1;
    value.get() = 7;
    return value.get() == 7 ? 0 : 2;
  });
  EXPECT_EQ(status, 0);
  EXPECT_EQ(value.get(), 42);
}

TEST(ProcessStateDeathTest, NoDriverCallsOnceTheProcessIsExiting) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        FakeCuda fake;
        fake.reset({{"devices", {{{"primary_active", true}}}}});
        const Driver driver(FAKE_CUDA_PATH);
        const long long calls = fake.counter("calls.cuDeviceGetCount");
        gpucleanup::mark_process_exiting();
        const auto found = gpucleanup::probe(driver);
        const bool quiet = found.state == DriverState::exiting && fake.counter("calls.cuDeviceGetCount") == calls &&
                           gpucleanup::process_is_exiting();
        std::exit(quiet ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}
