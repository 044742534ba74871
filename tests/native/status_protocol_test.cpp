// The status protocol's request check, error reply and record message
// without a socket (status_protocol.hpp), with the clock passed in; and the
// C ABI's JSON checks (api_input.hpp). The server's own tests
// (status_server_test.cpp) cover the same through ZeroMQ.
#include "status_protocol.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include "api_input.hpp"
#include "detail/hmac.hpp"
#include "detail/status_replay_guard.hpp"

namespace gpucleanup {
namespace {

using json = nlohmann::json;

constexpr const char* kKey = "0123abcd-4567-89ef-0123-456789abcdef";
constexpr std::int64_t kNow = 1'700'000'000'000'000'000;
constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();
constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

std::string body(const std::string& kind, json fields = json::object()) {
  json request{{"protocol", 1}, {"kind", kind}, {"id", "r-1"}, {"time_ns", kNow}};
  request.update(fields);
  return request.dump();
}

ServerConfig keyed(double replay_window_s = 60) {
  ServerConfig config;
  config.endpoint = "tcp://127.0.0.1:0";
  config.key = kKey;
  config.replay_window_s = replay_window_s;
  return config;
}

// [routing id, "", signature, body], as a DEALER client's request arrives.
CheckedRequest check_signed(RequestCheck& check, const std::string& text, std::int64_t now = kNow) {
  const std::string signature = detail::hmac_sha256_hex(kKey, text);
  const std::vector<std::string_view> frames{"peer", "", signature, text};
  return check.check(frames, now);
}

TEST(RequestCheck, SignedRequestsOfEachKindAreAcceptedWithTheirFields) {
  RequestCheck check(keyed());
  const CheckedRequest status = check_signed(check, body("status"));
  ASSERT_FALSE(status.rejection) << status.rejection->message;
  EXPECT_EQ(status.envelope, 2u);
  EXPECT_EQ(status.kind, RequestKind::status);
  EXPECT_TRUE(status.is_signed);
  EXPECT_TRUE(status.authenticated);
  EXPECT_EQ(status.id, "r-1");

  const CheckedRequest history = check_signed(check, body("history", {{"limit", 3}, {"id", "r-2"}}));
  ASSERT_FALSE(history.rejection);
  EXPECT_EQ(history.kind, RequestKind::history);
  EXPECT_EQ(history.limit, 3u);

  const CheckedRequest drain = check_signed(check, body("drain", {{"id", "r-3"}}));
  ASSERT_FALSE(drain.rejection);
  EXPECT_EQ(drain.kind, RequestKind::drain);
  EXPECT_EQ(drain.timeout_s, 10.0) << "the config's drain_timeout_s";
  const CheckedRequest timed = check_signed(check, body("drain", {{"id", "r-4"}, {"timeout_s", 2.5}}));
  EXPECT_EQ(timed.timeout_s, 2.5);
  EXPECT_EQ(check.remembered(), 4u);
}

TEST(RequestCheck, UnsignedRequestsAndTheirEnvelopes) {
  ServerConfig config;
  config.endpoint = "inproc://x";
  RequestCheck check(config);
  const std::string text = body("ping");
  // DEALER without a signature: [id, "", "", body]; REQ: [id, "", body]; bare DEALER: [id, body].
  for (const auto& [frames, envelope] :
       std::vector<std::pair<std::vector<std::string_view>, std::size_t>>{
           {{"peer", "", "", text}, 2}, {{"peer", "", text}, 2}, {{"peer", text}, 1}}) {
    const CheckedRequest result = check.check(frames, kNow);
    ASSERT_FALSE(result.rejection) << result.rejection->message;
    EXPECT_EQ(result.envelope, envelope);
    EXPECT_EQ(result.kind, RequestKind::ping);
    EXPECT_FALSE(result.is_signed);
  }
  EXPECT_EQ(check.remembered(), 0u);
}

TEST(RequestCheck, RefusalsCarryTheIdOnceItWasReadAndSayWhetherThePeerAuthenticated) {
  RequestCheck check(keyed());
  const CheckedRequest unknown = check_signed(check, body("reboot"));
  ASSERT_TRUE(unknown.rejection);
  EXPECT_EQ(unknown.rejection->id, "gpucleanup.server.410");
  EXPECT_EQ(unknown.id, "r-1");
  EXPECT_TRUE(unknown.authenticated);

  const CheckedRequest not_json = check_signed(check, "{not json");
  EXPECT_EQ(not_json.rejection->id, "gpucleanup.server.402");
  EXPECT_TRUE(not_json.id.is_null());
  EXPECT_TRUE(not_json.authenticated) << "signed rightly: the peer speaks the protocol";

  const std::vector<std::string_view> forged{"peer", "", std::string_view("0000"), "{}"};
  const CheckedRequest bad = check.check(forged, kNow);
  EXPECT_EQ(bad.rejection->id, "gpucleanup.server.403");
  EXPECT_FALSE(bad.authenticated);

  const std::string status = body("status");
  const std::vector<std::string_view> unsigned_frames{"peer", "", "", status};
  const CheckedRequest plain = check.check(unsigned_frames, kNow);
  EXPECT_EQ(plain.rejection->id, "gpucleanup.server.401") << "tcp:// needs every request signed";

  const std::vector<std::string_view> three{"peer", "a", "b", "c"};
  const CheckedRequest frames = check.check(three, kNow);
  EXPECT_EQ(frames.rejection->message,
            "request must be [signature, body] or [body] after the routing envelope, got 3 frames");

  const json reply = error_reply(unknown.id, *unknown.rejection);
  EXPECT_EQ(reply, (json{{"ok", false},
                         {"kind", "error"},
                         {"id", "r-1"},
                         {"error",
                          {{"id", "gpucleanup.server.410"},
                           {"message", "[gpucleanup.server.410] unknown request kind \"reboot\": use status, "
                                       "history, drain, park or ping"}}}}));
}

TEST(RequestCheck, DrainFieldsAreCheckedBeforeTheServerLooksAtItsState) {
  RequestCheck check(keyed());
  const CheckedRequest long_drain = check_signed(check, body("drain", {{"timeout_s", 61}}));
  EXPECT_EQ(long_drain.rejection->message, "request is malformed: \"timeout_s\" must be a number of seconds from 0 to 60");
  const CheckedRequest negative = check_signed(check, body("history", {{"limit", -1}, {"id", "r-2"}}));
  EXPECT_EQ(negative.rejection->message, "request is malformed: \"limit\" must be an integer >= 0");

  ServerConfig keyless;
  keyless.endpoint = "inproc://x";
  RequestCheck open(keyless);
  const std::string drain = body("drain");
  const std::vector<std::string_view> frames{"peer", "", "", drain};
  EXPECT_EQ(open.check(frames, kNow).rejection->id, "gpucleanup.server.413");
  ServerConfig ipc = keyed();
  ipc.endpoint = "ipc:///tmp/x/k.sock";
  RequestCheck signed_optional(ipc);
  EXPECT_EQ(signed_optional.check(frames, kNow).rejection->id, "gpucleanup.server.414");
}

// Found by tests/fuzz/fuzz_signature (corpus/fuzz_signature/finding-replay-window-overflow):
// now + window overflowed int64 (undefined behaviour) for a window of centuries.
TEST(ReplayGuard, AWindowOfCenturiesDoesNotOverflow) {
  detail::ReplayGuard guard(kMax, 8);
  EXPECT_EQ(guard.admit("a", kMax, kNow), detail::ReplayGuard::Verdict::fresh) << "now + window is past the clock's end";
  EXPECT_EQ(guard.admit("b", kNow - kMax, kNow), detail::ReplayGuard::Verdict::fresh);
  EXPECT_EQ(guard.admit("c", kMin, kNow), detail::ReplayGuard::Verdict::stale) << "further back than the window";
  EXPECT_EQ(guard.admit("a", kNow, kNow), detail::ReplayGuard::Verdict::duplicate);
  detail::ReplayGuard minute(60'000'000'000, 8);
  EXPECT_EQ(minute.admit("c", kMax, kMax - 1), detail::ReplayGuard::Verdict::fresh);
  EXPECT_EQ(minute.admit("d", kMin, 0), detail::ReplayGuard::Verdict::stale);
  EXPECT_EQ(minute.admit("e", kMax, 0), detail::ReplayGuard::Verdict::future);
}

// Seen while writing the invariants of tests/fuzz/fuzz_native_json (the seed
// corpus/fuzz_native_json/config-replay-window-centuries replays it): a replay_window_s of 1e10 s
// made the window's nanoseconds overflow int64 when converted (undefined behaviour).
TEST(RequestCheck, AReplayWindowBeyondTheClockDoesNotOverflow) {
  EXPECT_EQ(detail::ReplayGuard::window_of(60), 60'000'000'000);
  EXPECT_EQ(detail::ReplayGuard::window_of(1e10), kMax);
  EXPECT_EQ(detail::ReplayGuard::window_of(1e300), kMax);
  EXPECT_EQ(detail::ReplayGuard::window_of(std::nan("")), 0);
  RequestCheck check(keyed(1e10));
  const CheckedRequest old = check_signed(check, body("ping", {{"time_ns", kNow - kMax}}));
  EXPECT_FALSE(old.rejection) << old.rejection->message;
  const CheckedRequest late = check_signed(check, body("ping", {{"time_ns", kMax}}));
  EXPECT_FALSE(late.rejection) << late.rejection->message;
  RequestCheck minute(keyed(60));
  EXPECT_EQ(check_signed(minute, body("ping", {{"time_ns", kMin}})).rejection->message,
            "request time is outside the replay window of 60 s: set \"time_ns\" to the current time (CLOCK_REALTIME, ns)");
}

TEST(RecordMessage, IsValidJsonWithTheRecordTextInside) {
  const std::string message = record_message(json{{"pid", 7}}, "{\"cell\": 3,\n \"a\": [1]}", 12, kNow);
  EXPECT_EQ(message, "{\"kernel\":{\"pid\":7},\"kind\":\"record\",\"protocol\":1,\"record\":{\"cell\": 3,\n \"a\": [1]},"
                     "\"seq\":12,\"time_ns\":1700000000000000000}");
  EXPECT_EQ(json::parse(message)["record"], (json{{"cell", 3}, {"a", {1}}}));
}

TEST(ApiInput, ObjectChecksAgreeButForAByteOrderMark) {
  EXPECT_EQ(checked_object_text(" \n{\"a\": 1}\t", "record_json"), "{\"a\": 1}");
  EXPECT_EQ(parse_object(" \n{\"a\": 1}\t", "record_json"), (json{{"a", 1}}));
  for (const char* bad : {"[]", "{} {}", "{\"a\": \"\xff\"}", ""}) {
    EXPECT_THROW(checked_object_text(bad, "record_json"), Failure) << bad;
    EXPECT_THROW(parse_object(bad, "record_json"), Failure) << bad;
  }
  // nlohmann_json skips a leading UTF-8 byte order mark; a record's text is
  // spliced into the published message as it is, so it must not carry one.
  const char* bom = "\xef\xbb\xbf{\"a\": 1}";
  EXPECT_EQ(parse_object(bom, "state_json"), (json{{"a", 1}}));
  try {
    checked_object_text(bom, "record_json");
    FAIL() << "a record with a byte order mark was taken";
  } catch (const Failure& failure) {
    EXPECT_EQ(failure.status(), GPUCLEANUP_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(failure.message(),
              "[gpucleanup.api.104] record_json is not a JSON object: pass a JSON object such as {}");
  }
}

TEST(ApiInput, TraceCandidatesAreAnArrayOfStrings) {
  EXPECT_EQ(parse_trace_candidates("[\"libcupti.so.13\", \"/x/libcupti.so\"]"),
            (std::vector<std::string>{"libcupti.so.13", "/x/libcupti.so"}));
  EXPECT_TRUE(parse_trace_candidates("[]").empty());
  for (const char* bad : {"[13]", "{}", "\"libcupti.so\"", "[", static_cast<const char*>(nullptr)}) {
    try {
      parse_trace_candidates(bad);
      FAIL() << (bad ? bad : "NULL");
    } catch (const Failure& failure) {
      EXPECT_EQ(failure.message(),
                "[gpucleanup.api.113] candidates_json is not a JSON array of strings: pass the paths of libcupti to "
                "try, such as [\"libcupti.so.13\"]");
    }
  }
}

}  // namespace
}  // namespace gpucleanup
