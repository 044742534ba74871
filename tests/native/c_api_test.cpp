// The C ABI: statuses, messages with stable ids, JSON out, no exception
// through, and the process-wide states (no driver, exiting) in processes of
// their own.
#include "gpucleanup/gpucleanup.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <thread>

#include <sys/wait.h>
#include <unistd.h>

#include "test_support.hpp"

using gpucleanup::testing::FakeCuda;
using nlohmann::json;

namespace {

// Calls a gpucleanup function that hands out JSON and parses it.
template <typename Call>
json call_json(Call call, gpucleanup_status expected = GPUCLEANUP_OK) {
  char* out = nullptr;
  const gpucleanup_status status = call(&out);
  EXPECT_EQ(status, expected) << gpucleanup_last_error();
  if (out == nullptr) return nullptr;
  json value = json::parse(out);
  gpucleanup_free(out);
  return value;
}

class CApi : public ::testing::Test {
 protected:
  void TearDown() override {
    fake.release_sync();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (fake.counter("syncs_in_flight") != 0 || fake.counter("retained") != 0) {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  FakeCuda fake;  // sets GPUCLEANUP_LIBCUDA before the library's first use
};

}  // namespace

TEST_F(CApi, VersionsAreReported) {
  EXPECT_STREQ(gpucleanup_version(), GPUCLEANUP_VERSION);
  EXPECT_EQ(gpucleanup_abi_version(), GPUCLEANUP_ABI_VERSION);
  gpucleanup_free(nullptr);
}

TEST_F(CApi, SnapshotAndProbeGiveJsonAndClearTheLastError) {
  fake.reset({{"devices", {{{"primary_active", true}}, json::object()}}});
  EXPECT_EQ(gpucleanup_snapshot(nullptr), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  const json snapshot = call_json([](char** out) { return gpucleanup_snapshot(out); });
  EXPECT_STREQ(gpucleanup_last_error(), "");
  EXPECT_EQ(snapshot["kind"], "snapshot");
  EXPECT_EQ(snapshot["schema_version"], 1);
  EXPECT_EQ(snapshot["library_version"], GPUCLEANUP_VERSION);
  EXPECT_EQ(snapshot["driver"]["state"], "ready");
  EXPECT_EQ(snapshot["driver"]["resolver"], "cuGetProcAddress_v2");
  ASSERT_EQ(snapshot["devices"].size(), 2u);
  EXPECT_EQ(snapshot["devices"][0]["state"], "in_use");
  EXPECT_EQ(snapshot["devices"][1]["state"], "idle");
  const json probe = call_json([](char** out) { return gpucleanup_probe(out); });
  EXPECT_EQ(probe["kind"], "probe");
  EXPECT_EQ(fake.counter("contexts_created"), 0);
}

TEST_F(CApi, NullOutPointerIsAnInvalidArgumentWithAStableId) {
  fake.reset();
  const std::string expected = "[gpucleanup.api.101] json_out is NULL: pass the address of a char*";
  EXPECT_EQ(gpucleanup_probe(nullptr), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(gpucleanup_last_error(), expected);
  EXPECT_EQ(gpucleanup_snapshot(nullptr), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(gpucleanup_last_error(), expected);
  EXPECT_EQ(gpucleanup_drain(1.0, nullptr, nullptr, nullptr), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(gpucleanup_last_error(), expected);
  EXPECT_EQ(gpucleanup_server_start("{}", nullptr), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(gpucleanup_last_error(), expected);
  EXPECT_EQ(fake.counter("calls.cuDeviceGetCount"), 0);
}

TEST_F(CApi, BadTimeoutIsAnInvalidArgument) {
  fake.reset();
  char* out = reinterpret_cast<char*>(0x1);
  EXPECT_EQ(gpucleanup_drain(-1.0, nullptr, nullptr, &out), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(out, nullptr);
  EXPECT_STREQ(gpucleanup_last_error(),
               "[gpucleanup.api.103] timeout_s is -1: pass a finite number of seconds >= 0 (0 skips the wait)");
  EXPECT_EQ(gpucleanup_drain(std::nan(""), nullptr, nullptr, &out), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(gpucleanup_last_error()).rfind("[gpucleanup.api.103] timeout_s is ", 0), 0u);
  EXPECT_EQ(gpucleanup_drain(std::numeric_limits<double>::infinity(), nullptr, nullptr, &out),
            GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(gpucleanup_last_error(),
               "[gpucleanup.api.103] timeout_s is inf: pass a finite number of seconds >= 0 (0 skips the wait)");
  EXPECT_EQ(fake.counter("calls.cuDeviceGetCount"), 0);
}

TEST_F(CApi, MalformedJsonInIsAnInvalidArgument) {
  char* out = nullptr;
  EXPECT_EQ(gpucleanup_server_start("{not json", &out), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(gpucleanup_last_error(),
               "[gpucleanup.api.104] config_json is not a JSON object: pass a JSON object such as {}");
  EXPECT_EQ(gpucleanup_server_set_state("[1, 2]"), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(gpucleanup_last_error(),
               "[gpucleanup.api.104] state_json is not a JSON object: pass a JSON object such as {}");
  EXPECT_EQ(gpucleanup_server_publish(nullptr), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(gpucleanup_last_error(),
               "[gpucleanup.api.104] record_json is NULL: pass a JSON object as a UTF-8 string");
  // a record is checked without being built: every malformed text is still refused
  for (const char* bad : {"", "   ", "[1, 2]", "{\"cell\": 1", "{\"cell\": 1} {}", "{\"cell\": NaN}", "\"text\"",
                          "{\"cell\": \"\xff\"}"}) {
    EXPECT_EQ(gpucleanup_server_publish(bad), GPUCLEANUP_ERR_INVALID_ARGUMENT) << bad;
    EXPECT_STREQ(gpucleanup_last_error(),
                 "[gpucleanup.api.104] record_json is not a JSON object: pass a JSON object such as {}");
  }
}

TEST_F(CApi, ServerConfigOfTheWrongTypeIsAnInvalidArgument) {
  char* out = nullptr;
  EXPECT_EQ(gpucleanup_server_start(R"({"endpoint": 5})", &out), GPUCLEANUP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(gpucleanup_last_error()).rfind("[gpucleanup.server.506] ", 0), 0u) << gpucleanup_last_error();
  EXPECT_EQ(out, nullptr);
}

TEST_F(CApi, ServerCallsWithoutARunningServerSaySo) {
  EXPECT_EQ(gpucleanup_server_stop(), GPUCLEANUP_OK);
  EXPECT_EQ(gpucleanup_server_set_state(R"({"state": "idle"})"), GPUCLEANUP_ERR_SERVER);
  EXPECT_STREQ(gpucleanup_last_error(),
               "[gpucleanup.api.107] the status server is not running: call gpucleanup_server_start first");
  EXPECT_EQ(gpucleanup_server_publish(R"({"cell": 1})"), GPUCLEANUP_ERR_SERVER);
  EXPECT_EQ(gpucleanup_server_cell(1, 3), -1);
  EXPECT_STREQ(gpucleanup_last_error(),
               "[gpucleanup.api.107] the status server is not running: call gpucleanup_server_start first");
}

namespace {

// One park step through the C ABI: its status, and in *state the state after it (or the error's sentence).
gpucleanup_status park(const char* step, std::string* state) {
  char* after = nullptr;
  const auto result = gpucleanup_server_park(step, -1, nullptr, &after);
  if (result == GPUCLEANUP_OK) {
    *state = json::parse(after).value("state", "");
    gpucleanup_free(after);
  } else {
    *state = gpucleanup_last_error();
  }
  return result;
}

}  // namespace

TEST_F(CApi, ACellsStateIsSaidInOneCallThatAnswersTheParkState) {
  char* out = nullptr;
  const auto status = gpucleanup_server_start(R"({"endpoint": "inproc://gpucleanup-c-api-cell"})", &out);
  if (status != GPUCLEANUP_OK) GTEST_SKIP() << "no status server in this build: " << gpucleanup_last_error();
  gpucleanup_free(out);
  std::string state;
  EXPECT_EQ(gpucleanup_server_cell(1, 7), 0);  // running: no park may begin
  EXPECT_EQ(park("begin", &state), GPUCLEANUP_ERR_INTERNAL);
  EXPECT_NE(state.find("park refused: the kernel is running"), std::string::npos) << state;
  EXPECT_EQ(gpucleanup_server_cell(0, -1), 0);  // idle: one may
  ASSERT_EQ(park("begin", &state), GPUCLEANUP_OK) << state;
  EXPECT_EQ(state, "parking");
  EXPECT_EQ(gpucleanup_server_cell(1, 8), 1);  // a park under way keeps its state, and says so
  EXPECT_EQ(gpucleanup_server_parked(), 1);
  ASSERT_EQ(park("parked", &state), GPUCLEANUP_OK) << state;
  EXPECT_EQ(gpucleanup_server_cell(0, -1), 2);
  ASSERT_EQ(park("resumed", &state), GPUCLEANUP_OK) << state;
  EXPECT_EQ(state, "idle");
  EXPECT_EQ(gpucleanup_server_cell(1, -1), 0);  // running again, with no cell number
  EXPECT_EQ(park("begin", &state), GPUCLEANUP_ERR_INTERNAL);
  EXPECT_EQ(gpucleanup_server_stop(), GPUCLEANUP_OK);
}

TEST_F(CApi, NoParkBeginsWhileTheKernelsOwnBackgroundWorkRunsAndNoneBeginsWhileAParkIsUnderWay) {
  char* out = nullptr;
  const auto status = gpucleanup_server_start(R"({"endpoint": "inproc://gpucleanup-c-api-background"})", &out);
  if (status != GPUCLEANUP_OK) GTEST_SKIP() << "no status server in this build: " << gpucleanup_last_error();
  gpucleanup_free(out);
  std::string state;
  ASSERT_EQ(gpucleanup_server_cell(0, -1), 0);  // idle: a park could begin
  EXPECT_EQ(gpucleanup_server_background(1), 0);  // two releases begin, on threads of their own
  EXPECT_EQ(gpucleanup_server_background(1), 0);
  EXPECT_EQ(park("begin", &state), GPUCLEANUP_ERR_INTERNAL);
  EXPECT_NE(state.find("park refused: gpucleanup is giving the frameworks' caches back on a thread of its own"),
            std::string::npos) << state;
  EXPECT_EQ(gpucleanup_server_background(0), 0);
  EXPECT_EQ(park("begin", &state), GPUCLEANUP_ERR_INTERNAL) << "one release still runs";
  EXPECT_EQ(gpucleanup_server_background(0), 0);
  EXPECT_EQ(gpucleanup_server_background(0), 0) << "an end without a begin counts nothing";
  ASSERT_EQ(park("begin", &state), GPUCLEANUP_OK) << state;
  EXPECT_EQ(gpucleanup_server_background(1), 1);  // parking: the release must not run, and is not counted
  ASSERT_EQ(park("parked", &state), GPUCLEANUP_OK) << state;
  EXPECT_EQ(gpucleanup_server_background(1), 2);
  ASSERT_EQ(park("resumed", &state), GPUCLEANUP_OK) << state;
  ASSERT_EQ(park("begin", &state), GPUCLEANUP_OK) << "the refused begins were not counted: " << state;
  ASSERT_EQ(park("failed", &state), GPUCLEANUP_OK) << state;
  EXPECT_EQ(gpucleanup_server_stop(), GPUCLEANUP_OK);
  EXPECT_EQ(gpucleanup_server_background(1), -1);  // no server: nothing coordinates
  EXPECT_NE(std::string(gpucleanup_last_error()).find("the status server is not running"), std::string::npos);
}

TEST_F(CApi, AParkBlockerIsKeptByTheServerAndNeedsOne) {
  EXPECT_EQ(gpucleanup_server_park_blocker("a thread runs"), -1);  // no server: nothing to keep it
  EXPECT_NE(std::string(gpucleanup_last_error()).find("the status server is not running"), std::string::npos);
  char* out = nullptr;
  const auto status = gpucleanup_server_start(R"({"endpoint": "inproc://gpucleanup-c-api-blocker"})", &out);
  if (status != GPUCLEANUP_OK) GTEST_SKIP() << "no status server in this build: " << gpucleanup_last_error();
  gpucleanup_free(out);
  std::string state;
  ASSERT_EQ(gpucleanup_server_cell(0, -1), 0);
  EXPECT_EQ(gpucleanup_server_park_blocker("a thread runs"), 0);
  ASSERT_EQ(park("begin", &state), GPUCLEANUP_OK) << "the kernel's own park is a person's: " << state;
  ASSERT_EQ(park("failed", &state), GPUCLEANUP_OK) << state;
  EXPECT_EQ(gpucleanup_server_park_blocker(nullptr), 0);  // taken back
  EXPECT_EQ(gpucleanup_server_park_blocker(""), 0);
  EXPECT_EQ(gpucleanup_server_stop(), GPUCLEANUP_OK);
}

TEST_F(CApi, StartingARunningServerIsAServerError) {
  char* out = nullptr;
  const auto status = gpucleanup_server_start(R"({"endpoint": "inproc://gpucleanup-c-api-test"})", &out);
  if (status != GPUCLEANUP_OK) {
    EXPECT_EQ(status, GPUCLEANUP_ERR_SERVER);
    GTEST_SKIP() << "no status server in this build: " << gpucleanup_last_error();
  }
  gpucleanup_free(out);
  EXPECT_EQ(gpucleanup_server_start(R"({"endpoint": "inproc://gpucleanup-c-api-test-2"})", &out),
            GPUCLEANUP_ERR_SERVER);
  EXPECT_STREQ(gpucleanup_last_error(),
               "[gpucleanup.api.106] the status server is already running: call gpucleanup_server_stop first");
  EXPECT_EQ(gpucleanup_server_set_state(R"({"state": "idle"})"), GPUCLEANUP_OK);
  EXPECT_EQ(gpucleanup_server_stop(), GPUCLEANUP_OK);
  EXPECT_EQ(gpucleanup_server_stop(), GPUCLEANUP_OK);
}

TEST_F(CApi, DrainReturnsAtTheLimitAndReportsProgressOnTheCallingThread) {
  fake.reset({{"devices", {{{"primary_active", true}, {"sync_seconds", -1}}}}});
  struct Seen {
    int calls = 0;
    std::thread::id thread;
    json last;
  } seen;
  auto progress = [](const char* report, void* user) -> int {
    auto* s = static_cast<Seen*>(user);
    ++s->calls;
    s->thread = std::this_thread::get_id();
    s->last = json::parse(report);
    return 1;  // stop waiting
  };
  const auto start = std::chrono::steady_clock::now();
  const json report = call_json([&](char** out) { return gpucleanup_drain(30.0, progress, &seen, out); });
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(seen.calls, 1);
  EXPECT_EQ(seen.thread, std::this_thread::get_id());
  EXPECT_EQ(seen.last["device"], 0);
  EXPECT_GE(seen.last["waited_s"].get<double>(), 2.0);
  EXPECT_EQ(seen.last["limit_s"], 30.0);
  EXPECT_LT(took, 4.0);
  EXPECT_EQ(report["interrupted"], true);
  EXPECT_EQ(report["devices"][0]["settle"]["status"], "interrupted");

  // Still waiting in the background: the next drain does not wait again.
  const json again = call_json([](char** out) { return gpucleanup_drain(0.2, nullptr, nullptr, out); });
  EXPECT_EQ(again["devices"][0]["settle"]["status"], "still_busy");
  EXPECT_EQ(fake.counter("calls.cuCtxSynchronize"), 1);
}

TEST_F(CApi, ForkedChildStartsCleanEvenWhileTheParentIsMidDrain) {
  fake.reset({{"devices", {{{"primary_active", true}, {"sync_seconds", -1}}}}});
  // A drain on another thread holds the library's lock while the fork happens.
  std::thread drainer([] {
    char* out = nullptr;
    gpucleanup_drain(30.0, nullptr, nullptr, &out);
    gpucleanup_free(out);
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (fake.counter("syncs_in_flight") != 1) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(10);  // a deadlock on the parent's lock would hang here
    const long long calls = fake.counter("calls.cuDeviceGetCount");
    char* out = nullptr;
    if (gpucleanup_snapshot(&out) != GPUCLEANUP_OK) _exit(1);
    const json snapshot = json::parse(out);
    gpucleanup_free(out);
    const bool ok = snapshot["driver"]["state"] == "unusable" &&
                    snapshot["driver"]["message"] ==
                        "[gpucleanup.driver.105] CUDA was initialised before this process forked: CUDA cannot be "
                        "used in a forked child" &&
                    snapshot["devices"].empty() && fake.counter("calls.cuDeviceGetCount") == calls;
    _exit(ok ? 0 : 2);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  fake.release_sync();
  drainer.join();
  ASSERT_TRUE(WIFEXITED(status)) << "child died with signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(CApiDeathTest, NoDriverIsAStateAndStatusOk) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("GPUCLEANUP_LIBCUDA", "/nonexistent/libcuda.so.1", 1);
        char* out = nullptr;
        if (gpucleanup_snapshot(&out) != GPUCLEANUP_OK) std::exit(1);
        const json snapshot = json::parse(out);
        gpucleanup_free(out);
        if (gpucleanup_drain(1.0, nullptr, nullptr, &out) != GPUCLEANUP_OK) std::exit(2);
        const json drained = json::parse(out);
        gpucleanup_free(out);
        const bool ok = snapshot["driver"]["state"] == "no_driver" && snapshot["devices"].empty() &&
                        drained["driver"]["state"] == "no_driver" && drained["devices"].empty();
        std::exit(ok ? 0 : 3);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(CApiDeathTest, MissingRequiredEntryPointIsADriverErrorNamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        FakeCuda fake;
        fake.reset({{"missing", {"cuCtxSynchronize"}}});
        char* out = nullptr;
        if (gpucleanup_snapshot(&out) != GPUCLEANUP_ERR_DRIVER) std::exit(1);
        const std::string message = gpucleanup_last_error();
        const std::string expected = std::string("[gpucleanup.driver.102] the CUDA driver ") + FAKE_CUDA_PATH +
                                     " lacks cuCtxSynchronize, which gpucleanup needs: update the NVIDIA driver";
        std::exit(message == expected && out == nullptr ? 0 : 2);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(CApiDeathTest, AfterShutdownCallsReturnExitingAndMakeNoDriverCalls) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        FakeCuda fake;
        fake.reset({{"devices", {{{"primary_active", true}}}}});
        char* out = nullptr;
        if (gpucleanup_snapshot(&out) != GPUCLEANUP_OK) std::exit(1);
        gpucleanup_free(out);
        const long long count_calls = fake.counter("calls.cuDeviceGetCount");
        const long long memory_calls = fake.counter("calls.cuMemGetInfo");
        gpucleanup_shutdown();
        gpucleanup_shutdown();  // idempotent
        const std::string expected =
            "[gpucleanup.api.102] the process is exiting: gpucleanup makes no more driver calls";
        if (gpucleanup_snapshot(&out) != GPUCLEANUP_ERR_EXITING || gpucleanup_last_error() != expected) std::exit(2);
        if (gpucleanup_probe(&out) != GPUCLEANUP_ERR_EXITING) std::exit(3);
        if (gpucleanup_drain(1.0, nullptr, nullptr, &out) != GPUCLEANUP_ERR_EXITING) std::exit(4);
        if (out != nullptr) std::exit(5);
        const bool quiet = fake.counter("calls.cuDeviceGetCount") == count_calls &&
                           fake.counter("calls.cuMemGetInfo") == memory_calls;
        std::exit(quiet ? 0 : 6);
      },
      ::testing::ExitedWithCode(0), "");
}
