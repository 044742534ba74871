// The probe (never cuInit, never a context) and scoped access to devices.
#include "devices.hpp"

#include <gtest/gtest.h>

#include <set>

#include "test_support.hpp"

using gpucleanup::ContextKind;
using gpucleanup::Driver;
using gpucleanup::DriverState;
using gpucleanup::ScopedContext;
using gpucleanup::testing::eight_devices_three_in_use;
using gpucleanup::testing::FakeCuda;
using nlohmann::json;

TEST(Probe, NeverCallsCuInitInAnUninitialisedProcess) {
  FakeCuda fake;
  fake.reset({{"initialized", false}, {"devices", {json::object(), json::object()}}});
  const Driver driver(FAKE_CUDA_PATH);
  const auto found = gpucleanup::probe(driver);
  EXPECT_EQ(found.state, DriverState::not_initialized);
  EXPECT_TRUE(found.devices.empty());
  EXPECT_EQ(found.message,
            "[gpucleanup.driver.103] nothing in this process has initialised CUDA: there is nothing to clean");
  EXPECT_EQ(fake.counter("cuInit"), 0);
  EXPECT_EQ(fake.counter("calls.cuDeviceGetCount"), 1);
  EXPECT_EQ(fake.counter("calls.cuDevicePrimaryCtxGetState"), 0);
  EXPECT_EQ(fake.counter("contexts_created"), 0);
}

TEST(Probe, ListsOnlyDevicesWithAnActivePrimaryContextAsInUse) {
  FakeCuda fake;
  fake.reset(eight_devices_three_in_use());
  const Driver driver(FAKE_CUDA_PATH);
  const auto found = gpucleanup::probe(driver);
  ASSERT_EQ(found.state, DriverState::ready);
  ASSERT_EQ(found.devices.size(), 8u);
  std::set<int> in_use;
  for (const auto& use : found.devices) {
    if (use.in_use()) {
      in_use.insert(use.index);
      EXPECT_EQ(use.context, ContextKind::primary);
    }
  }
  EXPECT_EQ(in_use, (std::set<int>{1, 4, 6}));
  EXPECT_EQ(fake.counter("contexts_created"), 0);
  EXPECT_EQ(fake.counter("calls.cuDevicePrimaryCtxRetain"), 0);
  EXPECT_EQ(fake.counter("cuInit"), 0);
}

TEST(Probe, KeysDevicesByUuid) {
  FakeCuda fake;
  fake.reset({{"devices", {{{"uuid", "GPU-12345678-9abc-def0-1234-56789abcdef0"}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const auto found = gpucleanup::probe(driver);
  ASSERT_EQ(found.devices.size(), 1u);
  EXPECT_EQ(found.devices[0].uuid, "GPU-12345678-9abc-def0-1234-56789abcdef0");
  EXPECT_EQ(found.devices[0].key, "GPU-12345678-9abc-def0-1234-56789abcdef0");
}

TEST(Probe, KeysDevicesByIndexWithoutCuDeviceGetUuid) {
  FakeCuda fake;
  fake.reset({{"missing", {"cuDeviceGetUuid"}}, {"devices", {json::object(), json::object()}}});
  const Driver driver(FAKE_CUDA_PATH);
  const auto found = gpucleanup::probe(driver);
  ASSERT_EQ(found.devices.size(), 2u);
  EXPECT_FALSE(found.devices[1].uuid.has_value());
  EXPECT_EQ(found.devices[1].key, "index:1");
}

TEST(Probe, CurrentNonPrimaryContextMarksItsDeviceInUse) {
  FakeCuda fake;
  fake.reset({{"devices", {json::object(), json::object(), json::object()}},
              {"current_context", {{"device", 2}, {"primary", false}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const auto found = gpucleanup::probe(driver);
  ASSERT_EQ(found.devices.size(), 3u);
  EXPECT_FALSE(found.devices[0].in_use());
  EXPECT_FALSE(found.devices[1].in_use());
  EXPECT_EQ(found.devices[2].context, ContextKind::current);
  EXPECT_NE(found.devices[2].current, nullptr);
  EXPECT_EQ(fake.counter("contexts_created"), 0);
}

TEST(Probe, NoDriverIsAState) {
  const Driver driver("/nonexistent/libcuda.so.1");
  const auto found = gpucleanup::probe(driver);
  EXPECT_EQ(found.state, DriverState::no_driver);
  EXPECT_EQ(found.message, driver.message());
  EXPECT_TRUE(found.devices.empty());
}

TEST(Probe, FailingDeviceCountMakesTheDriverUnusable) {
  FakeCuda fake;
  fake.reset({{"errors", {{"cuDeviceGetCount", 999}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const auto found = gpucleanup::probe(driver);
  EXPECT_EQ(found.state, DriverState::unusable);
  EXPECT_EQ(found.message,
            "[gpucleanup.driver.104] cuDeviceGetCount failed with CUDA_ERROR_UNKNOWN (999): the driver cannot be "
            "used; check the GPU with nvidia-smi");
}

TEST(ScopedContext, RetainsPushesThenPopsAndReleases) {
  FakeCuda fake;
  fake.reset({{"devices", {{{"primary_active", true}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const auto found = gpucleanup::probe(driver);
  {
    ScopedContext scope(driver, found.devices[0]);
    EXPECT_TRUE(scope.entered());
    EXPECT_EQ(fake.counter("retained"), 1);
    EXPECT_EQ(fake.counter("pushed"), 1);
    size_t free = 0, total = 0;
    EXPECT_EQ(driver.api().cuMemGetInfo(&free, &total), CUDA_SUCCESS);
  }
  EXPECT_EQ(fake.counter("retained"), 0);
  EXPECT_EQ(fake.counter("pushed"), 0);
  EXPECT_EQ(fake.counter("contexts_created"), 0);
}

TEST(ScopedContext, SkipsADeviceWhosePrimaryContextWentInactiveAfterTheProbe) {
  FakeCuda fake;
  fake.reset({{"devices", {{{"primary_active", true}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const auto found = gpucleanup::probe(driver);
  fake.update({{"devices", {{{"primary_active", false}}}}});
  {
    ScopedContext scope(driver, found.devices[0]);
    EXPECT_FALSE(scope.entered());
    EXPECT_FALSE(scope.failure().has_value());
    EXPECT_EQ(fake.counter("pushed"), 0);
  }
  // Checked again before the retain, which would have created a context.
  EXPECT_EQ(fake.counter("calls.cuDevicePrimaryCtxRetain"), 0);
  EXPECT_EQ(fake.counter("contexts_created"), 0);
  EXPECT_EQ(fake.counter("calls.cuCtxPushCurrent"), 0);
}

TEST(ScopedContext, UsesTheCurrentNonPrimaryContextWithoutRetainOrPush) {
  FakeCuda fake;
  fake.reset({{"current_context", {{"device", 0}, {"primary", false}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const auto found = gpucleanup::probe(driver);
  ASSERT_EQ(found.devices[0].context, ContextKind::current);
  {
    ScopedContext scope(driver, found.devices[0]);
    EXPECT_TRUE(scope.entered());
    size_t free = 0, total = 0;
    EXPECT_EQ(driver.api().cuMemGetInfo(&free, &total), CUDA_SUCCESS);
  }
  EXPECT_EQ(fake.counter("calls.cuDevicePrimaryCtxRetain"), 0);
  EXPECT_EQ(fake.counter("calls.cuCtxPushCurrent"), 0);
  EXPECT_EQ(fake.counter("contexts_created"), 0);
}

TEST(ScopedContext, ReportsAFailedRetainAndReleasesNothing) {
  FakeCuda fake;
  fake.reset({{"devices", {{{"primary_active", true}, {"errors", {{"cuDevicePrimaryCtxRetain", 999}}}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const auto found = gpucleanup::probe(driver);
  {
    ScopedContext scope(driver, found.devices[0]);
    EXPECT_FALSE(scope.entered());
    ASSERT_TRUE(scope.failure().has_value());
    EXPECT_EQ(scope.failure()->call, "cuDevicePrimaryCtxRetain");
    EXPECT_EQ(scope.failure()->code, CUDA_ERROR_UNKNOWN);
  }
  EXPECT_EQ(fake.counter("calls.cuDevicePrimaryCtxRelease"), 0);
}

TEST(Failure, StickyErrorSaysTheDeviceIsUnusableAndToRestart) {
  FakeCuda fake;
  fake.reset();
  const Driver driver(FAKE_CUDA_PATH);
  const gpucleanup::CallFailure failure{"cuMemGetInfo", CUDA_ERROR_ILLEGAL_ADDRESS};
  EXPECT_EQ(gpucleanup::failure_message(driver, 0, failure),
            "GPU0 is unusable after CUDA_ERROR_ILLEGAL_ADDRESS: restart the kernel");
  const json error = gpucleanup::failure_json(driver, 0, failure);
  EXPECT_EQ(error["id"], "gpucleanup.devices.201");
  EXPECT_EQ(error["code"], 700);
  EXPECT_EQ(error["call"], "cuMemGetInfo");
  EXPECT_EQ(error["sticky"], true);
  EXPECT_EQ(error["message"],
            "[gpucleanup.devices.201] GPU0 is unusable after CUDA_ERROR_ILLEGAL_ADDRESS: restart the kernel");
}
