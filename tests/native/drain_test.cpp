// The drain: a settle bounded by one limit on watchdog threads, then the
// driver's pools trimmed, on devices in use only.
#include "drain.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <thread>

#include "accounting.hpp"
#include "process_state.hpp"
#include "test_support.hpp"

using gpucleanup::DeviceRegistry;
using gpucleanup::DrainOptions;
using gpucleanup::Driver;
using gpucleanup::testing::FakeCuda;
using gpucleanup::testing::GiB;
using gpucleanup::testing::MiB;
using nlohmann::json;
using namespace std::chrono_literals;

namespace {

// Polls (never a blind sleep) until `done` holds or 10 s pass.
bool eventually(const std::function<bool()>& done) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

DrainOptions with_timeout(double seconds) {
  DrainOptions options;
  options.timeout_s = seconds;
  return options;
}

class DrainTest : public ::testing::Test {
 protected:
  // A watchdog left hanging by a test must finish before the next scenario.
  void TearDown() override {
    fake.release_sync();
    EXPECT_TRUE(eventually([&] { return fake.counter("syncs_in_flight") == 0 && fake.counter("retained") == 0; }));
  }

  FakeCuda fake;
  DeviceRegistry registry;
};

}  // namespace

TEST_F(DrainTest, TrimReleasesReservedBytesAndFreeRisesByThatAmount) {
  fake.reset({{"devices",
               {{{"primary_active", true},
                 {"free_bytes", 10 * GiB},
                 {"default_pool", {{"reserved_bytes", 2 * GiB}, {"used_bytes", 512 * MiB}}}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const json report = gpucleanup::drain(driver, registry, with_timeout(5));
  EXPECT_EQ(report["kind"], "drain");
  EXPECT_EQ(report["interrupted"], false);
  ASSERT_EQ(report["devices"].size(), 1u);
  const json& device = report["devices"][0];
  EXPECT_EQ(device["state"], "drained");
  EXPECT_EQ(device["settle"]["status"], "done");
  EXPECT_EQ(device["context"], "primary");
  ASSERT_EQ(device["pools"].size(), 1u);
  EXPECT_EQ(device["pools"][0]["reserved_before_bytes"], 2 * GiB);
  EXPECT_EQ(device["pools"][0]["reserved_after_bytes"], 512 * MiB);
  EXPECT_EQ(device["pools"][0]["trimmed"], true);
  EXPECT_EQ(device["released_bytes"], 2 * GiB - 512 * MiB);
  EXPECT_EQ(device["free_before_bytes"], 10 * GiB);
  EXPECT_EQ(device["free_after_bytes"], 10 * GiB + 2 * GiB - 512 * MiB);
  EXPECT_TRUE(device["error"].is_null());
  EXPECT_EQ(fake.counter("calls.cuCtxSynchronize"), 1);
  EXPECT_EQ(fake.counter("contexts_created"), 0);
  EXPECT_EQ(fake.counter("pushed"), 0);
}

TEST_F(DrainTest, SettleOnlyWaitsAndReportsThePoolsWithoutTrimming) {
  fake.reset({{"devices",
               {{{"primary_active", true},
                 {"free_bytes", 10 * GiB},
                 {"default_pool", {{"reserved_bytes", 2 * GiB}, {"used_bytes", 512 * MiB}}}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  DrainOptions options = with_timeout(5);
  options.trim = false;
  const json report = gpucleanup::drain(driver, registry, options);
  EXPECT_EQ(report["trim"], false);
  const json& device = report["devices"][0];
  EXPECT_EQ(device["state"], "drained");
  EXPECT_EQ(device["settle"]["status"], "done");
  ASSERT_EQ(device["pools"].size(), 1u);
  EXPECT_EQ(device["pools"][0]["reserved_before_bytes"], 2 * GiB);
  EXPECT_EQ(device["pools"][0]["reserved_after_bytes"], 2 * GiB);
  EXPECT_EQ(device["pools"][0]["trimmed"], false);
  EXPECT_EQ(device["released_bytes"], 0);
  EXPECT_EQ(device["free_after_bytes"], 10 * GiB);
  EXPECT_TRUE(device["message"].is_null());
  EXPECT_EQ(fake.counter("calls.cuCtxSynchronize"), 1);
  EXPECT_EQ(fake.counter("calls.cuMemPoolTrimTo"), 0);
}

TEST_F(DrainTest, TrimsTheDefaultAndTheCurrentPool) {
  fake.reset({{"devices",
               {{{"primary_active", true},
                 {"default_pool", {{"reserved_bytes", 1 * GiB}}},
                 {"current_pool", {{"reserved_bytes", 3 * GiB}, {"used_bytes", 1 * GiB}}}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const json report = gpucleanup::drain(driver, registry, with_timeout(5));
  const json& device = report["devices"][0];
  ASSERT_EQ(device["pools"].size(), 2u);
  EXPECT_EQ(device["pools"][0]["which"], "default");
  EXPECT_EQ(device["pools"][1]["which"], "current");
  EXPECT_EQ(device["pools"][1]["reserved_after_bytes"], 1 * GiB);
  EXPECT_EQ(device["released_bytes"], 1 * GiB + 2 * GiB);
  EXPECT_EQ(fake.counter("calls.cuMemPoolTrimTo"), 2);
}

TEST_F(DrainTest, PendingFreeIsReleasedOnlyAfterTheSettle) {
  fake.reset({{"devices",
               {{{"primary_active", true},
                 {"default_pool", {{"reserved_bytes", 1 * GiB}, {"used_bytes", 0}, {"pending_free_bytes", 1 * GiB}}}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const json unsettled = gpucleanup::drain(driver, registry, with_timeout(0));
  EXPECT_EQ(unsettled["devices"][0]["settle"]["status"], "skipped");
  EXPECT_EQ(unsettled["devices"][0]["released_bytes"], 0);
  EXPECT_EQ(fake.counter("calls.cuCtxSynchronize"), 0);

  const json settled = gpucleanup::drain(driver, registry, with_timeout(5));
  EXPECT_EQ(settled["devices"][0]["settle"]["status"], "done");
  EXPECT_EQ(settled["devices"][0]["released_bytes"], 1 * GiB);
  EXPECT_EQ(settled["devices"][0]["pools"][0]["reserved_after_bytes"], 0);
}

TEST_F(DrainTest, IdleDevicesAreNeitherListedNorTouched) {
  json devices = json::array();
  for (int i = 0; i < 8; ++i) devices.push_back({{"primary_active", i == 1 || i == 4 || i == 6}});
  fake.reset({{"devices", devices}});
  const Driver driver(FAKE_CUDA_PATH);
  const json report = gpucleanup::drain(driver, registry, with_timeout(5));
  ASSERT_EQ(report["devices"].size(), 3u);
  EXPECT_EQ(report["devices"][0]["index"], 1);
  EXPECT_EQ(report["devices"][1]["index"], 4);
  EXPECT_EQ(report["devices"][2]["index"], 6);
  EXPECT_EQ(fake.counter("contexts_created"), 0);
  EXPECT_EQ(fake.counter("cuInit"), 0);
  EXPECT_EQ(fake.counter("calls.cuCtxSynchronize"), 3);
  // Retained by the probe and entered once each, by its watchdog, for the whole pass.
  EXPECT_EQ(fake.counter("calls.cuDevicePrimaryCtxRetain"), 3);
  EXPECT_EQ(fake.counter("calls.cuCtxPushCurrent"), 3);
  EXPECT_EQ(fake.counter("calls.cuDevicePrimaryCtxGetState"), 8);
}

TEST_F(DrainTest, NotInitialisedProcessDrainsNothing) {
  fake.reset({{"initialized", false}});
  const Driver driver(FAKE_CUDA_PATH);
  const json report = gpucleanup::drain(driver, registry, with_timeout(5));
  EXPECT_EQ(report["driver"]["state"], "not_initialized");
  EXPECT_TRUE(report["devices"].empty());
  EXPECT_EQ(fake.counter("cuInit"), 0);
}

TEST_F(DrainTest, SettleReturnsAtTheLimitWhileTheGpuNeverFinishes) {
  fake.reset({{"devices",
               {{{"primary_active", true}, {"sync_seconds", -1}, {"default_pool", {{"reserved_bytes", 1 * GiB}}}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const auto start = std::chrono::steady_clock::now();
  const json report = gpucleanup::drain(driver, registry, with_timeout(0.3));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(took, 0.3 + 0.5);
  const json& device = report["devices"][0];
  EXPECT_EQ(device["state"], "busy");
  EXPECT_EQ(device["settle"]["status"], "timeout");
  EXPECT_GE(device["settle"]["waited_s"].get<double>(), 0.29);
  EXPECT_GE(device["settle"]["busy_for_s"].get<double>(), 0.29);
  EXPECT_EQ(device["message"].get<std::string>().rfind("GPU0 is still busy after 0.3 s", 0), 0u) << device["message"];
  // A busy device is not trimmed.
  EXPECT_TRUE(device["pools"].empty());
  EXPECT_EQ(fake.counter("calls.cuMemPoolTrimTo"), 0);
  EXPECT_EQ(fake.counter("syncs_in_flight"), 1);
}

TEST_F(DrainTest, NextDrainReportsStillBusyWithoutASecondWait) {
  fake.reset({{"devices", {{{"primary_active", true}, {"sync_seconds", -1}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  gpucleanup::drain(driver, registry, with_timeout(0.1));
  ASSERT_TRUE(eventually([&] { return fake.counter("syncs_in_flight") == 1; }));

  const json again = gpucleanup::drain(driver, registry, with_timeout(5));
  const json& device = again["devices"][0];
  EXPECT_EQ(device["state"], "busy");
  EXPECT_EQ(device["settle"]["status"], "still_busy");
  EXPECT_GE(device["settle"]["busy_for_s"].get<double>(), 0.1);
  EXPECT_LT(again["elapsed_s"].get<double>(), 1.0);
  EXPECT_EQ(fake.counter("calls.cuCtxSynchronize"), 1);

  const json snapshot = gpucleanup::take_snapshot(driver, registry, gpucleanup::SnapshotKind::snapshot);
  EXPECT_EQ(snapshot["devices"][0]["state"], "busy");
  EXPECT_TRUE(snapshot["devices"][0]["busy_for_s"].is_number());

  // Once the GPU finishes, the next drain waits and trims as usual.
  fake.release_sync();
  ASSERT_TRUE(eventually([&] { return fake.counter("syncs_in_flight") == 0 && fake.counter("retained") == 0; }));
  const json after = gpucleanup::drain(driver, registry, with_timeout(5));
  EXPECT_EQ(after["devices"][0]["state"], "drained");
  EXPECT_EQ(after["devices"][0]["settle"]["status"], "done");
  EXPECT_EQ(fake.counter("calls.cuCtxSynchronize"), 2);
}

TEST_F(DrainTest, SettlesAllDevicesConcurrentlyWithinOneLimit) {
  json devices = json::array();
  for (int i = 0; i < 4; ++i) devices.push_back({{"primary_active", true}, {"sync_seconds", i == 0 ? 0 : -1}});
  fake.reset({{"devices", devices}});
  const Driver driver(FAKE_CUDA_PATH);
  const json report = gpucleanup::drain(driver, registry, with_timeout(0.4));
  EXPECT_LT(report["elapsed_s"].get<double>(), 0.4 + 0.5);
  ASSERT_EQ(report["devices"].size(), 4u);
  EXPECT_EQ(report["devices"][0]["state"], "drained");
  for (int i = 1; i < 4; ++i) EXPECT_EQ(report["devices"][i]["settle"]["status"], "timeout") << i;
  EXPECT_EQ(fake.counter("syncs_in_flight"), 3);
}

TEST_F(DrainTest, ProgressIsReportedOnTheCallingThreadAndCanInterrupt) {
  fake.reset({{"devices", {json::object(), {{"primary_active", true}, {"sync_seconds", -1}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  DrainOptions options = with_timeout(30);
  options.progress_after = 50ms;
  options.progress_every = 20ms;
  int calls = 0;
  json last;
  const auto caller = std::this_thread::get_id();
  options.progress = [&](const json& progress) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    last = progress;
    return ++calls == 3;
  };
  const json report = gpucleanup::drain(driver, registry, options);
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(last["device"], 1);
  EXPECT_EQ(last["limit_s"], 30.0);
  EXPECT_GE(last["waited_s"].get<double>(), 0.05);
  EXPECT_EQ(report["interrupted"], true);
  EXPECT_LT(report["elapsed_s"].get<double>(), 5.0);
  EXPECT_EQ(report["devices"][0]["settle"]["status"], "interrupted");
  EXPECT_EQ(report["devices"][0]["state"], "busy");
}

TEST_F(DrainTest, NoProgressBeforeTheWaitPassesItsThreshold) {
  fake.reset({{"devices", {{{"primary_active", true}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  DrainOptions options = with_timeout(30);
  int calls = 0;
  options.progress = [&](const json&) { return ++calls > 0; };
  const json report = gpucleanup::drain(driver, registry, options);
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(report["interrupted"], false);
  EXPECT_EQ(report["devices"][0]["settle"]["status"], "done");
}

TEST_F(DrainTest, StickyErrorIsSaidWithTheExactMessageAndTheDeviceLeftAlone) {
  fake.reset({{"devices", {{{"primary_active", true}, {"sticky_error", 700}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const json first = gpucleanup::drain(driver, registry, with_timeout(5));
  const json& device = first["devices"][0];
  EXPECT_EQ(device["state"], "unusable");
  EXPECT_EQ(device["message"], "GPU0 is unusable after CUDA_ERROR_ILLEGAL_ADDRESS: restart the kernel");
  EXPECT_EQ(device["error"]["id"], "gpucleanup.devices.201");
  EXPECT_EQ(device["error"]["sticky"], true);
  EXPECT_EQ(device["settle"]["status"], "skipped");
  const auto memory_calls = fake.counter("calls.cuMemGetInfo");
  EXPECT_EQ(fake.counter("calls.cuCtxSynchronize"), 0);

  const json second = gpucleanup::drain(driver, registry, with_timeout(5));
  EXPECT_EQ(second["devices"][0]["state"], "unusable");
  EXPECT_EQ(second["devices"][0]["message"], device["message"]);
  EXPECT_EQ(fake.counter("calls.cuMemGetInfo"), memory_calls);
  EXPECT_EQ(fake.counter("calls.cuCtxSynchronize"), 0);
  EXPECT_EQ(fake.counter("calls.cuMemPoolTrimTo"), 0);
  EXPECT_EQ(fake.counter("calls.cuDevicePrimaryCtxRetain"), 1);
}

TEST_F(DrainTest, StickyErrorFromTheSettleMarksTheDeviceUnusable) {
  fake.reset({{"devices",
               {{{"primary_active", true}, {"errors", {{"cuCtxSynchronize", 719}}}},
                {{"primary_active", true}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const json first = gpucleanup::drain(driver, registry, with_timeout(5));
  EXPECT_EQ(first["devices"][0]["state"], "unusable");
  EXPECT_EQ(first["devices"][0]["settle"]["status"], "error");
  EXPECT_EQ(first["devices"][0]["message"], "GPU0 is unusable after CUDA_ERROR_LAUNCH_FAILED: restart the kernel");
  EXPECT_EQ(first["devices"][0]["error"]["call"], "cuCtxSynchronize");
  EXPECT_EQ(first["devices"][1]["state"], "drained");
  const auto memory_calls = fake.counter("calls.cuMemGetInfo");

  const json snapshot = gpucleanup::take_snapshot(driver, registry, gpucleanup::SnapshotKind::snapshot);
  EXPECT_EQ(snapshot["devices"][0]["state"], "unusable");
  EXPECT_EQ(fake.counter("calls.cuMemGetInfo"), memory_calls + 1);  // GPU1 only
}

TEST_F(DrainTest, MissingTrimEntryPointDegradesToAnUntrimmedReport) {
  fake.reset({{"missing", {"cuMemPoolTrimTo"}},
              {"devices", {{{"primary_active", true}, {"default_pool", {{"reserved_bytes", 1 * GiB}}}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const json report = gpucleanup::drain(driver, registry, with_timeout(5));
  EXPECT_EQ(report["driver"]["missing_optional"], json::array({"cuMemPoolTrimTo"}));
  const json& device = report["devices"][0];
  EXPECT_EQ(device["state"], "drained");
  ASSERT_EQ(device["pools"].size(), 1u);
  EXPECT_EQ(device["pools"][0]["trimmed"], false);
  EXPECT_EQ(device["pools"][0]["reserved_after_bytes"], 1 * GiB);
  EXPECT_EQ(device["released_bytes"], 0);
  EXPECT_EQ(device["message"],
            "the CUDA driver has no cuMemPoolTrimTo: GPU0's memory pools were not trimmed (update the NVIDIA driver "
            "to free them)");
}

TEST_F(DrainTest, SettlesAndTrimsThroughANonPrimaryCurrentContext) {
  fake.reset({{"devices",
               {{{"default_pool", {{"reserved_bytes", 1 * GiB}, {"pending_free_bytes", 1 * GiB}}}}}},
              {"current_context", {{"device", 0}, {"primary", false}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const json report = gpucleanup::drain(driver, registry, with_timeout(5));
  ASSERT_EQ(report["devices"].size(), 1u);
  const json& device = report["devices"][0];
  EXPECT_EQ(device["context"], "current");
  EXPECT_EQ(device["settle"]["status"], "done");
  EXPECT_EQ(device["released_bytes"], 1 * GiB);
  EXPECT_EQ(fake.counter("contexts_created"), 0);
  EXPECT_EQ(fake.counter("calls.cuDevicePrimaryCtxRetain"), 0);
  EXPECT_EQ(fake.counter("pushed"), 0);
}

TEST(DrainDeathTest, WatchdogMakesNoDriverCallOnceTheProcessIsExiting) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        FakeCuda fake;
        fake.reset({{"devices", {{{"primary_active", true}, {"sync_seconds", -1}}}}});
        const Driver driver(FAKE_CUDA_PATH);
        DeviceRegistry registry;
        const auto device = gpucleanup::probe(driver).devices.at(0);
        const json report = gpucleanup::drain(driver, registry, with_timeout(0.05));
        if (report["devices"][0]["settle"]["status"] != "timeout") std::exit(1);
        const auto wait = registry.at(device).wait;
        if (!wait || !eventually([&] { return fake.counter("syncs_in_flight") == 1; })) std::exit(2);
        const long long pops = fake.counter("calls.cuCtxPopCurrent");
        gpucleanup::mark_process_exiting();
        fake.release_sync();
        if (!eventually([&] { return wait->finished.load(); })) std::exit(3);
        // The watchdog's context stays pushed and retained: no call at exit.
        const bool quiet = fake.counter("calls.cuCtxPopCurrent") == pops && fake.counter("retained") == 1;
        std::exit(quiet ? 0 : 4);
      },
      ::testing::ExitedWithCode(0), "");
}
