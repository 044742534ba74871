// The after-cell pass: one call, one pass through the driver per cell. Exact
// driver calls per call (from the fake's counters), no thread started per call,
// one retain and one push per device in use, no context ever created, a
// primary context reset by a framework never used through a stale handle.
#include "drain.hpp"

#include "gpucleanup/gpucleanup.h"

#include <gtest/gtest.h>

#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <thread>

#include "accounting.hpp"
#include "process_state.hpp"
#include "test_support.hpp"
#include "watchdog.hpp"

using gpucleanup::DeviceRegistry;
using gpucleanup::DrainOptions;
using gpucleanup::Driver;
using gpucleanup::testing::FakeCuda;
using gpucleanup::testing::GiB;
using gpucleanup::testing::MiB;
using nlohmann::json;
using namespace std::chrono_literals;

namespace {

using Counts = std::map<std::string, long long>;

bool eventually(const std::function<bool()>& done) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// Every driver entry point the fake counted ("calls.<entry>"), by entry.
Counts driver_calls(const FakeCuda& fake) {
  Counts calls;
  const json counters = fake.state()["counters"];
  for (auto it = counters.begin(); it != counters.end(); ++it) {
    if (it.key().rfind("calls.", 0) == 0 && it.value().get<long long>() != 0) {
      calls[it.key().substr(6)] = it.value().get<long long>();
    }
  }
  return calls;
}

Counts minus(const Counts& after, const Counts& before) {
  Counts delta;
  for (const auto& [name, value] : after) {
    const auto it = before.find(name);
    const long long d = value - (it == before.end() ? 0 : it->second);
    if (d != 0) delta[name] = d;
  }
  return delta;
}

long long total(const Counts& counts) {
  long long sum = 0;
  for (const auto& [name, value] : counts) sum += value;
  return sum;
}

std::string show(const Counts& counts) { return json(counts).dump(); }

// One cell's worth of driver calls with one device in use, idle (its queued
// work already done), its default pool holding memory: the probe (5 calls and
// the retain), then on the device's watchdog one push for the whole pass.
const Counts kOneDeviceInUse = {
    {"cuDeviceGetCount", 1},            // probe: is CUDA initialised
    {"cuCtxGetCurrent", 1},             // probe: a context current to this thread
    {"cuDeviceGet", 1},                 // probe
    {"cuDeviceGetUuid", 1},             // probe: the registry's key
    {"cuDevicePrimaryCtxGetState", 1},  // probe: in use
    {"cuDevicePrimaryCtxRetain", 1},    // probe, right after the state said active
    {"cuCtxPushCurrent", 2},            // the look at the pools before the settle; watchdog: one for the pass
    {"cuMemGetInfo", 2},                // free before, free after
    {"cuDeviceGetDefaultMemPool", 2},   // the look, the pass
    {"cuDeviceGetMemPool", 2},
    {"cuMemPoolGetAttribute", 3},       // the look: the pool reserves memory, so no event; the pass: before, after
    {"cuCtxSynchronize", 1},            // the settle
    {"cuMemPoolTrimTo", 1},
    {"cuCtxPopCurrent", 2},
    {"cuDevicePrimaryCtxRelease", 1},
};

// A device whose driver pools reserve nothing and which has nothing queued: the event says so, and the
// pass runs on the calling thread (no cuCtxSynchronize, no watchdog).
const Counts kOneDeviceIdle = {
    {"cuDeviceGetCount", 1},         {"cuCtxGetCurrent", 1},           {"cuDeviceGet", 1},
    {"cuDeviceGetUuid", 1},          {"cuDevicePrimaryCtxGetState", 1}, {"cuDevicePrimaryCtxRetain", 1},
    {"cuCtxPushCurrent", 2},         {"cuDeviceGetDefaultMemPool", 2}, {"cuDeviceGetMemPool", 2},
    {"cuMemPoolGetAttribute", 3},    {"cuEventCreate", 1},             {"cuCtxRecordEvent", 1},
    {"cuEventQuery", 1},             {"cuEventDestroy", 1},            {"cuMemGetInfo", 1},
    {"cuMemPoolTrimTo", 1},          {"cuCtxPopCurrent", 2},           {"cuDevicePrimaryCtxRelease", 1},
};

// A pass that finds nothing to give back: the free memory read before the settle stands after it
// (every pool reserves what it did, the trim released nothing), so it is read once.
Counts idle_pass() {
  Counts counts = kOneDeviceInUse;
  counts["cuMemGetInfo"] = 1;
  return counts;
}

const Counts kNothingInUse = {
    {"cuDeviceGetCount", 1}, {"cuCtxGetCurrent", 1}, {"cuDeviceGet", 1},
    {"cuDeviceGetUuid", 1},  {"cuDevicePrimaryCtxGetState", 1},
};

DrainOptions with_timeout(double seconds, bool trim = true) {
  DrainOptions options;
  options.timeout_s = seconds;
  options.trim = trim;
  return options;
}

json one_device(const char* uuid, json extra = json::object()) {
  json device = {{"uuid", uuid},
                 {"primary_active", true},
                 {"free_bytes", 10 * GiB},
                 {"default_pool", {{"reserved_bytes", 2 * GiB}, {"used_bytes", 512 * MiB}}}};
  device.update(extra);
  return {{"devices", {device}}};
}

class AfterCell : public ::testing::Test {
 protected:
  void TearDown() override {
    fake.release_sync();
    EXPECT_TRUE(eventually([&] { return fake.counter("syncs_in_flight") == 0 && fake.counter("retained") == 0; }));
  }

  FakeCuda fake;
  DeviceRegistry registry;
};

}  // namespace

TEST_F(AfterCell, OnePassSettlesTrimsAndReportsMemoryAfterwards) {
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-000000000001",
                        {{"default_pool", {{"reserved_bytes", 2 * GiB}, {"used_bytes", 0}, {"pending_free_bytes", 1 * GiB}}}}));
  const Driver driver(FAKE_CUDA_PATH);
  const json report = gpucleanup::after_cell(driver, registry, with_timeout(5));
  EXPECT_EQ(report["kind"], "after_cell");
  EXPECT_EQ(report["driver"]["state"], "ready");
  EXPECT_EQ(report["trim"], true);
  EXPECT_EQ(report["interrupted"], false);
  ASSERT_EQ(report["devices"].size(), 1u);
  const json& device = report["devices"][0];
  EXPECT_EQ(device["index"], 0);
  EXPECT_EQ(device["uuid"], "GPU-af7e0000-0000-4000-8000-000000000001");
  EXPECT_EQ(device["name"], "Fake GPU 0");
  EXPECT_EQ(device["context"], "primary");
  EXPECT_EQ(device["state"], "drained");
  EXPECT_EQ(device["settle"]["status"], "done");
  // The pending free was observed by the settle, so the trim released it too.
  EXPECT_EQ(device["free_before_bytes"], 10 * GiB);
  EXPECT_EQ(device["released_bytes"], 2 * GiB);
  ASSERT_EQ(device["pools"].size(), 1u);
  EXPECT_EQ(device["pools"][0]["reserved_before_bytes"], 2 * GiB);
  EXPECT_EQ(device["pools"][0]["reserved_after_bytes"], 0);
  EXPECT_EQ(device["pools"][0]["trimmed"], true);
  EXPECT_EQ(device["total_bytes"], 80 * GiB);
  EXPECT_EQ(device["free_bytes"], 12 * GiB);
  EXPECT_EQ(device["used_bytes"], 80 * GiB - 12 * GiB);
  EXPECT_TRUE(device["error"].is_null());
  EXPECT_TRUE(device["message"].is_null());
  EXPECT_EQ(fake.counter("contexts_created"), 0);
  EXPECT_EQ(fake.counter("retained"), 0);
  EXPECT_EQ(fake.counter("pushed"), 0);
}

TEST_F(AfterCell, SettleOnlyReportsThePoolsUntrimmed) {
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-000000000002"));
  const Driver driver(FAKE_CUDA_PATH);
  const json report = gpucleanup::after_cell(driver, registry, with_timeout(5, false));
  EXPECT_EQ(report["trim"], false);
  const json& device = report["devices"][0];
  EXPECT_EQ(device["state"], "drained");
  EXPECT_EQ(device["released_bytes"], 0);
  EXPECT_EQ(device["pools"][0]["reserved_after_bytes"], 2 * GiB);
  EXPECT_EQ(device["pools"][0]["trimmed"], false);
  EXPECT_EQ(device["free_bytes"], 10 * GiB);
  EXPECT_EQ(fake.counter("calls.cuMemPoolTrimTo"), 0);
}

TEST_F(AfterCell, ExactDriverCallsPerCallOverAHundredCellsAndNoThreadPerCall) {
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-000000000003"));
  const Driver driver(FAKE_CUDA_PATH);
  // The first cell also reads the static facts and starts the device's watchdog.
  const auto started = gpucleanup::watchdog_threads_started();
  Counts before = driver_calls(fake);
  gpucleanup::after_cell(driver, registry, with_timeout(30));
  Counts first = kOneDeviceInUse;
  first["cuDeviceGetName"] = 1;
  first["cuDeviceTotalMem"] = 1;
  EXPECT_EQ(minus(driver_calls(fake), before), first) << show(minus(driver_calls(fake), before));
  EXPECT_EQ(gpucleanup::watchdog_threads_started(), started + 1);

  for (int cell = 0; cell < 100; ++cell) {
    // Each cell frees something into the pool, as a framework would.
    fake.update({{"devices", {{{"default_pool", {{"reserved_bytes", 1 * GiB}, {"used_bytes", 0}}}}}}});
    before = driver_calls(fake);
    const json report = gpucleanup::after_cell(driver, registry, with_timeout(30));
    const Counts per_call = minus(driver_calls(fake), before);
    ASSERT_EQ(per_call, kOneDeviceInUse) << "cell " << cell << ": " << show(per_call);
    ASSERT_EQ(report["devices"][0]["state"], "drained");
    ASSERT_EQ(report["devices"][0]["released_bytes"], 1 * GiB);
    ASSERT_EQ(fake.counter("retained"), 0) << "cell " << cell;  // given back before the call returned
    ASSERT_EQ(fake.counter("pushed"), 0) << "cell " << cell;
  }
  EXPECT_EQ(total(kOneDeviceInUse), 22);
  EXPECT_EQ(gpucleanup::watchdog_threads_started(), started + 1);
  // Threads that ever called the driver: this one and the device's watchdog.
  EXPECT_EQ(fake.counter("threads"), 2);
  EXPECT_EQ(fake.counter("contexts_created"), 0);
  EXPECT_EQ(fake.counter("cuInit"), 0);
}

TEST_F(AfterCell, NotInitialisedCostsOneDriverCallAndNoThread) {
  fake.reset({{"initialized", false}, {"devices", {{{"uuid", "GPU-af7e0000-0000-4000-8000-000000000004"}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const auto started = gpucleanup::watchdog_threads_started();
  for (int cell = 0; cell < 100; ++cell) {
    const Counts before = driver_calls(fake);
    const json report = gpucleanup::after_cell(driver, registry, with_timeout(30));
    ASSERT_EQ(minus(driver_calls(fake), before), (Counts{{"cuDeviceGetCount", 1}})) << "cell " << cell;
    ASSERT_EQ(report["driver"]["state"], "not_initialized");
    ASSERT_TRUE(report["devices"].empty());
  }
  EXPECT_EQ(gpucleanup::watchdog_threads_started(), started);
  EXPECT_EQ(fake.counter("threads"), 1);
  EXPECT_EQ(fake.counter("cuInit"), 0);
}

TEST_F(AfterCell, NothingInUseIsTheProbeAloneAndNoThread) {
  fake.reset({{"devices", {{{"uuid", "GPU-af7e0000-0000-4000-8000-000000000005"}}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const auto started = gpucleanup::watchdog_threads_started();
  for (int cell = 0; cell < 100; ++cell) {
    const Counts before = driver_calls(fake);
    const json report = gpucleanup::after_cell(driver, registry, with_timeout(30));
    ASSERT_EQ(minus(driver_calls(fake), before), kNothingInUse) << "cell " << cell;
    ASSERT_TRUE(report["devices"].empty());
  }
  EXPECT_EQ(gpucleanup::watchdog_threads_started(), started);
  EXPECT_EQ(fake.counter("contexts_created"), 0);
}

TEST_F(AfterCell, AnIdlePassReadsTheFreeMemoryOnceAndAPassThatReleasesReadsItAgain) {
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-00000000000c"));
  const Driver driver(FAKE_CUDA_PATH);
  json report = gpucleanup::after_cell(driver, registry, with_timeout(30));  // trims the pool to what is used
  const std::uint64_t free_now = report["devices"][0]["free_bytes"];

  // Nothing changed since: one cuMemGetInfo, and the figures after are the ones read before.
  Counts before = driver_calls(fake);
  report = gpucleanup::after_cell(driver, registry, with_timeout(30));
  EXPECT_EQ(minus(driver_calls(fake), before), idle_pass()) << show(minus(driver_calls(fake), before));
  EXPECT_EQ(report["devices"][0]["released_bytes"], 0);
  EXPECT_EQ(report["devices"][0]["free_before_bytes"], free_now);
  EXPECT_EQ(report["devices"][0]["free_bytes"], free_now);

  // Another process took 1 GiB meanwhile and nothing was released: the one read sees it.
  fake.update({{"devices", {{{"free_bytes", free_now - 1 * GiB}}}}});
  before = driver_calls(fake);
  report = gpucleanup::after_cell(driver, registry, with_timeout(30));
  EXPECT_EQ(minus(driver_calls(fake), before), idle_pass());
  EXPECT_EQ(report["devices"][0]["free_bytes"], free_now - 1 * GiB);

  // A cell freed 1 GiB into the pool: the trim gives it back, and the free memory is read again after it.
  fake.update({{"devices", {{{"default_pool", {{"reserved_bytes", 1536 * MiB}, {"used_bytes", 512 * MiB}}}}}}});
  before = driver_calls(fake);
  report = gpucleanup::after_cell(driver, registry, with_timeout(30));
  EXPECT_EQ(minus(driver_calls(fake), before), kOneDeviceInUse);
  EXPECT_EQ(report["devices"][0]["released_bytes"], 1 * GiB);
  EXPECT_EQ(report["devices"][0]["free_bytes"], report["devices"][0]["free_before_bytes"].get<std::uint64_t>() + 1 * GiB);
}

json idle_device(const char* uuid, json extra = json::object()) {
  json device = {{"uuid", uuid},
                 {"primary_active", true},
                 {"free_bytes", 10 * GiB},
                 {"default_pool", {{"reserved_bytes", 0}, {"used_bytes", 0}}}};
  device.update(extra);
  return {{"devices", {device}}};
}

TEST_F(AfterCell, NothingQueuedIsAskedOfAnEventAndThePassRunsOnTheCallingThread) {
  fake.reset(idle_device("GPU-af7e0000-0000-4000-8000-00000000000d"));
  const Driver driver(FAKE_CUDA_PATH);
  gpucleanup::after_cell(driver, registry, with_timeout(30));  // reads the static facts once
  const auto started = gpucleanup::watchdog_threads_started();
  for (int cell = 0; cell < 20; ++cell) {
    const Counts before = driver_calls(fake);
    const json report = gpucleanup::after_cell(driver, registry, with_timeout(30));
    ASSERT_EQ(minus(driver_calls(fake), before), kOneDeviceIdle) << show(minus(driver_calls(fake), before));
    const json& device = report["devices"][0];
    ASSERT_EQ(device["state"], "drained");
    ASSERT_EQ(device["settle"]["status"], "done");  // settled: nothing was queued
    ASSERT_EQ(device["free_bytes"], 10 * GiB);
    ASSERT_EQ(fake.counter("events"), 0) << "cell " << cell;  // every event made is destroyed
    ASSERT_EQ(fake.counter("pushed"), 0);
  }
  EXPECT_EQ(gpucleanup::watchdog_threads_started(), started);  // no watchdog: nothing was waited for
  EXPECT_EQ(fake.counter("threads"), 1);
}

TEST_F(AfterCell, QueuedWorkAnOldDriverOrAFailedEventFallBackToTheWatchdogsSynchronize) {
  const Driver driver(FAKE_CUDA_PATH);
  // Queued work (a synchronize would wait 10 ms): the event is not ready, the watchdog waits.
  fake.reset(idle_device("GPU-af7e0000-0000-4000-8000-00000000000e", {{"sync_seconds", 0.01}}));
  json report = gpucleanup::after_cell(driver, registry, with_timeout(30));
  EXPECT_EQ(fake.counter("calls.cuEventQuery"), 1);
  EXPECT_EQ(fake.counter("calls.cuCtxSynchronize"), 1);
  EXPECT_EQ(report["devices"][0]["settle"]["status"], "done");
  EXPECT_EQ(report["devices"][0]["state"], "drained");
  EXPECT_EQ(fake.counter("events"), 0);

  // The event's calls fail: the same.
  for (const char* call : {"cuEventCreate", "cuCtxRecordEvent", "cuEventQuery"}) {
    fake.reset(idle_device("GPU-af7e0000-0000-4000-8000-00000000000e"));
    fake.update({{"errors", {{call, 900}}}});  // CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    report = gpucleanup::after_cell(driver, registry, with_timeout(30));
    EXPECT_EQ(fake.counter("calls.cuCtxSynchronize"), 1) << call;
    EXPECT_EQ(report["devices"][0]["state"], "drained") << call;
    EXPECT_EQ(report["devices"][0]["error"], nullptr) << call;
    EXPECT_EQ(fake.counter("events"), 0) << call;
  }

  // A driver older than CUDA 12.5 has no cuCtxRecordEvent: the same, and no event is made.
  fake.reset(idle_device("GPU-af7e0000-0000-4000-8000-00000000000f"));
  fake.update({{"driver_version", 12040}});
  const Driver older(FAKE_CUDA_PATH);
  report = gpucleanup::after_cell(older, registry, with_timeout(30));
  EXPECT_EQ(fake.counter("calls.cuEventCreate"), 0);
  EXPECT_EQ(fake.counter("calls.cuCtxSynchronize"), 1);
  EXPECT_EQ(report["devices"][0]["state"], "drained");
}

// The quiet check of an idle device: the probe and its retain (the count, handles and UUIDs are the pass's), one
// push, the pools, one event, one cuMemGetInfo.
const Counts kQuietCheck = {
    {"cuCtxGetCurrent", 1},          {"cuDevicePrimaryCtxGetState", 1}, {"cuDevicePrimaryCtxRetain", 1},
    {"cuCtxPushCurrent", 1},         {"cuDeviceGetDefaultMemPool", 1},  {"cuDeviceGetMemPool", 1},
    {"cuMemPoolGetAttribute", 1},    {"cuEventCreate", 1},              {"cuCtxRecordEvent", 1},
    {"cuEventQuery", 1},             {"cuEventDestroy", 1},             {"cuMemGetInfo", 1},
    {"cuCtxPopCurrent", 1},          {"cuDevicePrimaryCtxRelease", 1},
};

TEST_F(AfterCell, QuietHoldsOnlyWhileNothingChangedSinceThePassThatLeftTheMark) {
  fake.reset(idle_device("GPU-af7e0000-0000-4000-8000-000000000031"));
  const Driver driver(FAKE_CUDA_PATH);
  const auto mark = gpucleanup::quiet_mark(gpucleanup::after_cell(driver, registry, with_timeout(30)));
  ASSERT_TRUE(mark.has_value());
  ASSERT_EQ(mark->size(), 1u);
  EXPECT_EQ((*mark)[0].index, 0);
  EXPECT_EQ((*mark)[0].free_bytes, 10 * GiB);
  const auto threads = fake.counter("threads");
  for (int cell = 0; cell < 20; ++cell) {
    const Counts before = driver_calls(fake);
    ASSERT_TRUE(gpucleanup::quiet_since(driver, registry, *mark)) << "cell " << cell;
    ASSERT_EQ(minus(driver_calls(fake), before), kQuietCheck) << show(minus(driver_calls(fake), before));
    ASSERT_EQ(fake.counter("events"), 0);  // the event made is destroyed
    ASSERT_EQ(fake.counter("pushed"), 0);
  }
  EXPECT_EQ(fake.counter("threads"), threads);  // no thread woken, no wait
  EXPECT_EQ(fake.counter("calls.cuCtxSynchronize"), 0);
  EXPECT_EQ(fake.counter("calls.cuMemPoolTrimTo"), 1);  // the pass's own trim; the check trims nothing

  // Memory taken during the cell (a raw allocation, a framework's pool growing): not quiet; given back: quiet.
  fake.update({{"devices", {{{"free_bytes", 10 * GiB - 256 * MiB}}}}});
  EXPECT_FALSE(gpucleanup::quiet_since(driver, registry, *mark));
  fake.update({{"devices", {{{"free_bytes", 10 * GiB}}}}});
  EXPECT_TRUE(gpucleanup::quiet_since(driver, registry, *mark));
  // Work still queued: not quiet, and nothing waits for it.
  fake.update({{"devices", {{{"sync_seconds", 0.01}}}}});
  EXPECT_FALSE(gpucleanup::quiet_since(driver, registry, *mark));
  EXPECT_EQ(fake.counter("calls.cuCtxSynchronize"), 0);
  fake.update({{"devices", {{{"sync_seconds", 0}}}}});
  // A driver pool that reserves memory (a stream-ordered free): not quiet, the pass must trim it.
  fake.update({{"devices", {{{"default_pool", {{"reserved_bytes", 64 * MiB}, {"used_bytes", 0}}}}}}});
  EXPECT_FALSE(gpucleanup::quiet_since(driver, registry, *mark));
  fake.update({{"devices", {{{"default_pool", {{"reserved_bytes", 0}, {"used_bytes", 0}}}}}}});
  EXPECT_TRUE(gpucleanup::quiet_since(driver, registry, *mark));
  // The context went away (a framework reset it): not quiet.
  fake.update({{"devices", {{{"primary_active", false}}}}});
  EXPECT_FALSE(gpucleanup::quiet_since(driver, registry, *mark));
  EXPECT_EQ(fake.counter("contexts_created"), 0);
  // An empty mark (a pass that found no device in use) holds while none is in use, and ends with the first one.
  EXPECT_TRUE(gpucleanup::quiet_since(driver, registry, gpucleanup::QuietMark{}));
  fake.update({{"devices", {{{"primary_active", true}}}}});
  EXPECT_FALSE(gpucleanup::quiet_since(driver, registry, gpucleanup::QuietMark{}));
}

// The driver initialised and no context of this process (a notebook that asked torch.cuda.is_available() and made
// no tensor): the pass leaves an empty mark, and the quiet check holds with the probe's calls alone until a
// context appears.
TEST_F(AfterCell, AnInitialisedDriverWithNoContextLeavesAnEmptyMarkThatHoldsUntilTheFirstContext) {
  json scenario = idle_device("GPU-af7e0000-0000-4000-8000-00000000003c");
  scenario["devices"][0]["primary_active"] = false;
  fake.reset(scenario);
  const Driver driver(FAKE_CUDA_PATH);
  const json report = gpucleanup::after_cell(driver, registry, with_timeout(30));
  ASSERT_EQ(report["devices"].size(), 0u) << report.dump();
  const auto mark = gpucleanup::quiet_mark(report);
  ASSERT_TRUE(mark.has_value());
  EXPECT_TRUE(mark->empty());
  for (int cell = 0; cell < 3; ++cell) {
    const Counts before = driver_calls(fake);
    ASSERT_TRUE(gpucleanup::quiet_since(driver, registry, *mark)) << "cell " << cell;
    const Counts made = minus(driver_calls(fake), before);
    EXPECT_EQ(made.count("cuDevicePrimaryCtxRetain"), 0u) << show(made);  // no device in use: nothing retained
    EXPECT_EQ(made.count("cuMemGetInfo"), 0u) << show(made);
  }
  fake.update({{"devices", {{{"primary_active", true}}}}});
  EXPECT_FALSE(gpucleanup::quiet_since(driver, registry, *mark));  // the first context: the pass runs whole
  EXPECT_EQ(fake.counter("contexts_created"), 0);
}

// On a framework's thread (CuPy, PyTorch: the primary context is current there), the quiet check uses that context
// as it is: no push and pop, and no cuCtxGetDevice for it.
TEST_F(AfterCell, QuietOnAFrameworksThreadNeitherPushesNorAsksTheCurrentContextsDevice) {
  json scenario = idle_device("GPU-af7e0000-0000-4000-8000-000000000038");
  scenario["current_context"] = {{"device", 0}, {"primary", true}};
  fake.reset(scenario);
  const Driver driver(FAKE_CUDA_PATH);
  const auto mark = gpucleanup::quiet_mark(gpucleanup::after_cell(driver, registry, with_timeout(30)));
  ASSERT_TRUE(mark.has_value());
  Counts expected = kQuietCheck;
  expected.erase("cuCtxPushCurrent");
  expected.erase("cuCtxPopCurrent");
  for (int cell = 0; cell < 3; ++cell) {
    const Counts before = driver_calls(fake);
    ASSERT_TRUE(gpucleanup::quiet_since(driver, registry, *mark)) << "cell " << cell;
    ASSERT_EQ(minus(driver_calls(fake), before), expected) << show(minus(driver_calls(fake), before));
    ASSERT_EQ(fake.counter("events"), 0);
  }
  // What it sees is the same: memory taken during the cell is not quiet.
  fake.update({{"devices", {{{"free_bytes", 10 * GiB - 256 * MiB}}}}});
  EXPECT_FALSE(gpucleanup::quiet_since(driver, registry, *mark));
  EXPECT_EQ(fake.counter("contexts_created"), 0);
}

// A pass whose probe could not read a UUID leaves no enumeration: the quiet check asks for the handles and UUIDs
// itself until a pass has read them all, so that its records are keyed as the pass's are.
TEST_F(AfterCell, QuietAsksForTheUuidsItselfUntilAPassHasReadThemAll) {
  json scenario = idle_device("GPU-af7e0000-0000-4000-8000-00000000003b");
  scenario["errors"] = {{"cuDeviceGetUuid", 999}};  // CUDA_ERROR_UNKNOWN
  fake.reset(scenario);
  const Driver driver(FAKE_CUDA_PATH);
  auto mark = gpucleanup::quiet_mark(gpucleanup::after_cell(driver, registry, with_timeout(30)));
  ASSERT_TRUE(mark.has_value());
  auto asked = fake.counter("calls.cuDeviceGetUuid");
  ASSERT_TRUE(gpucleanup::quiet_since(driver, registry, *mark));
  EXPECT_EQ(fake.counter("calls.cuDeviceGetUuid"), asked + 1);  // not remembered: asked by the check
  fake.update({{"errors", {{"cuDeviceGetUuid", 0}}}});  // readable again
  mark = gpucleanup::quiet_mark(gpucleanup::after_cell(driver, registry, with_timeout(30)));  // reads it: kept
  ASSERT_TRUE(mark.has_value());
  asked = fake.counter("calls.cuDeviceGetUuid");
  ASSERT_TRUE(gpucleanup::quiet_since(driver, registry, *mark));
  EXPECT_EQ(fake.counter("calls.cuDeviceGetUuid"), asked);
}

// A context of its own made current on a device the pass did not see in use (PyCUDA's make_context, whose primary
// context stays inactive): the quiet check asks for its device, finds a first use, and is not quiet.
TEST_F(AfterCell, QuietSeesANonPrimaryContextMadeCurrentOnAnotherDevice) {
  json two = idle_device("GPU-af7e0000-0000-4000-8000-000000000039");
  json second = idle_device("GPU-af7e0000-0000-4000-8000-00000000003a")["devices"][0];
  second["primary_active"] = false;
  two["devices"].push_back(second);
  two["current_context"] = {{"device", 1}, {"primary", false}};
  fake.reset(two);
  const Driver driver(FAKE_CUDA_PATH);
  // Not current yet while the pass leaves its mark (GPU0 alone).
  CUcontext own = nullptr;
  ASSERT_EQ(driver.api().cuCtxPopCurrent(&own), CUDA_SUCCESS);
  ASSERT_NE(own, nullptr);
  const auto mark = gpucleanup::quiet_mark(gpucleanup::after_cell(driver, registry, with_timeout(30)));
  ASSERT_TRUE(mark.has_value());
  ASSERT_EQ(mark->size(), 1u);
  const auto asked = fake.counter("calls.cuCtxGetDevice");
  ASSERT_TRUE(gpucleanup::quiet_since(driver, registry, *mark));
  EXPECT_EQ(fake.counter("calls.cuCtxGetDevice"), asked);  // nothing current: nothing to ask
  ASSERT_EQ(driver.api().cuCtxPushCurrent(own), CUDA_SUCCESS);
  EXPECT_FALSE(gpucleanup::quiet_since(driver, registry, *mark));
  EXPECT_EQ(fake.counter("calls.cuCtxGetDevice"), asked + 1);
  // The full probe sees the same: GPU1 in use through the current context.
  const json report = gpucleanup::after_cell(driver, registry, with_timeout(30));
  ASSERT_EQ(report["devices"].size(), 2u);
  EXPECT_EQ(report["devices"][1]["context"], "current");
}

TEST_F(AfterCell, QuietSeesADeviceFirstUsedSinceTheMarkAndAnOlderDriver) {
  json two = idle_device("GPU-af7e0000-0000-4000-8000-000000000032");
  json second = idle_device("GPU-af7e0000-0000-4000-8000-000000000033")["devices"][0];
  second["primary_active"] = false;
  two["devices"].push_back(second);
  fake.reset(two);
  const Driver driver(FAKE_CUDA_PATH);
  const auto mark = gpucleanup::quiet_mark(gpucleanup::after_cell(driver, registry, with_timeout(30)));
  ASSERT_TRUE(mark.has_value());
  ASSERT_EQ(mark->size(), 1u);
  EXPECT_TRUE(gpucleanup::quiet_since(driver, registry, *mark));
  fake.update({{"devices", {json::object(), {{"primary_active", true}}}}});  // GPU1's first use
  EXPECT_FALSE(gpucleanup::quiet_since(driver, registry, *mark));
  EXPECT_EQ(fake.counter("contexts_created"), 0);

  // A driver older than CUDA 12.5 cannot tell whether work is queued without waiting: never quiet.
  fake.reset(idle_device("GPU-af7e0000-0000-4000-8000-000000000034"));
  fake.update({{"driver_version", 12040}});
  const Driver older(FAKE_CUDA_PATH);
  const auto old_mark = gpucleanup::quiet_mark(gpucleanup::after_cell(older, registry, with_timeout(30)));
  ASSERT_TRUE(old_mark.has_value());
  EXPECT_FALSE(gpucleanup::quiet_since(older, registry, *old_mark));
  EXPECT_EQ(fake.counter("calls.cuEventCreate"), 0);
}

TEST_F(AfterCell, NoMarkIsLeftByAPassThatLeavesWorkForTheNext) {
  const Driver driver(FAKE_CUDA_PATH);
  // A pool still reserving memory after the trim (memory in use in it): the next pass must look again.
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-000000000035"));
  EXPECT_FALSE(gpucleanup::quiet_mark(gpucleanup::after_cell(driver, registry, with_timeout(30))).has_value());
  // A device busy at the limit.
  fake.reset(idle_device("GPU-af7e0000-0000-4000-8000-000000000036", {{"sync_seconds", -1}}));
  EXPECT_FALSE(gpucleanup::quiet_mark(gpucleanup::after_cell(driver, registry, with_timeout(0.05))).has_value());
  fake.release_sync();
  // A report of another kind, or not a report at all (nothing in use leaves an empty mark: its own test).
  fake.reset(idle_device("GPU-af7e0000-0000-4000-8000-000000000037"));
  EXPECT_FALSE(gpucleanup::quiet_mark(gpucleanup::trim_pools(driver, registry)).has_value());
  EXPECT_FALSE(gpucleanup::quiet_mark(json::object()).has_value());
  EXPECT_FALSE(gpucleanup::quiet_mark(json::array()).has_value());
}

TEST_F(AfterCell, WithoutAWaitNoThreadIsWokenAndTheCallingThreadEntersOnce) {
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-000000000006"));
  const Driver driver(FAKE_CUDA_PATH);
  gpucleanup::after_cell(driver, registry, with_timeout(0));
  const Counts before = driver_calls(fake);
  const json report = gpucleanup::after_cell(driver, registry, with_timeout(0));
  EXPECT_EQ(report["devices"][0]["settle"]["status"], "skipped");
  Counts expected = idle_pass();
  expected.erase("cuCtxSynchronize");
  // no settle: no look at the pools and the queue before it, only the pass
  for (const char* call : {"cuCtxPushCurrent", "cuCtxPopCurrent", "cuDeviceGetDefaultMemPool", "cuDeviceGetMemPool"}) {
    expected[call] = 1;
  }
  expected["cuMemPoolGetAttribute"] = 2;
  EXPECT_EQ(minus(driver_calls(fake), before), expected);
  EXPECT_EQ(fake.counter("threads"), 1);
}

TEST_F(AfterCell, AHungDeviceReturnsAtTheLimitAndIsStillBusyNextCallWithoutASecondWait) {
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-000000000007", {{"sync_seconds", -1}}));
  const Driver driver(FAKE_CUDA_PATH);
  const json first = gpucleanup::after_cell(driver, registry, with_timeout(0.2));
  const json& busy = first["devices"][0];
  EXPECT_EQ(busy["state"], "busy");
  EXPECT_EQ(busy["settle"]["status"], "timeout");
  EXPECT_EQ(busy["message"].get<std::string>().rfind("GPU0 is still busy after 0.2 s", 0), 0u) << busy["message"];
  EXPECT_EQ(busy["free_before_bytes"], 10 * GiB);
  EXPECT_EQ(busy["free_bytes"], 10 * GiB);  // as read at the start of the call
  EXPECT_EQ(busy["released_bytes"], 0);
  ASSERT_EQ(busy["pools"].size(), 1u);
  EXPECT_EQ(busy["pools"][0]["trimmed"], false);
  EXPECT_EQ(fake.counter("calls.cuMemPoolTrimTo"), 0);
  ASSERT_TRUE(eventually([&] { return fake.counter("syncs_in_flight") == 1; }));
  EXPECT_EQ(fake.counter("retained"), 1);  // the watchdog's, until its wait ends

  const Counts before = driver_calls(fake);
  const json again = gpucleanup::after_cell(driver, registry, with_timeout(30));
  const json& still = again["devices"][0];
  EXPECT_EQ(still["state"], "busy");
  EXPECT_EQ(still["settle"]["status"], "still_busy");
  EXPECT_GE(still["settle"]["busy_for_s"].get<double>(), 0.2);
  EXPECT_EQ(still["message"].get<std::string>().rfind("GPU0 is still busy with work queued ", 0), 0u);
  EXPECT_EQ(still["free_bytes"], 10 * GiB);
  EXPECT_TRUE(still["free_before_bytes"].is_null());
  EXPECT_LT(again["elapsed_s"].get<double>(), 5.0);
  // Its memory is read on this thread; no second wait, no trim.
  const Counts delta = minus(driver_calls(fake), before);
  EXPECT_EQ(delta, (Counts{{"cuDeviceGetCount", 1},
                           {"cuCtxGetCurrent", 1},
                           {"cuDeviceGet", 1},
                           {"cuDeviceGetUuid", 1},
                           {"cuDevicePrimaryCtxGetState", 1},
                           {"cuDevicePrimaryCtxRetain", 1},
                           {"cuCtxPushCurrent", 1},
                           {"cuMemGetInfo", 1},
                           {"cuDeviceGetDefaultMemPool", 1},
                           {"cuDeviceGetMemPool", 1},
                           {"cuMemPoolGetAttribute", 1},
                           {"cuCtxPopCurrent", 1},
                           {"cuDevicePrimaryCtxRelease", 1}}))
      << show(delta);

  // The trim leaves it alone too.
  const json trimmed = gpucleanup::trim_pools(driver, registry);
  EXPECT_EQ(trimmed["devices"][0]["state"], "busy");
  EXPECT_EQ(fake.counter("calls.cuMemPoolTrimTo"), 0);

  // Once the GPU finishes, the next cell waits and trims as usual, on the same thread.
  const auto started = gpucleanup::watchdog_threads_started();
  fake.release_sync();
  ASSERT_TRUE(eventually([&] { return fake.counter("syncs_in_flight") == 0 && fake.counter("retained") == 0; }));
  const json after = gpucleanup::after_cell(driver, registry, with_timeout(5));
  EXPECT_EQ(after["devices"][0]["state"], "drained");
  EXPECT_EQ(after["devices"][0]["settle"]["status"], "done");
  EXPECT_EQ(after["devices"][0]["released_bytes"], 2 * GiB - 512 * MiB);
  EXPECT_EQ(fake.counter("calls.cuCtxSynchronize"), 2);
  EXPECT_EQ(gpucleanup::watchdog_threads_started(), started);
}

TEST_F(AfterCell, ProgressOnTheCallingThreadCanInterruptTheWait) {
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-000000000008", {{"sync_seconds", -1}}));
  const Driver driver(FAKE_CUDA_PATH);
  DrainOptions options = with_timeout(30);
  options.progress_after = 20ms;
  options.progress_every = 10ms;
  int calls = 0;
  const auto caller = std::this_thread::get_id();
  options.progress = [&](const json& progress) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    EXPECT_EQ(progress["device"], 0);
    return ++calls == 2;
  };
  const json report = gpucleanup::after_cell(driver, registry, options);
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(report["interrupted"], true);
  EXPECT_EQ(report["devices"][0]["state"], "busy");
  EXPECT_EQ(report["devices"][0]["settle"]["status"], "interrupted");
  EXPECT_NE(report["devices"][0]["message"].get<std::string>().find("(wait interrupted)"), std::string::npos);
}

TEST_F(AfterCell, APrimaryContextResetBetweenCellsIsNeverUsedThroughItsOldHandle) {
  // A framework uses GPU0's primary context and has it current on this thread (CuPy, PyTorch).
  json scenario = one_device("GPU-af7e0000-0000-4000-8000-000000000009");
  scenario["current_context"] = {{"device", 0}, {"primary", true}};
  fake.reset(scenario);
  const Driver driver(FAKE_CUDA_PATH);
  ASSERT_EQ(gpucleanup::after_cell(driver, registry, with_timeout(5))["devices"][0]["state"], "drained");
  CUcontext old_handle = nullptr;
  ASSERT_EQ(driver.api().cuCtxGetCurrent(&old_handle), CUDA_SUCCESS);
  ASSERT_NE(old_handle, nullptr);

  // It resets the device (cuDevicePrimaryCtxReset): the context is destroyed, the device
  // inactive, and the stale handle stays current to this thread.
  auto reset_primary = reinterpret_cast<int (*)(int)>(dlsym(dlopen(FAKE_CUDA_PATH, RTLD_NOW | RTLD_NOLOAD),
                                                            "fake_cuda_reset_primary_context"));
  ASSERT_NE(reset_primary, nullptr);
  ASSERT_EQ(reset_primary(0), 0);
  {
    // What a handle kept from an earlier cell would run into: the push works, nothing in it does.
    ASSERT_EQ(driver.api().cuCtxPushCurrent(old_handle), CUDA_SUCCESS);
    size_t free = 0, total = 0;
    EXPECT_EQ(driver.api().cuMemGetInfo(&free, &total), CUDA_ERROR_CONTEXT_IS_DESTROYED);
    CUcontext popped = nullptr;
    ASSERT_EQ(driver.api().cuCtxPopCurrent(&popped), CUDA_SUCCESS);
  }

  // Nothing is in use now: no device listed, no error, nothing retained, nothing created.
  for (int cell = 0; cell < 3; ++cell) {
    const json report = gpucleanup::after_cell(driver, registry, with_timeout(5));
    EXPECT_TRUE(report["devices"].empty()) << report["devices"];
  }
  EXPECT_TRUE(gpucleanup::trim_pools(driver, registry)["devices"].empty());
  const json snapshot = gpucleanup::take_snapshot(driver, registry, gpucleanup::SnapshotKind::snapshot);
  EXPECT_EQ(snapshot["devices"][0]["state"], "idle");
  EXPECT_TRUE(snapshot["devices"][0]["error"].is_null());
  EXPECT_EQ(fake.state()["devices"][0]["primary_active"], false);

  // The framework uses the device again: a new primary context, which the next cell uses.
  fake.update({{"devices", {{{"primary_active", true}}}}});
  for (double timeout : {5.0, 0.0}) {
    const json report = gpucleanup::after_cell(driver, registry, with_timeout(timeout));
    ASSERT_EQ(report["devices"].size(), 1u);
    const json& device = report["devices"][0];
    EXPECT_EQ(device["context"], "primary");
    EXPECT_EQ(device["state"], "drained") << device;
    EXPECT_TRUE(device["error"].is_null()) << device["error"];
  }
  const json trimmed = gpucleanup::trim_pools(driver, registry);
  EXPECT_EQ(trimmed["devices"][0]["state"], "trimmed");
  EXPECT_TRUE(trimmed["devices"][0]["error"].is_null());
  EXPECT_EQ(fake.counter("primary_resets"), 1);
  EXPECT_EQ(fake.counter("contexts_created"), 0);
}

TEST_F(AfterCell, AResetDuringAHungSettleEndsAsNotInUse) {
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-000000000014", {{"sync_seconds", -1}}));
  const Driver driver(FAKE_CUDA_PATH);
  EXPECT_EQ(gpucleanup::after_cell(driver, registry, with_timeout(0.1))["devices"][0]["settle"]["status"], "timeout");
  auto reset_primary = reinterpret_cast<int (*)(int)>(dlsym(dlopen(FAKE_CUDA_PATH, RTLD_NOW | RTLD_NOLOAD),
                                                            "fake_cuda_reset_primary_context"));
  ASSERT_EQ(reset_primary(0), 0);  // while the watchdog still waits in the old context
  fake.release_sync();
  ASSERT_TRUE(eventually([&] { return fake.counter("syncs_in_flight") == 0; }));
  ASSERT_TRUE(eventually([&] { return gpucleanup::after_cell(driver, registry, with_timeout(5))["devices"].empty(); }));
  EXPECT_EQ(fake.counter("contexts_created"), 0);
}

TEST_F(AfterCell, APrimaryContextReleasedByItsOwnerIsLeftAloneAndNeverCreated) {
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-00000000000a"));
  const Driver driver(FAKE_CUDA_PATH);
  ASSERT_EQ(gpucleanup::after_cell(driver, registry, with_timeout(5))["devices"].size(), 1u);
  fake.update({{"devices", {{{"primary_active", false}}}}});
  const Counts before = driver_calls(fake);
  const json report = gpucleanup::after_cell(driver, registry, with_timeout(5));
  EXPECT_TRUE(report["devices"].empty());
  EXPECT_EQ(minus(driver_calls(fake), before), kNothingInUse);
  EXPECT_EQ(fake.counter("contexts_created"), 0);
  EXPECT_EQ(fake.state()["devices"][0]["primary_active"], false);
}

TEST_F(AfterCell, ANonPrimaryCurrentContextIsSettledWithoutARetain) {
  fake.reset({{"devices",
               {{{"uuid", "GPU-af7e0000-0000-4000-8000-00000000000b"},
                 {"default_pool", {{"reserved_bytes", 1 * GiB}, {"pending_free_bytes", 1 * GiB}}}}}},
              {"current_context", {{"device", 0}, {"primary", false}}}});
  const Driver driver(FAKE_CUDA_PATH);
  const json report = gpucleanup::after_cell(driver, registry, with_timeout(5));
  const json& device = report["devices"][0];
  EXPECT_EQ(device["context"], "current");
  EXPECT_EQ(device["settle"]["status"], "done");
  EXPECT_EQ(device["released_bytes"], 1 * GiB);
  EXPECT_EQ(fake.counter("calls.cuDevicePrimaryCtxRetain"), 0);
  EXPECT_EQ(fake.counter("contexts_created"), 0);
  EXPECT_EQ(fake.counter("pushed"), 0);
}

TEST_F(AfterCell, AStickyErrorIsSaidAndTheDeviceLeftAloneAfterwards) {
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-00000000000c", {{"sticky_error", 700}}));
  const Driver driver(FAKE_CUDA_PATH);
  const json first = gpucleanup::after_cell(driver, registry, with_timeout(5));
  EXPECT_EQ(first["devices"][0]["state"], "unusable");
  EXPECT_EQ(first["devices"][0]["message"], "GPU0 is unusable after CUDA_ERROR_ILLEGAL_ADDRESS: restart the kernel");
  EXPECT_EQ(first["devices"][0]["error"]["id"], "gpucleanup.devices.201");
  EXPECT_EQ(first["devices"][0]["settle"]["status"], "skipped");
  EXPECT_EQ(fake.counter("calls.cuCtxSynchronize"), 0);
  const Counts before = driver_calls(fake);
  const json second = gpucleanup::after_cell(driver, registry, with_timeout(5));
  EXPECT_EQ(second["devices"][0]["state"], "unusable");
  Counts delta = minus(driver_calls(fake), before);
  delta.erase("cuGetErrorName");  // naming the error in the reply
  EXPECT_EQ(delta, kNothingInUse);  // the probe only
  const json trimmed = gpucleanup::trim_pools(driver, registry);
  EXPECT_EQ(trimmed["devices"][0]["state"], "unusable");
  EXPECT_EQ(fake.counter("calls.cuMemPoolTrimTo"), 0);
}

TEST_F(AfterCell, TrimAloneReleasesWhatFrameworksGaveBackWithoutAWait) {
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-00000000000d"));
  const Driver driver(FAKE_CUDA_PATH);
  gpucleanup::after_cell(driver, registry, with_timeout(5));
  // A framework frees 1 GiB into the driver's pool after the pass.
  fake.update({{"devices", {{{"default_pool", {{"reserved_bytes", 1536 * MiB}, {"used_bytes", 512 * MiB}}}}}}});
  const Counts before = driver_calls(fake);
  const json report = gpucleanup::trim_pools(driver, registry);
  EXPECT_EQ(report["kind"], "trim");
  const json& device = report["devices"][0];
  EXPECT_EQ(device["state"], "trimmed");
  EXPECT_EQ(device["released_bytes"], 1 * GiB);
  EXPECT_EQ(device["pools"][0]["reserved_after_bytes"], 512 * MiB);
  EXPECT_EQ(device["free_bytes"], 10 * GiB + (2 * GiB - 512 * MiB) + 1 * GiB);  // both trims' releases
  EXPECT_EQ(device["used_bytes"], 80 * GiB - device["free_bytes"].get<std::uint64_t>());
  EXPECT_EQ(minus(driver_calls(fake), before),
            (Counts{{"cuDeviceGetCount", 1},
                    {"cuCtxGetCurrent", 1},
                    {"cuDeviceGet", 1},
                    {"cuDeviceGetUuid", 1},
                    {"cuDevicePrimaryCtxGetState", 1},
                    {"cuDevicePrimaryCtxRetain", 1},
                    {"cuCtxPushCurrent", 1},
                    {"cuDeviceGetDefaultMemPool", 1},
                    {"cuDeviceGetMemPool", 1},
                    {"cuMemPoolGetAttribute", 2},
                    {"cuMemPoolTrimTo", 1},
                    {"cuMemGetInfo", 1},
                    {"cuCtxPopCurrent", 1},
                    {"cuDevicePrimaryCtxRelease", 1}}));
  EXPECT_EQ(fake.counter("threads"), 2);  // this one, and the watchdog of the pass before
}

// Through the C ABI, as the extension calls it.
TEST_F(AfterCell, CAbiHandsOutOneReplyAndChecksItsArguments) {
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-00000000000f"));
  EXPECT_EQ(gpucleanup_after_cell(1.0, 1, nullptr, nullptr, nullptr), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(gpucleanup_last_error(), "[gpucleanup.api.101] json_out is NULL: pass the address of a char*");
  char* out = reinterpret_cast<char*>(0x1);
  EXPECT_EQ(gpucleanup_after_cell(-1.0, 1, nullptr, nullptr, &out), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(out, nullptr);
  EXPECT_STREQ(gpucleanup_last_error(),
               "[gpucleanup.api.103] timeout_s is -1: pass a finite number of seconds >= 0 (0 skips the wait)");
  EXPECT_EQ(gpucleanup_trim(nullptr), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(fake.counter("calls.cuDeviceGetCount"), 0);

  ASSERT_EQ(gpucleanup_after_cell(5.0, 1, nullptr, nullptr, &out), GPUCLEANUP_OK) << gpucleanup_last_error();
  const json report = json::parse(out);
  gpucleanup_free(out);
  EXPECT_EQ(report["kind"], "after_cell");
  EXPECT_EQ(report["devices"][0]["state"], "drained");
  EXPECT_EQ(report["devices"][0]["released_bytes"], 2 * GiB - 512 * MiB);

  // 100 cells through the C ABI: the same driver calls each time, no new thread.
  const long long threads = fake.counter("threads");
  for (int cell = 0; cell < 100; ++cell) {
    const Counts before = driver_calls(fake);
    ASSERT_EQ(gpucleanup_after_cell(30.0, 1, nullptr, nullptr, &out), GPUCLEANUP_OK);
    gpucleanup_free(out);
    ASSERT_EQ(minus(driver_calls(fake), before), idle_pass()) << "cell " << cell;
  }
  EXPECT_EQ(fake.counter("threads"), threads);

  ASSERT_EQ(gpucleanup_trim(&out), GPUCLEANUP_OK) << gpucleanup_last_error();
  const json trimmed = json::parse(out);
  gpucleanup_free(out);
  EXPECT_EQ(trimmed["kind"], "trim");
  EXPECT_EQ(trimmed["devices"][0]["state"], "trimmed");
  EXPECT_EQ(fake.counter("contexts_created"), 0);
}

TEST_F(AfterCell, CAbiQuietComparesWithTheLastAfterCellPass) {
  EXPECT_EQ(gpucleanup_quiet(nullptr), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(gpucleanup_last_error(), "[gpucleanup.api.135] quiet_out is NULL: pass the address of an int");
  char* out = nullptr;
  int quiet = -1;
  // A pass that leaves memory in a pool leaves no mark: not quiet.
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-000000000038"));
  ASSERT_EQ(gpucleanup_after_cell(5.0, 1, nullptr, nullptr, &out), GPUCLEANUP_OK) << gpucleanup_last_error();
  gpucleanup_free(out);
  ASSERT_EQ(gpucleanup_quiet(&quiet), GPUCLEANUP_OK) << gpucleanup_last_error();
  EXPECT_EQ(quiet, 0);
  fake.reset(idle_device("GPU-af7e0000-0000-4000-8000-000000000039"));
  ASSERT_EQ(gpucleanup_after_cell(5.0, 1, nullptr, nullptr, &out), GPUCLEANUP_OK) << gpucleanup_last_error();
  gpucleanup_free(out);
  ASSERT_EQ(gpucleanup_quiet(&quiet), GPUCLEANUP_OK);
  EXPECT_EQ(quiet, 1);
  fake.update({{"devices", {{{"free_bytes", 9 * GiB}}}}});
  ASSERT_EQ(gpucleanup_quiet(&quiet), GPUCLEANUP_OK);
  EXPECT_EQ(quiet, 0);
  // A trim in between leaves the mark of the last after-cell pass: the memory is compared with it.
  ASSERT_EQ(gpucleanup_trim(&out), GPUCLEANUP_OK);
  gpucleanup_free(out);
  fake.update({{"devices", {{{"free_bytes", 10 * GiB}}}}});
  ASSERT_EQ(gpucleanup_quiet(&quiet), GPUCLEANUP_OK);
  EXPECT_EQ(quiet, 1);
  EXPECT_EQ(fake.counter("contexts_created"), 0);
}

TEST_F(AfterCell, CAbiProgressCanStopTheWaitOnTheCallingThread) {
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-000000000010", {{"sync_seconds", -1}}));
  struct Seen {
    int calls = 0;
    std::thread::id thread;
  } seen;
  auto progress = [](const char*, void* user) -> int {
    auto* s = static_cast<Seen*>(user);
    ++s->calls;
    s->thread = std::this_thread::get_id();
    return 1;
  };
  char* out = nullptr;
  ASSERT_EQ(gpucleanup_after_cell(30.0, 1, progress, &seen, &out), GPUCLEANUP_OK);
  const json report = json::parse(out);
  gpucleanup_free(out);
  EXPECT_EQ(seen.calls, 1);
  EXPECT_EQ(seen.thread, std::this_thread::get_id());
  EXPECT_EQ(report["interrupted"], true);
  EXPECT_EQ(report["devices"][0]["settle"]["status"], "interrupted");
}

TEST_F(AfterCell, AForkedChildMakesNoDriverCallAndStartsNoThread) {
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-000000000011"));
  char* out = nullptr;
  ASSERT_EQ(gpucleanup_after_cell(5.0, 1, nullptr, nullptr, &out), GPUCLEANUP_OK);
  gpucleanup_free(out);
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(10);
    const auto calls = driver_calls(fake);
    const auto started = gpucleanup::watchdog_threads_started();
    char* child_out = nullptr;
    if (gpucleanup_after_cell(5.0, 1, nullptr, nullptr, &child_out) != GPUCLEANUP_OK) _exit(1);
    const json report = json::parse(child_out);
    gpucleanup_free(child_out);
    if (gpucleanup_trim(&child_out) != GPUCLEANUP_OK) _exit(2);
    gpucleanup_free(child_out);
    const bool ok = report["driver"]["state"] == "unusable" && report["devices"].empty() &&
                    driver_calls(fake) == calls && gpucleanup::watchdog_threads_started() == started;
    _exit(ok ? 0 : 3);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << "child died with signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(AfterCellDeathTest, AfterShutdownNothingIsCalled) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        FakeCuda fake;
        fake.reset(one_device("GPU-af7e0000-0000-4000-8000-000000000012"));
        char* out = nullptr;
        if (gpucleanup_after_cell(5.0, 1, nullptr, nullptr, &out) != GPUCLEANUP_OK) std::exit(1);
        gpucleanup_free(out);
        const auto calls = driver_calls(fake);
        gpucleanup_shutdown();
        if (gpucleanup_after_cell(5.0, 1, nullptr, nullptr, &out) != GPUCLEANUP_ERR_EXITING) std::exit(2);
        if (gpucleanup_trim(&out) != GPUCLEANUP_ERR_EXITING || out != nullptr) std::exit(3);
        std::exit(driver_calls(fake) == calls ? 0 : 4);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(AfterCellDeathTest, AWatchdogMakesNoDriverCallOnceTheProcessIsExiting) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        FakeCuda fake;
        fake.reset(one_device("GPU-af7e0000-0000-4000-8000-000000000013", {{"sync_seconds", -1}}));
        const Driver driver(FAKE_CUDA_PATH);
        DeviceRegistry registry;
        const json report = gpucleanup::after_cell(driver, registry, with_timeout(0.05));
        if (report["devices"][0]["settle"]["status"] != "timeout") std::exit(1);
        const auto wait = registry.at(gpucleanup::probe(driver).devices.at(0)).wait;
        if (!wait || !eventually([&] { return fake.counter("syncs_in_flight") == 1; })) std::exit(2);
        const auto calls = driver_calls(fake);
        gpucleanup::mark_process_exiting();
        fake.release_sync();
        if (!eventually([&] { return wait->finished.load(); })) std::exit(3);
        std::this_thread::sleep_for(50ms);  // the watchdog's last steps, if it made any
        // The sync returned; nothing after it: no trim, no pop, no release.
        const Counts delta = minus(driver_calls(fake), calls);
        std::exit(delta.empty() && fake.counter("retained") == 1 ? 0 : 4);
      },
      ::testing::ExitedWithCode(0), "");
}

namespace {

// A stand-in for the interpreter lock: who holds it, and how often it was given up.
struct StandInGil {
  static inline std::atomic<bool> held{true};
  static inline std::atomic<int> saves{0};
  static inline std::atomic<int> restores{0};
  static int check() { return held.load() ? 1 : 0; }
  static void* save() {
    ++saves;
    held = false;
    return reinterpret_cast<void*>(0x9);
  }
  static void restore(void* token) {
    EXPECT_EQ(token, reinterpret_cast<void*>(0x9));
    ++restores;
    held = true;
  }
  explicit StandInGil(bool holding) {
    held = holding;
    saves = 0;
    restores = 0;
    gpucleanup_set_gil_hooks(&check, &save, &restore);
  }
  ~StandInGil() { gpucleanup_set_gil_hooks(nullptr, nullptr, nullptr); }
};

}  // namespace

TEST_F(AfterCell, ACallHoldingTheInterpreterLockGivesItUpForAWaitAndTakesItBack) {
  // 0.3 s of queued work: longer than the lock is kept (2 ms) whatever the machine's load.
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-000000000020", {{"sync_seconds", 0.3}}));
  StandInGil gil(true);
  char* out = nullptr;
  ASSERT_EQ(gpucleanup_after_cell(30.0, 1, nullptr, nullptr, &out), GPUCLEANUP_OK) << gpucleanup_last_error();
  const json report = json::parse(out);
  gpucleanup_free(out);
  EXPECT_EQ(report["devices"][0]["state"], "drained");
  EXPECT_EQ(StandInGil::saves.load(), 1);
  EXPECT_EQ(StandInGil::restores.load(), 1);
  EXPECT_TRUE(StandInGil::held.load());  // the caller has it back
}

TEST_F(AfterCell, ACallNotHoldingTheInterpreterLockNeverTouchesIt) {
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-000000000021", {{"sync_seconds", 0.3}}));
  StandInGil gil(false);  // a ctypes.CDLL call, or one of the library's own threads
  char* out = nullptr;
  ASSERT_EQ(gpucleanup_after_cell(30.0, 1, nullptr, nullptr, &out), GPUCLEANUP_OK) << gpucleanup_last_error();
  gpucleanup_free(out);
  EXPECT_EQ(StandInGil::saves.load(), 0);
  EXPECT_EQ(StandInGil::restores.load(), 0);
}

TEST_F(AfterCell, AHungDeviceWaitedForWithTheLockHeldStillEndsAtTheLimitWithTheLockBack) {
  fake.reset(one_device("GPU-af7e0000-0000-4000-8000-000000000022", {{"sync_seconds", -1}}));
  StandInGil gil(true);
  char* out = nullptr;
  ASSERT_EQ(gpucleanup_after_cell(0.2, 1, nullptr, nullptr, &out), GPUCLEANUP_OK) << gpucleanup_last_error();
  const json report = json::parse(out);
  gpucleanup_free(out);
  EXPECT_EQ(report["devices"][0]["state"], "busy");
  EXPECT_EQ(StandInGil::saves.load(), 1);
  EXPECT_EQ(StandInGil::restores.load(), 1);
  EXPECT_TRUE(StandInGil::held.load());
}

TEST_F(AfterCell, TheServerStateWithoutJsonChecksItsArguments) {
  EXPECT_EQ(gpucleanup_server_state(7, 1, 0, -1), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(gpucleanup_last_error(),
               "[gpucleanup.api.112] state is 7: pass a GPUCLEANUP_STATE_* value (0 idle, 1 running, 2 draining, "
               "3 waiting)");
  EXPECT_EQ(gpucleanup_server_state(GPUCLEANUP_STATE_IDLE, -1, 0, -1), GPUCLEANUP_ERR_SERVER);
  EXPECT_STREQ(gpucleanup_last_error(),
               "[gpucleanup.api.107] the status server is not running: call gpucleanup_server_start first");
}
