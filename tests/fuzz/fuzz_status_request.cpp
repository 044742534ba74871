// Fuzz target: one status request through the server's own check
// (native/src/status_protocol.cpp, RequestCheck), as the ROUTER socket would
// deliver it, with the clock fixed.
//
// Input: one mode byte, then up to three frames separated by "\xff\xfe"
// (kSeparator; the last frame keeps any further separators). The server
// receives ["peer", frames...]. Mode bits:
//   0x01  the server has the key kKey (else none)
//   0x02  the server requires signatures
//   0x04  the target signs: HMAC-SHA256(kKey, last frame) goes in as a frame
//         right before the last one, so that what follows the signature check
//         (JSON, fields, replay window) is reached
//   0x08  the same frames are checked a second time
//   0x10  max_request_bytes is 256 (else 64 KiB, the default)
// The clock reads kNow: signed requests with "time_ns": 1700000000000000000
// are in the window.
//
// Invariants: an accepted request holds the fields its kind needs, its
// signature is the one the key gives (no other is ever accepted), and its
// body says what the check made of it; a refused one carries a known
// "gpucleanup.server.<n>" id, a message, and an error reply that says both; a
// request checked again is never accepted after being refused, and a signed
// one is accepted once.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "detail/hmac.hpp"
#include "fuzz_support.hpp"
#include "status_protocol.hpp"

namespace {

using gpucleanup::CheckedRequest;
using gpucleanup::RequestKind;
using gpucleanup::fuzz::printable;
using json = nlohmann::json;

constexpr std::string_view kKey = "fuzz-key-0123456789abcdef";
constexpr std::int64_t kNow = 1'700'000'000'000'000'000;

std::string describe(const std::vector<std::string_view>& frames, const CheckedRequest& result) {
  std::string out = "frames:";
  for (const auto frame : frames) out += " [" + printable(frame) + "]";
  out += result.rejection ? " -> " + result.rejection->id + " " + result.rejection->message
                          : std::string(" -> accepted ") + gpucleanup::request_kind_name(result.kind);
  return out;
}

void check_refused(const std::vector<std::string_view>& frames, const CheckedRequest& result) {
  // The ids the check gives; 411, 412, 416 and 417 come from the server's state.
  static const std::set<std::string> known = {
      "gpucleanup.server.401", "gpucleanup.server.402", "gpucleanup.server.403", "gpucleanup.server.404",
      "gpucleanup.server.405", "gpucleanup.server.406", "gpucleanup.server.407", "gpucleanup.server.408",
      "gpucleanup.server.409", "gpucleanup.server.410", "gpucleanup.server.413", "gpucleanup.server.414",
      "gpucleanup.server.415"};
  const auto& rejection = *result.rejection;
  FUZZ_CHECK(gpucleanup::fuzz::is_server_error_id(rejection.id), describe(frames, result));
  FUZZ_CHECK(known.count(rejection.id) == 1, describe(frames, result));
  FUZZ_CHECK(!rejection.message.empty(), describe(frames, result));
  FUZZ_CHECK(result.id.is_null() ||
                 (result.id.is_string() && result.id.get_ref<const std::string&>().size() <= gpucleanup::kMaxRequestIdLength),
             describe(frames, result));
  json reply = gpucleanup::error_reply(result.id, rejection);
  FUZZ_CHECK(reply["ok"] == false && reply["kind"] == "error" && reply["id"] == result.id, describe(frames, result));
  FUZZ_CHECK(reply["error"]["id"] == rejection.id, describe(frames, result));
  FUZZ_CHECK(reply["error"]["message"] == "[" + rejection.id + "] " + rejection.message, describe(frames, result));
  // What goes on the wire reads back as the same reply (the id came from valid JSON).
  const std::string text = gpucleanup::dump_json(reply);
  json back = json::parse(text, nullptr, false);
  FUZZ_CHECK(!back.is_discarded() && back["id"] == result.id && back["error"]["id"] == rejection.id,
             describe(frames, result) + " reply " + printable(text));
}

void check_accepted(const std::vector<std::string_view>& frames, const CheckedRequest& result,
                    const gpucleanup::ServerConfig& config) {
  const std::string what = describe(frames, result);
  FUZZ_CHECK(result.authenticated, what);
  const std::size_t parts = frames.size() - result.envelope;
  FUZZ_CHECK(parts == 1 || parts == 2, what);
  std::size_t bytes = 0;
  for (std::size_t i = result.envelope; i < frames.size(); ++i) bytes += frames[i].size();
  FUZZ_CHECK(bytes <= config.max_request_bytes, what);
  const std::string_view body = frames.back();
  const std::string_view signature = parts == 2 ? frames[result.envelope] : std::string_view();
  FUZZ_CHECK(result.is_signed == !signature.empty(), what);
  if (gpucleanup::signature_required(config)) FUZZ_CHECK(result.is_signed, what);
  if (result.is_signed) {
    // No signature but the key's own is ever accepted.
    FUZZ_CHECK(!config.key.empty(), what);
    FUZZ_CHECK(signature == gpucleanup::detail::hmac_sha256_hex(config.key, body), what);
  }
  // The body, read again without the check, says what the check made of it.
  json request = json::parse(body, nullptr, false);
  FUZZ_CHECK(request.is_object(), what);
  FUZZ_CHECK(request["protocol"].is_number_integer() && request["protocol"].get<std::int64_t>() == 1, what);
  FUZZ_CHECK(request["kind"] == gpucleanup::request_kind_name(result.kind), what);
  FUZZ_CHECK(request.value("id", json()) == result.id, what);
  FUZZ_CHECK(result.id.is_null() ||
                 (result.id.is_string() && result.id.get_ref<const std::string&>().size() <= gpucleanup::kMaxRequestIdLength),
             what);
  if (result.is_signed) {
    const json& time = request["time_ns"];
    FUZZ_CHECK(time.is_number_integer(), what);
    const auto window = static_cast<long double>(config.replay_window_s) * 1e9L;
    const auto offset = static_cast<long double>(time.get<std::int64_t>()) - static_cast<long double>(kNow);
    FUZZ_CHECK(offset >= -window - 1 && offset <= window + 1, what);
  }
  switch (result.kind) {
    case RequestKind::history: {
      const json limit = request.value("limit", json());
      FUZZ_CHECK(limit.is_null() == !result.limit.has_value(), what);
      if (result.limit) FUZZ_CHECK(limit.is_number_integer() && limit.get<std::size_t>() == *result.limit, what);
      break;
    }
    case RequestKind::drain: {
      FUZZ_CHECK(result.is_signed && !config.key.empty(), what);
      FUZZ_CHECK(std::isfinite(result.timeout_s) && result.timeout_s >= 0 &&
                     result.timeout_s <= config.max_drain_timeout_s,
                 what);
      const json timeout = request.value("timeout_s", json());
      FUZZ_CHECK(timeout.is_null() ? result.timeout_s == config.drain_timeout_s
                                   : timeout.get<double>() == result.timeout_s,
                 what);
      break;
    }
    case RequestKind::park: {
      FUZZ_CHECK(result.is_signed && !config.key.empty(), what);
      FUZZ_CHECK(request["step"].is_string() && request["step"] == result.park_step, what);
      FUZZ_CHECK(result.park_step == "begin" || result.park_step == "parked" || result.park_step == "failed" ||
                     result.park_step == "resumed",
                 what);
      const json bytes = request.value("bytes", json());
      FUZZ_CHECK(bytes.is_null() == !result.bytes.has_value(), what);
      if (result.bytes) FUZZ_CHECK(*result.bytes >= 0 && bytes.get<std::int64_t>() == *result.bytes, what);
      break;
    }
    case RequestKind::status:
    case RequestKind::ping:
      break;
  }
}

void check_one(const std::vector<std::string_view>& frames, const CheckedRequest& result,
               const gpucleanup::ServerConfig& config) {
  const bool delimited = frames.size() >= 3 && frames[1].empty();
  FUZZ_CHECK(result.envelope == (delimited ? 2u : 1u), describe(frames, result));
  const std::size_t parts = frames.size() - result.envelope;
  if (parts != 1 && parts != 2) {
    FUZZ_CHECK(result.rejection && result.rejection->id == "gpucleanup.server.407", describe(frames, result));
    FUZZ_CHECK(!result.authenticated, describe(frames, result));
  }
  if (result.rejection) {
    check_refused(frames, result);
  } else {
    check_accepted(frames, result, config);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t mode = data[0];
  const std::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);

  gpucleanup::ServerConfig config;
  config.endpoint = "inproc://fuzz";
  if (mode & 0x01) config.key = std::string(kKey);
  config.require_signature = (mode & 0x02) != 0;
  if (mode & 0x10) config.max_request_bytes = 256;

  const std::vector<std::string_view> pieces = gpucleanup::fuzz::split(input, 3);
  std::vector<std::string_view> frames{"peer"};
  std::string signature;
  if (mode & 0x04) {
    signature = gpucleanup::detail::hmac_sha256_hex(kKey, pieces.back());
    frames.insert(frames.end(), pieces.begin(), pieces.end() - 1);
    frames.push_back(signature);
    frames.push_back(pieces.back());
  } else {
    frames.insert(frames.end(), pieces.begin(), pieces.end());
  }

  gpucleanup::RequestCheck check(config);
  const CheckedRequest first = check.check(frames, kNow);
  check_one(frames, first, config);
  if (mode & 0x08) {
    const CheckedRequest again = check.check(frames, kNow);
    check_one(frames, again, config);
    if (first.rejection) {
      FUZZ_CHECK(again.rejection.has_value(), "accepted after being refused: " + describe(frames, again));
    } else if (first.is_signed) {
      FUZZ_CHECK(again.rejection && again.rejection->id == "gpucleanup.server.404",
                 "a signed request accepted twice: " + describe(frames, again));
    } else {
      FUZZ_CHECK(!again.rejection && again.kind == first.kind, "unsigned request judged twice differently: " +
                                                                   describe(frames, again));
    }
  }
  FUZZ_CHECK(check.remembered() <= 2, "signatures remembered: " + std::to_string(check.remembered()));
  return 0;
}
