// Snapshots: memory only for devices in use, nothing that needs a context for
// the others, sticky errors said and the device left alone.
#include "accounting.hpp"

#include <gtest/gtest.h>

#include <set>

#include "test_support.hpp"

using gpucleanup::DeviceRegistry;
using gpucleanup::Driver;
using gpucleanup::SnapshotKind;
using gpucleanup::take_snapshot;
using gpucleanup::testing::eight_devices_three_in_use;
using gpucleanup::testing::FakeCuda;
using gpucleanup::testing::GiB;
using gpucleanup::testing::MiB;
using nlohmann::json;

TEST(Snapshot, EightDevicesThreeInUseGetMemoryAndNoContextIsCreated) {
  FakeCuda fake;
  fake.reset(eight_devices_three_in_use());
  const json scripted = fake.state();
  const Driver driver(FAKE_CUDA_PATH);
  DeviceRegistry registry;
  const json report = take_snapshot(driver, registry, SnapshotKind::snapshot);
  EXPECT_EQ(report["kind"], "snapshot");
  EXPECT_EQ(report["driver"]["state"], "ready");
  ASSERT_EQ(report["devices"].size(), 8u);
  std::set<int> with_memory;
  for (const json& device : report["devices"]) {
    const int i = device["index"];
    EXPECT_EQ(device["name"], scripted["devices"][i]["name"]);
    EXPECT_EQ(device["uuid"], scripted["devices"][i]["uuid"]);
    EXPECT_EQ(device["total_bytes"], 80 * GiB);
    if (device["in_use"] == true) {
      with_memory.insert(i);
      EXPECT_EQ(device["state"], "in_use");
      EXPECT_EQ(device["context"], "primary");
      EXPECT_EQ(device["free_bytes"], 80 * GiB - 512 * MiB);
      EXPECT_EQ(device["used_bytes"], 512 * MiB);
      EXPECT_EQ(device["ctx_total_bytes"], 80 * GiB);
      EXPECT_EQ(device["pools"].size(), 1u);
    } else {
      EXPECT_EQ(device["state"], "idle");
      EXPECT_TRUE(device["context"].is_null());
      EXPECT_TRUE(device["free_bytes"].is_null());
      EXPECT_TRUE(device["used_bytes"].is_null());
      EXPECT_TRUE(device["pools"].empty());
    }
  }
  EXPECT_EQ(with_memory, (std::set<int>{1, 4, 6}));
  EXPECT_EQ(fake.counter("contexts_created"), 0);
  EXPECT_EQ(fake.counter("cuInit"), 0);
  EXPECT_EQ(fake.counter("calls.cuMemGetInfo"), 3);
  EXPECT_EQ(fake.counter("calls.cuDevicePrimaryCtxRetain"), 3);
  EXPECT_EQ(fake.counter("calls.cuDeviceGetDefaultMemPool"), 3);
  EXPECT_EQ(fake.counter("retained"), 0);
  EXPECT_EQ(fake.counter("pushed"), 0);
}

TEST(Snapshot, ProbeMakesNoMemoryQueries) {
  FakeCuda fake;
  fake.reset(eight_devices_three_in_use());
  const Driver driver(FAKE_CUDA_PATH);
  DeviceRegistry registry;
  const json report = take_snapshot(driver, registry, SnapshotKind::probe);
  EXPECT_EQ(report["kind"], "probe");
  ASSERT_EQ(report["devices"].size(), 8u);
  EXPECT_EQ(report["devices"][4]["state"], "in_use");
  EXPECT_FALSE(report["devices"][4].contains("free_bytes"));
  EXPECT_EQ(fake.counter("calls.cuMemGetInfo"), 0);
  EXPECT_EQ(fake.counter("calls.cuDevicePrimaryCtxRetain"), 0);
  EXPECT_EQ(fake.counter("calls.cuDeviceGetName"), 0);
}

TEST(Snapshot, NotInitialisedProcessListsNoDevicesAndNeverCallsCuInit) {
  FakeCuda fake;
  fake.reset({{"initialized", false}});
  const Driver driver(FAKE_CUDA_PATH);
  DeviceRegistry registry;
  const json report = take_snapshot(driver, registry, SnapshotKind::snapshot);
  EXPECT_EQ(report["driver"]["state"], "not_initialized");
  EXPECT_TRUE(report["devices"].empty());
  EXPECT_EQ(fake.counter("cuInit"), 0);
}

TEST(Snapshot, NoDriverIsAState) {
  const Driver driver("/nonexistent/libcuda.so.1");
  DeviceRegistry registry;
  const json report = take_snapshot(driver, registry, SnapshotKind::snapshot);
  EXPECT_EQ(report["driver"]["state"], "no_driver");
  EXPECT_EQ(report["driver"]["path"], "/nonexistent/libcuda.so.1");
  EXPECT_TRUE(report["driver"]["version"].is_null());
  EXPECT_TRUE(report["driver"]["resolver"].is_null());
  EXPECT_TRUE(report["devices"].empty());
}

TEST(Snapshot, ReportsTheDefaultPoolAndADistinctCurrentPool) {
  FakeCuda fake;
  fake.reset({{"devices",
               {{{"primary_active", true},
                 {"default_pool", {{"reserved_bytes", 2 * GiB}, {"used_bytes", 512 * MiB}}},
                 {"current_pool", {{"reserved_bytes", 1 * GiB}, {"used_bytes", 0}, {"pending_free_bytes", 256 * MiB}}}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  DeviceRegistry registry;
  const json report = take_snapshot(driver, registry, SnapshotKind::snapshot);
  const json& pools = report["devices"][0]["pools"];
  ASSERT_EQ(pools.size(), 2u);
  EXPECT_EQ(pools[0]["which"], "default");
  EXPECT_EQ(pools[0]["reserved_bytes"], 2 * GiB);
  EXPECT_EQ(pools[0]["used_bytes"], 512 * MiB);
  EXPECT_EQ(pools[1]["which"], "current");
  EXPECT_NE(pools[0]["handle"], pools[1]["handle"]);
  EXPECT_EQ(pools[1]["reserved_bytes"], 1 * GiB);
  EXPECT_EQ(pools[1]["used_bytes"], 256 * MiB);  // unobserved frees still count as used
  EXPECT_GE(pools[1]["reserved_high_bytes"].get<std::uint64_t>(), 1 * GiB);
}

TEST(Snapshot, DevicesWithoutPoolSupportListNoPools) {
  FakeCuda fake;
  fake.reset({{"devices", {{{"primary_active", true}, {"pools_supported", false}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  DeviceRegistry registry;
  const json report = take_snapshot(driver, registry, SnapshotKind::snapshot);
  EXPECT_EQ(report["devices"][0]["state"], "in_use");
  EXPECT_TRUE(report["devices"][0]["pools"].empty());
  EXPECT_TRUE(report["devices"][0]["error"].is_null());
}

TEST(Snapshot, UsesTheNonPrimaryContextCurrentToTheThread) {
  FakeCuda fake;
  fake.reset({{"devices", {json::object(), json::object()}}, {"current_context", {{"device", 1}, {"primary", false}}}});
  const Driver driver(FAKE_CUDA_PATH);
  DeviceRegistry registry;
  const json report = take_snapshot(driver, registry, SnapshotKind::snapshot);
  EXPECT_EQ(report["devices"][0]["state"], "idle");
  const json& device = report["devices"][1];
  EXPECT_EQ(device["in_use"], true);
  EXPECT_EQ(device["context"], "current");
  EXPECT_EQ(device["state"], "in_use");
  EXPECT_TRUE(device["free_bytes"].is_number());
  EXPECT_EQ(fake.counter("contexts_created"), 0);
  EXPECT_EQ(fake.counter("calls.cuDevicePrimaryCtxRetain"), 0);
}

TEST(Snapshot, StickyErrorIsReportedAndTheDeviceIsThenLeftAlone) {
  FakeCuda fake;
  fake.reset({{"devices", {{{"primary_active", true}, {"sticky_error", 700}}, {{"primary_active", true}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  DeviceRegistry registry;
  const json first = take_snapshot(driver, registry, SnapshotKind::snapshot);
  const json& device = first["devices"][0];
  EXPECT_EQ(device["state"], "unusable");
  EXPECT_EQ(device["error"]["name"], "CUDA_ERROR_ILLEGAL_ADDRESS");
  EXPECT_EQ(device["error"]["call"], "cuMemGetInfo");
  EXPECT_EQ(device["error"]["sticky"], true);
  EXPECT_EQ(device["error"]["message"],
            "[gpucleanup.devices.201] GPU0 is unusable after CUDA_ERROR_ILLEGAL_ADDRESS: restart the kernel");
  EXPECT_EQ(first["devices"][1]["state"], "in_use");
  const auto memory_calls = fake.counter("calls.cuMemGetInfo");
  const auto retains = fake.counter("calls.cuDevicePrimaryCtxRetain");
  EXPECT_EQ(memory_calls, 2);

  const json second = take_snapshot(driver, registry, SnapshotKind::snapshot);
  EXPECT_EQ(second["devices"][0]["state"], "unusable");
  EXPECT_EQ(second["devices"][0]["error"], device["error"]);
  EXPECT_TRUE(second["devices"][0]["free_bytes"].is_null());
  // Only GPU1 was queried again.
  EXPECT_EQ(fake.counter("calls.cuMemGetInfo"), memory_calls + 1);
  EXPECT_EQ(fake.counter("calls.cuDevicePrimaryCtxRetain"), retains + 1);
}

TEST(Snapshot, NonStickyErrorIsReportedByNameAndTriedAgainNextTime) {
  FakeCuda fake;
  fake.reset({{"devices", {{{"primary_active", true}, {"errors", {{"cuMemGetInfo", 2}}}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  DeviceRegistry registry;
  const json first = take_snapshot(driver, registry, SnapshotKind::snapshot);
  EXPECT_EQ(first["devices"][0]["state"], "error");
  EXPECT_EQ(first["devices"][0]["error"]["id"], "gpucleanup.devices.202");
  EXPECT_EQ(first["devices"][0]["error"]["message"],
            "[gpucleanup.devices.202] cuMemGetInfo failed with CUDA_ERROR_OUT_OF_MEMORY (2) on GPU0: gpucleanup "
            "left the device alone this time");
  EXPECT_EQ(first["devices"][0]["error"]["sticky"], false);
  fake.update({{"devices", {{{"errors", {{"cuMemGetInfo", 0}}}}}}});
  const json second = take_snapshot(driver, registry, SnapshotKind::snapshot);
  EXPECT_EQ(second["devices"][0]["state"], "in_use");
  EXPECT_TRUE(second["devices"][0]["free_bytes"].is_number());
}

TEST(Snapshot, WorksThroughEveryResolver) {
  for (const char* path : {FAKE_CUDA_PATH, FAKE_CUDA_V1_PATH, FAKE_CUDA_PLAIN_PATH}) {
    FakeCuda fake(path);
    fake.reset({{"driver_version", 12080},  // every optional entry point, the checkpoint calls included
                {"devices", {{{"primary_active", true}, {"default_pool", {{"reserved_bytes", 1 * GiB}}}}}}});
    const Driver driver(path);
    DeviceRegistry registry;
    const json report = take_snapshot(driver, registry, SnapshotKind::snapshot);
    const json& device = report["devices"][0];
    EXPECT_EQ(device["state"], "in_use") << path;
    EXPECT_EQ(device["free_bytes"], 80 * GiB - 512 * MiB - 1 * GiB) << path;
    ASSERT_EQ(device["pools"].size(), 1u) << path;
    EXPECT_EQ(device["pools"][0]["reserved_bytes"], 1 * GiB) << path;
    EXPECT_TRUE(report["driver"]["missing_optional"].empty()) << path;
    EXPECT_EQ(fake.counter("contexts_created"), 0) << path;
  }
}
