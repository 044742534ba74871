// The fake CUDA driver itself, through the C functions it exports: every
// other test trusts it to behave like the real driver (share/FACTS.md §1, §7).
#include <dlfcn.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include <cuda.h>
#include <gtest/gtest.h>

#include "test_support.hpp"

namespace {

using gpucleanup::testing::FakeCuda;
using nlohmann::json;

constexpr unsigned long long kGiB = 1ull << 30;
constexpr unsigned long long kMiB = 1ull << 20;

// The 4-argument resolver of CUDA 11.3-11.8 (cuda.h only declares the 5-argument one).
using GetProcAddressV1 = CUresult (*)(const char*, void**, int, cuuint64_t);

// The driver's entry points, looked up in the loaded fake the way a caller
// without a resolver would: by their exported names.
class Driver {
  // First: the entries below are resolved from it as they are initialised.
  void* handle_;

 public:
  explicit Driver(const char* path) : handle_(dlopen(path, RTLD_NOW | RTLD_LOCAL)) {
    if (handle_ == nullptr) throw std::runtime_error(dlerror());
  }
  ~Driver() { dlclose(handle_); }
  Driver(const Driver&) = delete;
  Driver& operator=(const Driver&) = delete;

  void* symbol(const char* name) const { return dlsym(handle_, name); }

  template <typename Fn>
  Fn entry(const char* name) const {
    void* address = symbol(name);
    if (address == nullptr) throw std::runtime_error(std::string("fake driver does not export ") + name);
    return reinterpret_cast<Fn>(address);
  }

#define FAKE_CUDA_ENTRY(member, symbol_name) \
  decltype(&::symbol_name) member = entry<decltype(&::symbol_name)>(#symbol_name)
  FAKE_CUDA_ENTRY(init, cuInit);
  FAKE_CUDA_ENTRY(driver_get_version, cuDriverGetVersion);
  FAKE_CUDA_ENTRY(device_get_count, cuDeviceGetCount);
  FAKE_CUDA_ENTRY(device_get_name, cuDeviceGetName);
  FAKE_CUDA_ENTRY(device_get_uuid, cuDeviceGetUuid_v2);
  FAKE_CUDA_ENTRY(device_get_attribute, cuDeviceGetAttribute);
  FAKE_CUDA_ENTRY(primary_get_state, cuDevicePrimaryCtxGetState);
  FAKE_CUDA_ENTRY(primary_retain, cuDevicePrimaryCtxRetain);
  FAKE_CUDA_ENTRY(primary_release, cuDevicePrimaryCtxRelease_v2);
  FAKE_CUDA_ENTRY(ctx_get_current, cuCtxGetCurrent);
  FAKE_CUDA_ENTRY(ctx_get_device, cuCtxGetDevice);
  FAKE_CUDA_ENTRY(ctx_push, cuCtxPushCurrent_v2);
  FAKE_CUDA_ENTRY(ctx_pop, cuCtxPopCurrent_v2);
  FAKE_CUDA_ENTRY(ctx_synchronize, cuCtxSynchronize);
  FAKE_CUDA_ENTRY(mem_get_info, cuMemGetInfo_v2);
  FAKE_CUDA_ENTRY(get_error_name, cuGetErrorName);
  FAKE_CUDA_ENTRY(default_mem_pool, cuDeviceGetDefaultMemPool);
  FAKE_CUDA_ENTRY(current_mem_pool, cuDeviceGetMemPool);
  FAKE_CUDA_ENTRY(pool_trim_to, cuMemPoolTrimTo);
  FAKE_CUDA_ENTRY(pool_get_attribute, cuMemPoolGetAttribute);
#undef FAKE_CUDA_ENTRY
};

class FakeCudaTest : public ::testing::Test {
 protected:
  cuuint64_t pool_attribute(CUmemoryPool pool, CUmemPool_attribute attribute) {
    cuuint64_t value = ~0ull;
    EXPECT_EQ(cu.pool_get_attribute(pool, attribute, &value), CUDA_SUCCESS);
    return value;
  }

  CUmemoryPool default_pool(CUdevice device) {
    CUmemoryPool pool = nullptr;
    EXPECT_EQ(cu.default_mem_pool(&pool, device), CUDA_SUCCESS);
    return pool;
  }

  // Polls for a synchronize to be blocked inside the fake, with a generous
  // limit so a broken fake fails the test instead of hanging it.
  bool wait_for_blocked_syncs(long long expected) {
    const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (fake.counter("syncs_in_flight") != expected) {
      if (std::chrono::steady_clock::now() > limit) return false;
      std::this_thread::yield();
    }
    return true;
  }

  FakeCuda fake;
  Driver cu{FAKE_CUDA_PATH};
};

TEST_F(FakeCudaTest, EveryCallButVersionAndInitIsNotInitializedBeforeCuInit) {
  fake.reset({{"initialized", false}});
  int count = -1;
  unsigned flags = 0;
  int active = -1;
  EXPECT_EQ(cu.device_get_count(&count), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(cu.primary_get_state(0, &flags, &active), CUDA_ERROR_NOT_INITIALIZED);
  CUmemoryPool pool = nullptr;
  EXPECT_EQ(cu.default_mem_pool(&pool, 0), CUDA_ERROR_NOT_INITIALIZED);
  int version = 0;
  EXPECT_EQ(cu.driver_get_version(&version), CUDA_SUCCESS);
  EXPECT_EQ(version, 13000);
  EXPECT_EQ(fake.counter("cuInit"), 0);

  EXPECT_EQ(cu.init(0), CUDA_SUCCESS);
  EXPECT_EQ(fake.counter("cuInit"), 1);
  EXPECT_EQ(cu.device_get_count(&count), CUDA_SUCCESS);
  EXPECT_EQ(count, 1);
  EXPECT_TRUE(fake.state()["initialized"].get<bool>());
}

TEST_F(FakeCudaTest, ErrorNamesAnswerBeforeCuInit) {
  fake.reset({{"initialized", false}});
  const char* name = nullptr;
  EXPECT_EQ(cu.get_error_name(CUDA_ERROR_ILLEGAL_ADDRESS, &name), CUDA_SUCCESS);
  EXPECT_STREQ(name, "CUDA_ERROR_ILLEGAL_ADDRESS");
  EXPECT_EQ(cu.get_error_name(static_cast<CUresult>(12345), &name), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(name, nullptr);
}

TEST_F(FakeCudaTest, RetainOfInactivePrimaryContextCreatesOne) {
  fake.reset();
  unsigned flags = 7;
  int active = -1;
  ASSERT_EQ(cu.primary_get_state(0, &flags, &active), CUDA_SUCCESS);
  EXPECT_EQ(flags, 0u);
  EXPECT_EQ(active, 0);

  CUcontext first = nullptr;
  CUcontext second = nullptr;
  ASSERT_EQ(cu.primary_retain(&first, 0), CUDA_SUCCESS);
  ASSERT_EQ(cu.primary_retain(&second, 0), CUDA_SUCCESS);
  EXPECT_NE(first, nullptr);
  EXPECT_EQ(first, second);
  EXPECT_EQ(fake.counter("contexts_created"), 1);
  EXPECT_EQ(fake.counter("retained"), 2);
  ASSERT_EQ(cu.primary_get_state(0, &flags, &active), CUDA_SUCCESS);
  EXPECT_EQ(active, 1);

  EXPECT_EQ(cu.primary_release(0), CUDA_SUCCESS);
  EXPECT_EQ(cu.primary_release(0), CUDA_SUCCESS);
  EXPECT_EQ(fake.counter("retained"), 0);
  ASSERT_EQ(cu.primary_get_state(0, &flags, &active), CUDA_SUCCESS);
  EXPECT_EQ(active, 0);
  EXPECT_EQ(cu.primary_release(0), CUDA_ERROR_INVALID_CONTEXT);
}

TEST_F(FakeCudaTest, RetainOfActivePrimaryContextCreatesNothingAndReleaseKeepsItActive) {
  fake.reset({{"devices", {{{"primary_active", true}}}}});
  CUcontext context = nullptr;
  ASSERT_EQ(cu.primary_retain(&context, 0), CUDA_SUCCESS);
  ASSERT_EQ(cu.primary_release(0), CUDA_SUCCESS);
  EXPECT_EQ(fake.counter("contexts_created"), 0);
  int active = 0;
  unsigned flags = 0;
  ASSERT_EQ(cu.primary_get_state(0, &flags, &active), CUDA_SUCCESS);
  EXPECT_EQ(active, 1);
  // The framework's reference is not ours to release.
  EXPECT_EQ(cu.primary_release(0), CUDA_ERROR_INVALID_CONTEXT);
}

TEST_F(FakeCudaTest, ScenarioContextIsCurrentAndPopRestoresIt) {
  fake.reset({{"devices", json::array({json::object(), json::object()})},
              {"current_context", {{"device", 1}, {"primary", false}}}});
  CUcontext base = nullptr;
  ASSERT_EQ(cu.ctx_get_current(&base), CUDA_SUCCESS);
  ASSERT_NE(base, nullptr);
  CUdevice device = -1;
  ASSERT_EQ(cu.ctx_get_device(&device), CUDA_SUCCESS);
  EXPECT_EQ(device, 1);
  // PyCUDA's autoinit context is not the primary one: device 1's stays inactive.
  int active = -1;
  unsigned flags = 0;
  ASSERT_EQ(cu.primary_get_state(1, &flags, &active), CUDA_SUCCESS);
  EXPECT_EQ(active, 0);

  CUcontext primary0 = nullptr;
  ASSERT_EQ(cu.primary_retain(&primary0, 0), CUDA_SUCCESS);
  ASSERT_EQ(cu.ctx_push(primary0), CUDA_SUCCESS);
  EXPECT_EQ(fake.counter("pushed"), 1);
  ASSERT_EQ(cu.ctx_get_device(&device), CUDA_SUCCESS);
  EXPECT_EQ(device, 0);

  CUcontext popped = nullptr;
  ASSERT_EQ(cu.ctx_pop(&popped), CUDA_SUCCESS);
  EXPECT_EQ(popped, primary0);
  EXPECT_EQ(fake.counter("pushed"), 0);
  CUcontext current = nullptr;
  ASSERT_EQ(cu.ctx_get_current(&current), CUDA_SUCCESS);
  EXPECT_EQ(current, base);
  ASSERT_EQ(cu.primary_release(0), CUDA_SUCCESS);
  EXPECT_EQ(fake.counter("contexts_created"), 1);
  EXPECT_EQ(fake.state()["current_context"], json({{"device", 1}, {"primary", false}}));
}

TEST_F(FakeCudaTest, ContextStackIsPerThread) {
  fake.reset({{"current_context", {{"device", 0}, {"primary", true}}}});
  CUcontext elsewhere = reinterpret_cast<CUcontext>(1);
  CUresult popped = CUDA_SUCCESS;
  std::thread([&] {
    cu.ctx_get_current(&elsewhere);
    popped = cu.ctx_pop(nullptr);
  }).join();
  EXPECT_EQ(elsewhere, nullptr);
  EXPECT_EQ(popped, CUDA_ERROR_INVALID_CONTEXT);
}

TEST_F(FakeCudaTest, MemGetInfoNeedsCurrentContext) {
  fake.reset({{"devices", {{{"primary_active", true}, {"total_bytes", 16 * kGiB}, {"free_bytes", 10 * kGiB}}}}});
  size_t free = 0;
  size_t total = 0;
  EXPECT_EQ(cu.mem_get_info(&free, &total), CUDA_ERROR_INVALID_CONTEXT);

  CUcontext context = nullptr;
  ASSERT_EQ(cu.primary_retain(&context, 0), CUDA_SUCCESS);
  ASSERT_EQ(cu.ctx_push(context), CUDA_SUCCESS);
  EXPECT_EQ(cu.mem_get_info(&free, &total), CUDA_SUCCESS);
  EXPECT_EQ(free, 10 * kGiB);
  EXPECT_EQ(total, 16 * kGiB);
  ASSERT_EQ(cu.ctx_pop(nullptr), CUDA_SUCCESS);
  ASSERT_EQ(cu.primary_release(0), CUDA_SUCCESS);
}

TEST_F(FakeCudaTest, DefaultFreeBytesLeaveRoomForContextAndPools) {
  fake.reset({{"devices",
               {{{"primary_active", true}, {"default_pool", {{"reserved_bytes", 2 * kGiB}}}},
                {{"total_bytes", 16 * kGiB}}}}});
  const auto devices = fake.state()["devices"];
  EXPECT_EQ(devices[0]["free_bytes"].get<unsigned long long>(), 80 * kGiB - 512 * kMiB - 2 * kGiB);
  EXPECT_EQ(devices[1]["free_bytes"].get<unsigned long long>(), 16 * kGiB);
  EXPECT_EQ(devices[1]["name"], "Fake GPU 1");
}

TEST_F(FakeCudaTest, PoolCallsWorkWithoutContext) {
  fake.reset();
  CUcontext current = reinterpret_cast<CUcontext>(1);
  ASSERT_EQ(cu.ctx_get_current(&current), CUDA_SUCCESS);
  ASSERT_EQ(current, nullptr);
  CUmemoryPool pool = default_pool(0);
  EXPECT_NE(pool, nullptr);
  EXPECT_EQ(cu.pool_trim_to(pool, 0), CUDA_SUCCESS);
  CUmemoryPool current_pool = nullptr;
  ASSERT_EQ(cu.current_mem_pool(&current_pool, 0), CUDA_SUCCESS);
  EXPECT_EQ(current_pool, pool);
}

TEST_F(FakeCudaTest, DistinctCurrentPoolIsStableAndSeparate) {
  fake.reset({{"devices", {{{"current_pool", {{"reserved_bytes", kGiB}}}}}}});
  CUmemoryPool first = nullptr;
  CUmemoryPool second = nullptr;
  ASSERT_EQ(cu.current_mem_pool(&first, 0), CUDA_SUCCESS);
  ASSERT_EQ(cu.current_mem_pool(&second, 0), CUDA_SUCCESS);
  EXPECT_EQ(first, second);
  EXPECT_NE(first, default_pool(0));
  EXPECT_EQ(pool_attribute(first, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), kGiB);
  EXPECT_EQ(pool_attribute(default_pool(0), CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), 0u);
}

TEST_F(FakeCudaTest, PoolCallsAreNotSupportedWithoutPools) {
  fake.reset({{"devices", {{{"pools_supported", false}}}}});
  CUmemoryPool pool = nullptr;
  EXPECT_EQ(cu.default_mem_pool(&pool, 0), CUDA_ERROR_NOT_SUPPORTED);
  EXPECT_EQ(cu.current_mem_pool(&pool, 0), CUDA_ERROR_NOT_SUPPORTED);
  int supported = -1;
  ASSERT_EQ(cu.device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, 0), CUDA_SUCCESS);
  EXPECT_EQ(supported, 0);
}

TEST_F(FakeCudaTest, TrimReleasesReservedAboveUsed) {
  fake.reset({{"devices",
               {{{"free_bytes", 10 * kGiB},
                 {"default_pool", {{"reserved_bytes", 4 * kGiB}, {"used_bytes", kGiB}}}}}}});
  CUmemoryPool pool = default_pool(0);
  ASSERT_EQ(cu.pool_trim_to(pool, 3 * kGiB), CUDA_SUCCESS);
  EXPECT_EQ(pool_attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), 3 * kGiB);
  EXPECT_EQ(fake.state()["devices"][0]["free_bytes"].get<unsigned long long>(), 11 * kGiB);

  ASSERT_EQ(cu.pool_trim_to(pool, 0), CUDA_SUCCESS);
  EXPECT_EQ(pool_attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), kGiB);
  EXPECT_EQ(pool_attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH), 4 * kGiB);
  EXPECT_EQ(pool_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), kGiB);
  EXPECT_EQ(fake.state()["devices"][0]["free_bytes"].get<unsigned long long>(), 13 * kGiB);
  EXPECT_EQ(fake.counter("calls.cuMemPoolTrimTo"), 2);
}

TEST_F(FakeCudaTest, PendingFreeIsHeldUntilSynchronize) {
  fake.reset({{"devices",
               {{{"free_bytes", 10 * kGiB},
                 {"default_pool",
                  {{"reserved_bytes", 4 * kGiB}, {"used_bytes", kGiB}, {"pending_free_bytes", 2 * kGiB}}}}}},
              {"current_context", {{"device", 0}, {"primary", true}}}});
  CUmemoryPool pool = default_pool(0);
  EXPECT_EQ(pool_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), 3 * kGiB);
  ASSERT_EQ(cu.pool_trim_to(pool, 0), CUDA_SUCCESS);
  EXPECT_EQ(pool_attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), 3 * kGiB);

  ASSERT_EQ(cu.ctx_synchronize(), CUDA_SUCCESS);
  EXPECT_EQ(pool_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), kGiB);
  EXPECT_EQ(pool_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH), 3 * kGiB);
  ASSERT_EQ(cu.pool_trim_to(pool, 0), CUDA_SUCCESS);
  EXPECT_EQ(pool_attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), kGiB);
  EXPECT_EQ(fake.state()["devices"][0]["free_bytes"].get<unsigned long long>(), 13 * kGiB);
}

TEST_F(FakeCudaTest, SynchronizeNeedsCurrentContext) {
  fake.reset();
  EXPECT_EQ(cu.ctx_synchronize(), CUDA_ERROR_INVALID_CONTEXT);
}

TEST_F(FakeCudaTest, HangingSynchronizeIsReleasedByReleaseSync) {
  fake.reset({{"devices", {{{"primary_active", true}, {"sync_seconds", -1}}}}});
  CUresult result = CUDA_ERROR_UNKNOWN;
  std::thread watchdog([&] {
    CUcontext context = nullptr;
    cu.primary_retain(&context, 0);
    cu.ctx_push(context);
    result = cu.ctx_synchronize();
    cu.ctx_pop(nullptr);
    cu.primary_release(0);
  });
  ASSERT_TRUE(wait_for_blocked_syncs(1));
  // The control API stays usable while a synchronize hangs.
  EXPECT_EQ(fake.state()["devices"][0]["sync_seconds"].get<double>(), -1.0);

  fake.release_sync();
  watchdog.join();
  EXPECT_EQ(result, CUDA_SUCCESS);
  EXPECT_EQ(fake.counter("syncs_in_flight"), 0);
  EXPECT_EQ(fake.counter("retained"), 0);
}

TEST_F(FakeCudaTest, ReleasedSynchronizesStayReleasedUntilReset) {
  fake.reset({{"devices", {{{"sync_seconds", -1}}}}, {"current_context", {{"device", 0}, {"primary", true}}}});
  fake.release_sync();
  EXPECT_EQ(cu.ctx_synchronize(), CUDA_SUCCESS);
  EXPECT_EQ(fake.counter("syncs_in_flight"), 0);
}

TEST_F(FakeCudaTest, ResetReleasesHangingSynchronize) {
  fake.reset({{"devices", {{{"primary_active", true}, {"sync_seconds", -1}}}}});
  std::thread watchdog([&] {
    CUcontext context = nullptr;
    cu.primary_retain(&context, 0);
    cu.ctx_push(context);
    cu.ctx_synchronize();
  });
  ASSERT_TRUE(wait_for_blocked_syncs(1));
  fake.reset();
  watchdog.join();
  EXPECT_EQ(fake.counter("syncs_in_flight"), 0);
}

TEST_F(FakeCudaTest, StickyErrorFailsOnlyMemGetInfoAndSynchronize) {
  fake.reset({{"devices", {{{"primary_active", true}, {"sticky_error", 700}}}}});
  unsigned flags = 0;
  int active = 0;
  EXPECT_EQ(cu.primary_get_state(0, &flags, &active), CUDA_SUCCESS);
  EXPECT_EQ(active, 1);
  CUcontext context = nullptr;
  ASSERT_EQ(cu.primary_retain(&context, 0), CUDA_SUCCESS);
  ASSERT_EQ(cu.ctx_push(context), CUDA_SUCCESS);
  size_t free = 0;
  size_t total = 0;
  EXPECT_EQ(cu.mem_get_info(&free, &total), CUDA_ERROR_ILLEGAL_ADDRESS);
  EXPECT_EQ(cu.ctx_synchronize(), CUDA_ERROR_ILLEGAL_ADDRESS);
  EXPECT_EQ(cu.pool_trim_to(default_pool(0), 0), CUDA_SUCCESS);
  EXPECT_EQ(cu.ctx_pop(nullptr), CUDA_SUCCESS);
  EXPECT_EQ(cu.primary_release(0), CUDA_SUCCESS);
}

TEST_F(FakeCudaTest, InjectedErrorIsReturnedOnEveryCallUntilRemoved) {
  fake.reset({{"errors", {{"cuDeviceGetCount", 999}}}});
  int count = -1;
  EXPECT_EQ(cu.device_get_count(&count), CUDA_ERROR_UNKNOWN);
  EXPECT_EQ(cu.device_get_count(&count), CUDA_ERROR_UNKNOWN);
  EXPECT_EQ(count, -1);
  EXPECT_EQ(fake.counter("calls.cuDeviceGetCount"), 2);

  fake.update({{"errors", {{"cuDeviceGetCount", 0}}}});
  EXPECT_EQ(cu.device_get_count(&count), CUDA_SUCCESS);
  EXPECT_EQ(count, 1);
}

TEST_F(FakeCudaTest, InjectedErrorTakesPrecedenceOverNotInitialized) {
  fake.reset({{"initialized", false}, {"errors", {{"cuDeviceGetCount", 100}}}});
  int count = -1;
  EXPECT_EQ(cu.device_get_count(&count), CUDA_ERROR_NO_DEVICE);
}

TEST_F(FakeCudaTest, DeviceInjectionAffectsOnlyThatDevice) {
  fake.reset({{"devices",
               {{{"primary_active", true}},
                {{"primary_active", true}, {"errors", {{"cuDevicePrimaryCtxGetState", 999}}}}}}});
  unsigned flags = 0;
  int active = 0;
  EXPECT_EQ(cu.primary_get_state(0, &flags, &active), CUDA_SUCCESS);
  EXPECT_EQ(cu.primary_get_state(1, &flags, &active), CUDA_ERROR_UNKNOWN);
}

TEST_F(FakeCudaTest, UpdateMergesDevicesByIndexAndKeepsCounters) {
  fake.reset({{"devices", json::array({json::object(), json::object()})}});
  int count = 0;
  ASSERT_EQ(cu.device_get_count(&count), CUDA_SUCCESS);
  fake.update({{"devices", json::array({json::object(), {{"primary_active", true}}})}});
  unsigned flags = 0;
  int active = 0;
  ASSERT_EQ(cu.primary_get_state(1, &flags, &active), CUDA_SUCCESS);
  EXPECT_EQ(active, 1);
  ASSERT_EQ(cu.primary_get_state(0, &flags, &active), CUDA_SUCCESS);
  EXPECT_EQ(active, 0);
  EXPECT_EQ(fake.counter("calls.cuDeviceGetCount"), 1);
}

TEST_F(FakeCudaTest, DeviceNameAndUuidComeFromTheScenario) {
  fake.reset({{"devices", {{{"name", "Fake H100"}, {"uuid", "GPU-0123abcd-4567-89ef-0011-223344556677"}}}}});
  char name[6];
  ASSERT_EQ(cu.device_get_name(name, sizeof name, 0), CUDA_SUCCESS);
  EXPECT_STREQ(name, "Fake ");  // truncated and terminated
  CUuuid uuid{};
  ASSERT_EQ(cu.device_get_uuid(&uuid, 0), CUDA_SUCCESS);
  const unsigned char expected[16] = {0x01, 0x23, 0xab, 0xcd, 0x45, 0x67, 0x89, 0xef,
                                      0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77};
  EXPECT_EQ(std::memcmp(uuid.bytes, expected, 16), 0);
}

TEST_F(FakeCudaTest, MalformedScenarioIsRefusedAndStateKept) {
  fake.reset({{"devices", {{{"name", "kept"}}}}});
  EXPECT_THROW(fake.reset({{"devices", {{{"free", 1}}}}}), std::runtime_error);
  try {
    fake.update({{"devices", {{{"sync_seconds", -2}}}}});
    FAIL() << "a negative sync_seconds other than -1 was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "devices[0].sync_seconds: expected seconds >= 0, or -1 to hang, got -2");
  }
  EXPECT_THROW(fake.reset({{"errors", {{"cuMemGetInfo_v2", 1}}}}), std::runtime_error);
  EXPECT_EQ(fake.state()["devices"][0]["name"], "kept");
}

TEST_F(FakeCudaTest, UnknownCounterIsMinusOne) {
  fake.reset();
  EXPECT_EQ(fake.counter("calls.cuNoSuchThing"), -1);
  EXPECT_EQ(fake.counter("bogus"), -1);
  EXPECT_EQ(fake.counter("calls.cuMemGetInfo"), 0);
}

// --- resolvers -------------------------------------------------------------

TEST(FakeCudaVariants, MainVariantExportsBothResolversAndOnlyV2Names) {
  Driver cu(FAKE_CUDA_PATH);
  EXPECT_NE(cu.symbol("cuGetProcAddress_v2"), nullptr);
  EXPECT_NE(cu.symbol("cuGetProcAddress"), nullptr);
  EXPECT_NE(cu.symbol("cuMemGetInfo_v2"), nullptr);
  EXPECT_EQ(cu.symbol("cuMemGetInfo"), nullptr);
  EXPECT_EQ(cu.symbol("cuCtxPushCurrent"), nullptr);
}

TEST(FakeCudaVariants, V1VariantExportsOnlyTheFourArgumentResolver) {
  Driver cu(FAKE_CUDA_V1_PATH);
  EXPECT_EQ(cu.symbol("cuGetProcAddress_v2"), nullptr);
  EXPECT_NE(cu.symbol("cuGetProcAddress"), nullptr);
}

TEST(FakeCudaVariants, PlainVariantExportsNoResolver) {
  Driver cu(FAKE_CUDA_PLAIN_PATH);
  EXPECT_EQ(cu.symbol("cuGetProcAddress_v2"), nullptr);
  EXPECT_EQ(cu.symbol("cuGetProcAddress"), nullptr);
  EXPECT_NE(cu.symbol("cuDevicePrimaryCtxRelease_v2"), nullptr);
  EXPECT_NE(cu.symbol("fake_cuda_reset"), nullptr);
}

TEST(FakeCudaVariants, InternalsAreHidden) {
  Driver cu(FAKE_CUDA_PATH);
  EXPECT_EQ(cu.symbol("_ZN9fake_cuda5stateEv"), nullptr);  // fake_cuda::state()
}

class FakeCudaResolver : public FakeCudaTest {
 protected:
  decltype(&::cuGetProcAddress_v2) resolve = cu.entry<decltype(&::cuGetProcAddress_v2)>("cuGetProcAddress_v2");
};

TEST_F(FakeCudaResolver, ResolvesBaseNameToTheExportedVersion) {
  fake.reset();
  void* pfn = nullptr;
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
  ASSERT_EQ(resolve("cuMemGetInfo", &pfn, 3020, CU_GET_PROC_ADDRESS_DEFAULT, &status), CUDA_SUCCESS);
  EXPECT_EQ(status, CU_GET_PROC_ADDRESS_SUCCESS);
  EXPECT_EQ(pfn, cu.symbol("cuMemGetInfo_v2"));
  EXPECT_EQ(fake.counter("calls.cuGetProcAddress_v2"), 1);
  EXPECT_EQ(fake.counter("calls.cuGetProcAddress"), 0);
}

TEST_F(FakeCudaResolver, ResolverAnswersBeforeCuInit) {
  fake.reset({{"initialized", false}});
  void* pfn = nullptr;
  ASSERT_EQ(resolve("cuDeviceGetCount", &pfn, 2000, CU_GET_PROC_ADDRESS_DEFAULT, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(pfn, cu.symbol("cuDeviceGetCount"));
}

TEST_F(FakeCudaResolver, MissingEntryResolvesToNull) {
  fake.reset({{"missing", {"cuMemPoolTrimTo"}}});
  void* pfn = reinterpret_cast<void*>(1);
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
  ASSERT_EQ(resolve("cuMemPoolTrimTo", &pfn, 11020, CU_GET_PROC_ADDRESS_DEFAULT, &status), CUDA_SUCCESS);
  EXPECT_EQ(pfn, nullptr);
  EXPECT_EQ(status, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
}

TEST_F(FakeCudaResolver, UnknownSymbolResolvesToNull) {
  fake.reset();
  void* pfn = reinterpret_cast<void*>(1);
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
  ASSERT_EQ(resolve("cuNoSuchThing", &pfn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &status), CUDA_SUCCESS);
  EXPECT_EQ(pfn, nullptr);
  EXPECT_EQ(status, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
}

TEST_F(FakeCudaResolver, VersionOlderThanTheEntryFindsNothing) {
  fake.reset();
  void* pfn = reinterpret_cast<void*>(1);
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
  ASSERT_EQ(resolve("cuDevicePrimaryCtxRelease", &pfn, 7000, CU_GET_PROC_ADDRESS_DEFAULT, &status), CUDA_SUCCESS);
  EXPECT_EQ(pfn, nullptr);
  EXPECT_EQ(status, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
}

TEST_F(FakeCudaResolver, VersionAboveTheDriverIsInvalidValue) {
  fake.reset({{"driver_version", 11080}});
  void* pfn = nullptr;
  EXPECT_EQ(resolve("cuMemGetInfo", &pfn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(resolve("cuMemGetInfo", &pfn, 11080, CU_GET_PROC_ADDRESS_DEFAULT, nullptr), CUDA_SUCCESS);
  EXPECT_NE(pfn, nullptr);
}

TEST_F(FakeCudaResolver, ResolvesItselfToTheFiveArgumentResolver) {
  fake.reset();
  void* pfn = nullptr;
  ASSERT_EQ(resolve("cuGetProcAddress", &pfn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(pfn, cu.symbol("cuGetProcAddress_v2"));
  ASSERT_EQ(resolve("cuGetProcAddress", &pfn, 11030, CU_GET_PROC_ADDRESS_DEFAULT, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(pfn, cu.symbol("cuGetProcAddress"));
}

TEST(FakeCudaV1Resolver, MissingEntryResolvesToNull) {
  FakeCuda fake(FAKE_CUDA_V1_PATH);
  Driver cu(FAKE_CUDA_V1_PATH);
  fake.reset({{"driver_version", 11080}, {"missing", {"cuDeviceGetUuid"}}});
  auto resolve = cu.entry<GetProcAddressV1>("cuGetProcAddress");
  void* pfn = reinterpret_cast<void*>(1);
  ASSERT_EQ(resolve("cuDeviceGetUuid", &pfn, 11040, CU_GET_PROC_ADDRESS_DEFAULT), CUDA_SUCCESS);
  EXPECT_EQ(pfn, nullptr);
  ASSERT_EQ(resolve("cuCtxSynchronize", &pfn, 2000, CU_GET_PROC_ADDRESS_DEFAULT), CUDA_SUCCESS);
  EXPECT_EQ(pfn, cu.symbol("cuCtxSynchronize"));
  EXPECT_EQ(fake.counter("calls.cuGetProcAddress"), 2);
}

}  // namespace
