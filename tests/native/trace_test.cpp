// The allocation trace against the fake libcupti (tests/fake_cupti): loading,
// subscribing, the callbacks it enables, what it records from the driver calls
// the fake plays, and the refusals (CUDA not initialised, no libcupti, another
// subscriber).
#include "trace.hpp"

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cuda.h>

#include <thread>
#include <vector>

#include "gpucleanup/gpucleanup.h"
#include "gil.hpp"
#include "test_support.hpp"

using gpucleanup::testing::FakeCuda;
using gpucleanup::testing::MiB;
using nlohmann::json;

namespace {

// The fake libcupti's control API, from the very instance the trace loads.
struct FakeCupti {
  FakeCupti() {
    handle = ::dlopen(FAKE_CUPTI_PATH, RTLD_NOW | RTLD_LOCAL);
    EXPECT_NE(handle, nullptr) << ::dlerror();
    reset = reinterpret_cast<void (*)(int)>(::dlsym(handle, "fake_cupti_reset"));
    subscribed = reinterpret_cast<int (*)()>(::dlsym(handle, "fake_cupti_subscribed"));
    subscribe_calls = reinterpret_cast<int (*)()>(::dlsym(handle, "fake_cupti_subscribe_calls"));
    enabled = reinterpret_cast<int (*)(unsigned)>(::dlsym(handle, "fake_cupti_enabled"));
    alloc = reinterpret_cast<int (*)(unsigned long long, unsigned long long, int)>(
        ::dlsym(handle, "fake_cupti_mem_alloc"));
    pitch = reinterpret_cast<int (*)(unsigned long long, unsigned long long, unsigned long long)>(
        ::dlsym(handle, "fake_cupti_mem_alloc_pitch"));
    free = reinterpret_cast<int (*)(unsigned long long)>(::dlsym(handle, "fake_cupti_mem_free"));
    create = reinterpret_cast<int (*)(unsigned long long, unsigned long long, int)>(
        ::dlsym(handle, "fake_cupti_mem_create"));
    release = reinterpret_cast<int (*)(unsigned long long)>(::dlsym(handle, "fake_cupti_mem_release"));
    pool_create = reinterpret_cast<int (*)(unsigned long long, int)>(::dlsym(handle, "fake_cupti_pool_create"));
    pool_destroy = reinterpret_cast<int (*)(unsigned long long)>(::dlsym(handle, "fake_cupti_pool_destroy"));
  }
  void* handle = nullptr;
  void (*reset)(int) = nullptr;
  int (*subscribed)() = nullptr;
  int (*subscribe_calls)() = nullptr;
  int (*enabled)(unsigned) = nullptr;
  int (*alloc)(unsigned long long, unsigned long long, int) = nullptr;
  int (*pitch)(unsigned long long, unsigned long long, unsigned long long) = nullptr;
  int (*free)(unsigned long long) = nullptr;
  int (*create)(unsigned long long, unsigned long long, int) = nullptr;
  int (*release)(unsigned long long) = nullptr;
  int (*pool_create)(unsigned long long, int) = nullptr;
  int (*pool_destroy)(unsigned long long) = nullptr;
};

constexpr unsigned kCuMemAlloc = 243;     // CUPTI_DRIVER_TRACE_CBID_cuMemAlloc_v2
constexpr unsigned kCuLaunchKernel = 307; // CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel

class Trace : public ::testing::Test {
 protected:
  void SetUp() override {
    fake.reset({{"devices", {json::object(), {{"primary_active", true}}}},
                {"current_context", {{"device", 1}}}});
    cupti.reset(0);
    gpucleanup::trace::stop();
    gpucleanup::trace::reset_for_tests();
  }
  void TearDown() override {
    gpucleanup::trace::stop();
    gpucleanup::trace::reset_for_tests();
    cupti.reset(0);
  }
  json start() { return gpucleanup::trace::start({"/nonexistent/libcupti.so.13", FAKE_CUPTI_PATH}, nullptr); }

  FakeCuda fake;
  FakeCupti cupti;
};

}  // namespace

TEST_F(Trace, StartsFromTheFirstCandidateThatLoadsAndEnablesOnlyMemoryCallbacks) {
  const json started = start();
  ASSERT_EQ(started["active"], true) << started.dump();
  EXPECT_EQ(started["library"], FAKE_CUPTI_PATH);
  ASSERT_EQ(started["tried"].size(), 2u);
  EXPECT_EQ(started["tried"][0]["path"], "/nonexistent/libcupti.so.13");
  EXPECT_TRUE(started["tried"][0]["error"].is_string());
  EXPECT_TRUE(started["tried"][1]["error"].is_null());
  EXPECT_EQ(cupti.subscribed(), 1);
  EXPECT_EQ(cupti.enabled(kCuMemAlloc), 1);
  EXPECT_EQ(cupti.enabled(kCuLaunchKernel), 0);
  // Starting again changes nothing: one subscription.
  EXPECT_EQ(start()["active"], true);
  EXPECT_EQ(cupti.subscribe_calls(), 1);
}

TEST_F(Trace, RecordsLiveAllocationsWithCellThreadsAndDeviceAndForgetsFreedOnes) {
  ASSERT_EQ(start()["active"], true);
  gpucleanup::trace::set_cell(3);
  // Each thread allocates in the context current on the test's thread, pushed
  // on its own (as a driver allocation needs a current context).
  void* driver = ::dlopen(fake.path().c_str(), RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(driver, nullptr);
  auto get_current = reinterpret_cast<CUresult (*)(CUcontext*)>(::dlsym(driver, "cuCtxGetCurrent"));
  auto push = reinterpret_cast<CUresult (*)(CUcontext)>(::dlsym(driver, "cuCtxPushCurrent_v2"));
  auto pop = reinterpret_cast<CUresult (*)(CUcontext*)>(::dlsym(driver, "cuCtxPopCurrent_v2"));
  ASSERT_TRUE(get_current != nullptr && push != nullptr && pop != nullptr);
  CUcontext context = nullptr;
  ASSERT_EQ(get_current(&context), CUDA_SUCCESS);
  ASSERT_NE(context, nullptr);
  std::vector<std::thread> threads;
  for (unsigned long long i = 0; i < 5; ++i) {
    threads.emplace_back([&, i] {
      ASSERT_EQ(push(context), CUDA_SUCCESS);
      EXPECT_EQ(cupti.alloc(0x10000000ull * (i + 1), 64 * MiB, 0), 1);
      CUcontext popped = nullptr;
      EXPECT_EQ(pop(&popped), CUDA_SUCCESS);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(cupti.alloc(0x90000000ull, 64 * MiB, 2), 1);  // failed (CUDA_ERROR_OUT_OF_MEMORY): not recorded
  EXPECT_EQ(cupti.free(0x10000000ull), 1);
  gpucleanup::trace::set_cell(4);
  EXPECT_EQ(cupti.alloc(0xa0000000ull, 8 * MiB, 0), 1);

  const json all = gpucleanup::trace::report(-1);
  EXPECT_EQ(all["live_bytes"], 4 * 64 * MiB + 8 * MiB);
  EXPECT_EQ(all["live_allocations"], 5);
  const json cell3 = gpucleanup::trace::report(3);
  ASSERT_EQ(cell3["groups"].size(), 1u) << cell3.dump();
  const json& group = cell3["groups"][0];
  EXPECT_EQ(group["bytes"], 4 * 64 * MiB);
  EXPECT_EQ(group["count"], 4);
  EXPECT_EQ(group["thread_count"], 4);
  EXPECT_EQ(group["threads"].size(), 4u);
  EXPECT_EQ(group["device"], 1);
  EXPECT_EQ(group["kind"], "cuMemAlloc");
  EXPECT_EQ(group["cell"], 3);
  EXPECT_EQ(group["site"], 0);  // no interpreter lock hooks in this process
  EXPECT_NE(group["caller"], FAKE_CUPTI_PATH);
  const json cell4 = gpucleanup::trace::report(4);
  ASSERT_EQ(cell4["groups"].size(), 1u);
  EXPECT_EQ(cell4["groups"][0]["bytes"], 8 * MiB);
}

TEST_F(Trace, VirtualMemoryHandlesAndPitchedAllocationsAreSizedFromTheirParameters) {
  ASSERT_EQ(start()["active"], true);
  EXPECT_EQ(cupti.create(0x77, 2 * 1024 * MiB, 0), 1);
  EXPECT_EQ(cupti.pitch(0x5000, 4096, 1024), 1);
  json report = gpucleanup::trace::report(-1);
  EXPECT_EQ(report["live_bytes"], 2 * 1024 * MiB + 4 * MiB);
  ASSERT_EQ(report["groups"].size(), 2u);
  EXPECT_EQ(report["groups"][0]["kind"], "cuMemCreate");
  EXPECT_EQ(report["groups"][0]["device"], 0);  // from the allocation's location, not the current context
  EXPECT_EQ(report["groups"][1]["kind"], "cuMemAllocPitch");
  // A handle and a pointer with the same value are different allocations.
  EXPECT_EQ(cupti.free(0x77), 1);
  EXPECT_EQ(gpucleanup::trace::report(-1)["live_bytes"], 2 * 1024 * MiB + 4 * MiB);
  EXPECT_EQ(cupti.release(0x77), 1);
  EXPECT_EQ(gpucleanup::trace::report(-1)["live_bytes"], 4 * MiB);
}

TEST_F(Trace, PoolsMadeWithCuMemPoolCreateAreKnownUntilDestroyed) {
  ASSERT_EQ(start()["active"], true);
  EXPECT_EQ(cupti.pool_create(0xabc0, 1), 1);
  EXPECT_EQ(cupti.pool_create(0xdef0, 0), 1);
  ASSERT_EQ(gpucleanup::trace::pools_of(1).size(), 1u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(gpucleanup::trace::pools_of(1)[0]), 0xabc0u);
  EXPECT_EQ(gpucleanup::trace::report(-1)["pools"].size(), 2u);
  EXPECT_EQ(cupti.pool_destroy(0xabc0), 1);
  EXPECT_TRUE(gpucleanup::trace::pools_of(1).empty());
  EXPECT_EQ(gpucleanup::trace::pools_of(0).size(), 1u);
}

TEST_F(Trace, StopUnsubscribesAndKeepsWhatWasRecordedReadable) {
  ASSERT_EQ(start()["active"], true);
  EXPECT_EQ(cupti.alloc(0x1000, 1 * MiB, 0), 1);
  const json stopped = gpucleanup::trace::stop();
  EXPECT_EQ(stopped["stopped"], true);
  EXPECT_EQ(cupti.subscribed(), 0);
  EXPECT_EQ(cupti.alloc(0x2000, 1 * MiB, 0), 0);  // nothing delivered any more
  const json report = gpucleanup::trace::report(-1);
  EXPECT_EQ(report["active"], false);
  EXPECT_EQ(report["live_bytes"], 1 * MiB);
  EXPECT_EQ(gpucleanup::trace::stop()["stopped"], false);
}

TEST_F(Trace, AnotherSubscriberIsNamedAndNothingIsTraced) {
  cupti.reset(39);  // CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED
  const json started = start();
  EXPECT_EQ(started["active"], false);
  EXPECT_EQ(started["cupti_result"], 39);
  const std::string error = started["error"];
  EXPECT_NE(error.find("torch.profiler"), std::string::npos) << error;
  EXPECT_NE(error.find("restart the kernel"), std::string::npos) << error;
  EXPECT_FALSE(gpucleanup::trace::active());
}

TEST_F(Trace, RefusedBeforeCudaIsInitialisedWithoutTouchingCupti) {
  fake.reset({{"initialized", false}, {"devices", {json::object()}}});
  const json started = start();
  EXPECT_EQ(started["active"], false);
  EXPECT_NE(std::string(started["error"]).find("not initialised"), std::string::npos);
  EXPECT_EQ(cupti.subscribe_calls(), 0);
}

TEST_F(Trace, NoLoadableLibcuptiSaysWhatToInstall) {
  const json started = gpucleanup::trace::start({"/nonexistent/a.so", "/nonexistent/b.so"}, nullptr);
  if (started["active"] == true) GTEST_SKIP() << "libcupti was already loaded by an earlier test of this process";
  EXPECT_EQ(started["tried"].size(), 2u);
  EXPECT_NE(std::string(started["error"]).find("GPUCLEANUP_CUPTI"), std::string::npos);
}

TEST_F(Trace, TheCApiRejectsCandidatesThatAreNotAnArrayOfStrings) {
  char* out = nullptr;
  EXPECT_EQ(gpucleanup_trace_start("{\"a\": 1}", nullptr, &out), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(out, nullptr);
  EXPECT_NE(std::string(gpucleanup_last_error()).find("[gpucleanup.api.113]"), std::string::npos);
  EXPECT_EQ(gpucleanup_trace_start("[1]", nullptr, &out), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(cupti.subscribe_calls(), 0);
}

namespace {
int holds_lock() { return 1; }
void* save_nothing() { return nullptr; }
void restore_nothing(void*) {}
int site_calls = 0;
long long the_site() { return ++site_calls > 0 ? 5 : 0; }
}  // namespace

TEST_F(Trace, AThreadHoldingTheInterpreterLockIsAskedForItsSiteAtEachAllocation) {
  gpucleanup::gil::set_hooks(&holds_lock, &save_nothing, &restore_nothing);
  site_calls = 0;
  ASSERT_EQ(gpucleanup::trace::start({FAKE_CUPTI_PATH}, &the_site)["active"], true);
  EXPECT_EQ(cupti.alloc(0x1000, 1 * MiB, 0), 1);
  EXPECT_EQ(cupti.alloc(0x2000, 1 * MiB, 0), 1);
  EXPECT_EQ(cupti.free(0x1000), 1);  // frees ask nothing
  gpucleanup::gil::set_hooks(nullptr, nullptr, nullptr);
  EXPECT_EQ(site_calls, 2);
  const json report = gpucleanup::trace::report(-1);
  ASSERT_EQ(report["groups"].size(), 1u);
  EXPECT_EQ(report["groups"][0]["site"], 5);
  EXPECT_EQ(report["groups"][0]["count"], 1);
  EXPECT_TRUE(report["groups"][0]["caller"].is_string());  // walked once for the site, kept for the next
}
