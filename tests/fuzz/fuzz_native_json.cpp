// Fuzz target: the JSON the extension hands to the native library, through
// the C ABI's own checks (native/src/api_input.cpp) and what takes it from
// there (server_config_from_json and the request check it configures,
// StatusServer::set_state, record_message).
//
// Input: one byte that picks the argument, then its text, given as the C ABI
// gets it (a C string: it ends at the first NUL byte).
//   0  config_json of gpucleanup_server_start: parse_object, then
//      server_config_from_json, then a RequestCheck with that config judging
//      a ping signed now, one unsigned, and signed ones at the ends of time
//   1  state_json of gpucleanup_server_set_state: parse_object, set_state
//   2  record_json of gpucleanup_server_publish: checked_object_text (the text
//      kept and spliced into the published message), against parse_object
//   3  candidates_json of gpucleanup_trace_start: parse_trace_candidates
//
// Invariants: each refusal is the documented status and message; a config
// taken has an endpoint and every number in its range; a record taken is
// exactly one JSON object and the message it is spliced into is valid JSON
// that carries it; the two object checks of the C ABI agree.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "api_input.hpp"
#include "detail/hmac.hpp"
#include "errors.hpp"
#include "fuzz_support.hpp"
#include "status_protocol.hpp"
#include "status_server.hpp"

namespace {

using gpucleanup::Failure;
using gpucleanup::fuzz::printable;
using json = nlohmann::json;

constexpr std::int64_t kNow = 1'700'000'000'000'000'000;

std::string not_an_object(const char* what) {
  return std::string("[gpucleanup.api.104] ") + what + " is not a JSON object: pass a JSON object such as {}";
}

bool is_seconds(double value) { return std::isfinite(value) && value >= 0; }

void check_request_with(const gpucleanup::ServerConfig& config, const std::string& text) {
  gpucleanup::RequestCheck check(config);
  const std::string ping = json{{"protocol", 1}, {"kind", "ping"}, {"id", "p"}, {"time_ns", kNow}}.dump();
  const std::string signature = gpucleanup::detail::hmac_sha256_hex(config.key.empty() ? "k" : config.key, ping);
  const std::vector<std::string_view> signed_frames{"peer", signature, ping};
  const std::vector<std::string_view> unsigned_frames{"peer", ping};
  const bool fits = ping.size() + signature.size() <= config.max_request_bytes;

  const auto good = check.check(signed_frames, kNow);
  if (config.key.empty()) {
    FUZZ_CHECK(good.rejection && good.rejection->id == (fits ? "gpucleanup.server.415" : "gpucleanup.server.406"),
               printable(text));
  } else if (fits) {
    FUZZ_CHECK(!good.rejection && good.is_signed && good.kind == gpucleanup::RequestKind::ping,
               printable(text) + " -> " + (good.rejection ? good.rejection->message : ""));
  } else {
    FUZZ_CHECK(good.rejection && good.rejection->id == "gpucleanup.server.406", printable(text));
  }

  const auto plain = check.check(unsigned_frames, kNow);
  if (ping.size() > config.max_request_bytes) {
    FUZZ_CHECK(plain.rejection && plain.rejection->id == "gpucleanup.server.406", printable(text));
  } else if (gpucleanup::signature_required(config)) {
    FUZZ_CHECK(plain.rejection && plain.rejection->id == "gpucleanup.server.401", printable(text));
  } else {
    FUZZ_CHECK(!plain.rejection, printable(text));
  }

  // Times at the ends of the clock: refused as outside the window, or taken
  // when the window reaches them, never anything else.
  if (config.key.empty() || !fits) return;
  for (const std::int64_t time : {std::numeric_limits<std::int64_t>::min(), std::int64_t{0},
                                  std::numeric_limits<std::int64_t>::max()}) {
    const std::string body = json{{"protocol", 1}, {"kind", "ping"}, {"time_ns", time}}.dump();
    const std::string sig = gpucleanup::detail::hmac_sha256_hex(config.key, body);
    const std::vector<std::string_view> frames{"peer", sig, body};
    const auto far = check.check(frames, kNow);
    if (far.rejection) {
      FUZZ_CHECK(far.rejection->id == "gpucleanup.server.405" || far.rejection->id == "gpucleanup.server.406",
                 printable(text) + " time " + std::to_string(time) + " -> " + far.rejection->id);
    } else {
      const long double window = static_cast<long double>(config.replay_window_s) * 1e9L;
      const long double offset = static_cast<long double>(time) - static_cast<long double>(kNow);
      FUZZ_CHECK(offset >= -window - 1 && offset <= window + 1,
                 printable(text) + " time " + std::to_string(time) + " taken");
    }
  }
}

void config_json(const std::string& text) {
  json value;
  try {
    value = gpucleanup::parse_object(text.c_str(), "config_json");
  } catch (const Failure& failure) {
    FUZZ_CHECK(failure.status() == GPUCLEANUP_ERR_INVALID_ARGUMENT, printable(text));
    FUZZ_CHECK(failure.message() == not_an_object("config_json"), failure.message());
    return;
  }
  FUZZ_CHECK(value.is_object(), printable(text));
  gpucleanup::ServerConfig config;
  try {
    config = gpucleanup::server_config_from_json(value);
  } catch (const gpucleanup::Error& error) {
    FUZZ_CHECK(error.id() == "gpucleanup.server.506", error.what());
    FUZZ_CHECK(std::string(error.what()).rfind("[gpucleanup.server.506] server config ", 0) == 0, error.what());
    return;
  }
  const std::string what = printable(text);
  FUZZ_CHECK(!config.endpoint.empty(), what);
  FUZZ_CHECK(config.max_peers >= 1, what);
  for (const double seconds : {config.replay_window_s, config.snapshot_timeout_s, config.drain_timeout_s,
                               config.max_drain_timeout_s, config.peer_idle_timeout_s, config.peer_grace_s,
                               config.handshake_timeout_s, config.heartbeat_interval_s}) {
    FUZZ_CHECK(is_seconds(seconds), what + " seconds " + std::to_string(seconds));
  }
  const auto kernel = value.find("kernel");
  FUZZ_CHECK(config.kernel == (kernel == value.end() || kernel->is_null() ? json::object() : *kernel), what);
  check_request_with(config, text);
}

void state_json(const std::string& text) {
  static gpucleanup::StatusServer server(gpucleanup::ServerConfig{}, {});  // never started: no socket
  json value;
  try {
    value = gpucleanup::parse_object(text.c_str(), "state_json");
  } catch (const Failure& failure) {
    FUZZ_CHECK(failure.status() == GPUCLEANUP_ERR_INVALID_ARGUMENT, printable(text));
    FUZZ_CHECK(failure.message() == not_an_object("state_json"), failure.message());
    return;
  }
  FUZZ_CHECK(value.is_object(), printable(text));
  // As the replies carry it: the text read back is the same state.
  const json back = json::parse(gpucleanup::dump_json(value), nullptr, false);
  FUZZ_CHECK(back == value, printable(text));
  server.set_state(std::move(value));
}

void record_json(const std::string& text) {
  std::string kept;
  bool taken = true;
  try {
    kept = gpucleanup::checked_object_text(text.c_str(), "record_json");
  } catch (const Failure& failure) {
    FUZZ_CHECK(failure.status() == GPUCLEANUP_ERR_INVALID_ARGUMENT, printable(text));
    FUZZ_CHECK(failure.message() == not_an_object("record_json"), failure.message());
    taken = false;
  }
  json parsed;
  bool parses = true;
  try {
    parsed = gpucleanup::parse_object(text.c_str(), "record_json");
  } catch (const Failure&) {
    parses = false;
  }
  // The two checks of one C string agree, but for a byte order mark in front,
  // which parse_object skips and a record must not carry (it is spliced).
  const bool bom = text.rfind("\xef\xbb\xbf", 0) == 0;
  FUZZ_CHECK(taken == (parses && !bom), printable(text) + (taken ? " taken" : " refused") + " by checked_object_text");
  if (!taken) return;
  FUZZ_CHECK(!kept.empty() && kept.front() == '{' && kept.back() == '}', printable(kept));
  FUZZ_CHECK(json::parse(kept, nullptr, false) == parsed, printable(kept));
  // The status and history replies parse the kept text again; the published
  // message holds it as it is.
  const json kernel{{"pid", 7}, {"kernel_id", "k\xc3\xa9"}};
  const std::string message = gpucleanup::record_message(kernel, kept, 12, kNow);
  json published = json::parse(message, nullptr, false);
  FUZZ_CHECK(published.is_object(), printable(message));
  FUZZ_CHECK(published.size() == 6 && published["record"] == parsed && published["kernel"] == kernel &&
                 published["kind"] == "record" && published["protocol"] == 1 && published["seq"] == 12 &&
                 published["time_ns"] == kNow,
             printable(message));
}

void candidates_json(const std::string& text) {
  std::vector<std::string> candidates;
  try {
    candidates = gpucleanup::parse_trace_candidates(text.c_str());
  } catch (const Failure& failure) {
    FUZZ_CHECK(failure.status() == GPUCLEANUP_ERR_INVALID_ARGUMENT, printable(text));
    FUZZ_CHECK(failure.message().rfind("[gpucleanup.api.113] candidates_json is not a JSON array of strings", 0) == 0,
               failure.message());
    const json value = json::parse(text, nullptr, false);
    FUZZ_CHECK(!value.is_array() || !std::all_of(value.begin(), value.end(), [](const json& c) { return c.is_string(); }),
               printable(text));
    return;
  }
  const json value = json::parse(text, nullptr, false);
  FUZZ_CHECK(value.is_array() && value.get<std::vector<std::string>>() == candidates, printable(text));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  // A C string: what follows a NUL byte never reaches the library.
  std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  text.resize(std::strlen(text.c_str()));
  switch (data[0] % 4) {
    case 0:
      config_json(text);
      break;
    case 1:
      state_json(text);
      break;
    case 2:
      record_json(text);
      break;
    default:
      candidates_json(text);
      break;
  }
  return 0;
}
