// Loading the driver and resolving its entry points, against the three
// variants of the fake driver.
#include "driver.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "test_support.hpp"

using gpucleanup::Driver;
using gpucleanup::Resolver;
using gpucleanup::testing::FakeCuda;

TEST(Driver, ResolvesEveryEntryPointThroughGetProcAddressV2) {
  FakeCuda fake;
  fake.reset({{"driver_version", 13000}});
  const Driver driver(FAKE_CUDA_PATH);
  ASSERT_TRUE(driver.loaded());
  EXPECT_TRUE(driver.usable());
  EXPECT_EQ(driver.resolver(), Resolver::proc_address_v2);
  EXPECT_TRUE(driver.missing_required().empty());
  EXPECT_TRUE(driver.missing_optional().empty());
  EXPECT_EQ(driver.version(), 13000);
  EXPECT_EQ(driver.message(), "");
  EXPECT_GT(fake.counter("calls.cuGetProcAddress_v2"), 0);
  EXPECT_EQ(fake.counter("calls.cuGetProcAddress"), 0);
}

TEST(Driver, FallsBackToFourArgumentGetProcAddressOnOlderDrivers) {
  FakeCuda fake(FAKE_CUDA_V1_PATH);
  fake.reset({{"driver_version", 11080}});
  const Driver driver(FAKE_CUDA_V1_PATH);
  ASSERT_TRUE(driver.usable()) << driver.message();
  EXPECT_EQ(driver.resolver(), Resolver::proc_address);
  // Everything but cuCtxRecordEvent (CUDA 12.5) and the checkpoint calls, which came with CUDA 12.8.
  EXPECT_EQ(driver.missing_optional(),
            (std::vector<std::string>{"cuCtxRecordEvent", "cuCheckpointProcessGetState", "cuCheckpointProcessLock",
                                      "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
                                      "cuCheckpointProcessUnlock", "cuCheckpointProcessGetRestoreThreadId"}));
  EXPECT_GT(fake.counter("calls.cuGetProcAddress"), 0);
  size_t total = 0;
  ASSERT_EQ(driver.api().cuDeviceTotalMem(&total, 0), CUDA_SUCCESS);
  EXPECT_EQ(total, 80ull << 30);
}

TEST(Driver, FallsBackToPlainDlsymOfTheV2SymbolsWithoutAResolver) {
  FakeCuda fake(FAKE_CUDA_PLAIN_PATH);
  fake.reset({{"devices", {{{"primary_active", true}}}}});
  const Driver driver(FAKE_CUDA_PLAIN_PATH);
  ASSERT_TRUE(driver.usable()) << driver.message();
  EXPECT_EQ(driver.resolver(), Resolver::dlsym);
  EXPECT_TRUE(driver.missing_optional().empty());
  // The _v2 symbols are the ones found: they answer through the fake's state.
  size_t total = 0;
  ASSERT_EQ(driver.api().cuDeviceTotalMem(&total, 0), CUDA_SUCCESS);
  EXPECT_EQ(total, 80ull << 30);
  EXPECT_EQ(fake.counter("calls.cuDeviceTotalMem"), 1);
}

TEST(Driver, NoDriverIsAStateNotAnError) {
  const Driver driver("/nonexistent/libcuda.so.1");
  EXPECT_FALSE(driver.loaded());
  EXPECT_FALSE(driver.usable());
  EXPECT_EQ(driver.resolver(), Resolver::none);
  EXPECT_EQ(driver.path(), "/nonexistent/libcuda.so.1");
  EXPECT_EQ(driver.message().rfind("[gpucleanup.driver.101] no CUDA driver: cannot load /nonexistent/libcuda.so.1 (", 0),
            0u)
      << driver.message();
  EXPECT_NE(driver.message().find("there is no GPU memory to clean on this machine"), std::string::npos);
}

TEST(Driver, AFifoOrADirectoryIsNeverOpened) {
  // dlopen() of a FIFO would block until something writes to it: GPUCLEANUP_LIBCUDA=<a FIFO> must not hang.
  char made[] = "/tmp/gpucleanup-driver-test-XXXXXX";
  ASSERT_NE(mkdtemp(made), nullptr);
  const std::string dir = made;
  const std::string fifo = dir + "/libcuda.so.1";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const Driver from_fifo(fifo);
  const Driver from_dir(dir);
  unlink(fifo.c_str());
  rmdir(dir.c_str());
  EXPECT_FALSE(from_fifo.loaded());
  EXPECT_EQ(from_fifo.message(), "[gpucleanup.driver.101] no CUDA driver: cannot load " + fifo +
                                     " (a FIFO, not a library): point GPUCLEANUP_LIBCUDA at the NVIDIA driver's "
                                     "libcuda.so.1, or unset it");
  EXPECT_FALSE(from_dir.loaded());
  EXPECT_NE(from_dir.message().find(" (a directory, not a library): "), std::string::npos) << from_dir.message();
  EXPECT_EQ(gpucleanup::not_loadable("libcuda.so.1"), "");  // a bare name is dlopen's to look up
  EXPECT_EQ(gpucleanup::not_loadable(FAKE_CUDA_PATH), "");
}

TEST(Driver, MissingRequiredEntryPointNamesItself) {
  FakeCuda fake;
  fake.reset({{"missing", {"cuMemGetInfo"}}});
  const Driver driver(FAKE_CUDA_PATH);
  EXPECT_TRUE(driver.loaded());
  EXPECT_FALSE(driver.usable());
  EXPECT_EQ(driver.missing_required(), std::vector<std::string>{"cuMemGetInfo"});
  EXPECT_EQ(driver.message(), std::string("[gpucleanup.driver.102] the CUDA driver ") + FAKE_CUDA_PATH +
                                  " lacks cuMemGetInfo, which gpucleanup needs: update the NVIDIA driver");
}

TEST(Driver, MissingOptionalEntryPointIsListedAndLeftNull) {
  FakeCuda fake;
  fake.reset({{"missing", {"cuMemPoolTrimTo"}}});
  const Driver driver(FAKE_CUDA_PATH);
  EXPECT_TRUE(driver.usable());
  EXPECT_EQ(driver.missing_optional(), std::vector<std::string>{"cuMemPoolTrimTo"});
  EXPECT_EQ(driver.api().cuMemPoolTrimTo, nullptr);
  EXPECT_NE(driver.api().cuMemPoolGetAttribute, nullptr);
}

TEST(Driver, OlderDriverVersionLeavesNewerOptionalEntryPointsOut) {
  FakeCuda fake;
  fake.reset({{"driver_version", 11000}});
  const Driver driver(FAKE_CUDA_PATH);
  EXPECT_TRUE(driver.usable()) << driver.message();
  EXPECT_EQ(driver.version(), 11000);
  EXPECT_EQ(driver.missing_optional(),
            (std::vector<std::string>{"cuDeviceGetUuid", "cuDeviceGetDefaultMemPool", "cuDeviceGetMemPool",
                                      "cuMemPoolTrimTo", "cuMemPoolGetAttribute", "cuCtxRecordEvent",
                                      "cuCheckpointProcessGetState",
                                      "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                                      "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock", "cuCheckpointProcessGetRestoreThreadId"}));
}

TEST(Driver, NamesErrorsWithCuGetErrorName) {
  FakeCuda fake;
  fake.reset();
  const Driver driver(FAKE_CUDA_PATH);
  EXPECT_EQ(driver.error_name(CUDA_ERROR_ILLEGAL_ADDRESS), "CUDA_ERROR_ILLEGAL_ADDRESS");
  EXPECT_GT(fake.counter("calls.cuGetErrorName"), 0);
}

TEST(Driver, NamesErrorsFromItsOwnTableWithoutCuGetErrorName) {
  FakeCuda fake;
  fake.reset({{"missing", {"cuGetErrorName"}}});
  const Driver driver(FAKE_CUDA_PATH);
  EXPECT_EQ(driver.missing_optional(), std::vector<std::string>{"cuGetErrorName"});
  EXPECT_EQ(driver.error_name(CUDA_ERROR_ILLEGAL_ADDRESS), "CUDA_ERROR_ILLEGAL_ADDRESS");
  EXPECT_EQ(driver.error_name(CUDA_ERROR_NOT_INITIALIZED), "CUDA_ERROR_NOT_INITIALIZED");
  EXPECT_EQ(driver.error_name(static_cast<CUresult>(12345)), "CUresult 12345");
  EXPECT_EQ(fake.counter("calls.cuGetErrorName"), 0);
}

TEST(Driver, RecognisesExactlyTheStickyErrors) {
  for (int code : {700, 702, 710, 714, 715, 716, 717, 718, 719, 226}) {
    EXPECT_TRUE(gpucleanup::is_sticky(static_cast<CUresult>(code))) << code;
  }
  for (int code : {0, 1, 2, 3, 4, 100, 101, 201, 801, 999}) {
    EXPECT_FALSE(gpucleanup::is_sticky(static_cast<CUresult>(code))) << code;
  }
}

TEST(Driver, ProcessInstanceFollowsGpucleanupLibcuda) {
  // FakeCuda points GPUCLEANUP_LIBCUDA at the fake before the first use.
  FakeCuda fake;
  fake.reset();
  EXPECT_EQ(Driver::default_path(), FAKE_CUDA_PATH);
  EXPECT_EQ(Driver::process().path(), FAKE_CUDA_PATH);
  EXPECT_EQ(&Driver::process(), &Driver::process());
}

TEST(Driver, ALibraryWithoutTheDriverApiIsNotCalledAnOldDriver) {
  // GPUCLEANUP_LIBCUDA=libc.so.6: it loads, but nothing of the driver API is in it
  const Driver driver("libc.so.6");
  EXPECT_TRUE(driver.loaded());
  EXPECT_FALSE(driver.usable());
  EXPECT_EQ(driver.resolver(), Resolver::dlsym);
  EXPECT_EQ(driver.message(),
            "[gpucleanup.driver.107] libc.so.6 is not a CUDA driver: it exports none of the driver's entry points "
            "(cuDeviceGetCount, cuMemGetInfo, ...): point GPUCLEANUP_LIBCUDA at the NVIDIA driver's libcuda.so.1, "
            "or unset it");
}

TEST(Driver, ResolvesTheCheckpointCallsFromCuda128AndCuInitOnlyOnRequest) {
  FakeCuda fake;
  fake.reset({{"driver_version", 12080}});
  const Driver driver(FAKE_CUDA_PATH);
  EXPECT_TRUE(driver.missing_optional().empty());
  EXPECT_NE(driver.api().cuCheckpointProcessLock, nullptr);
  EXPECT_NE(driver.api().cuCheckpointProcessRestore, nullptr);
  EXPECT_NE(driver.resolve("cuInit", 2000, "cuInit"), nullptr);
  EXPECT_EQ(driver.resolve("cuNoSuchCall", 2000, "cuNoSuchCall"), nullptr);
  EXPECT_EQ(fake.counter("cuInit"), 0);
}
