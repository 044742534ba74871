// The status protocol's messages without a socket: the check of one request
// as it came in (frames, signature, JSON, fields, replay window), the error
// reply, and the record message the server publishes.
//
// StatusServer answers through these, and so do the fuzz targets of
// tests/fuzz: what is fuzzed is the server's own code, with a clock passed in.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "detail/status_replay_guard.hpp"
#include "server_config.hpp"

namespace gpucleanup {

inline constexpr int kStatusProtocol = 1;
// A request's "id" is echoed in its reply: a string of at most this many characters.
inline constexpr std::size_t kMaxRequestIdLength = 256;
// JSON nested deeper than this is refused while it is parsed.
inline constexpr int kMaxRequestDepth = 32;

// A request the server refuses: answered with an error reply, then it serves on.
// id is "gpucleanup.server.<number>".
struct Rejection {
  std::string id;
  std::string message;
};

// Throws Rejection{"gpucleanup.server." + number, message}.
[[noreturn]] void reject(const char* number, std::string message);

enum class RequestKind { status, history, ping, drain, park };

// The name a request carries in "kind".
const char* request_kind_name(RequestKind kind) noexcept;

// What the check made of one request.
struct CheckedRequest {
  // Leading frames that route the reply back: the routing id, and REQ's empty
  // delimiter when there was one. The reply repeats them.
  std::size_t envelope = 0;
  // The request's "id" once it was found valid, else null: replies echo it,
  // error replies too.
  nlohmann::json id;
  // The signature was good, or none was needed: the peer spoke the protocol
  // (its connection is not dropped as idle), even if the request is refused.
  bool authenticated = false;
  // Set when the request is refused: answer with error_reply(id, *rejection).
  std::optional<Rejection> rejection;

  // The rest holds only when the request was accepted.
  RequestKind kind = RequestKind::ping;
  bool is_signed = false;
  std::optional<std::size_t> limit;  // history: "limit", when given
  double timeout_s = 0;              // drain: "timeout_s", else the config's drain_timeout_s
  std::string park_step;             // park: "step" (begin, parked, failed, resumed, tracer)
  std::optional<std::int64_t> bytes; // park: "bytes" of a "parked" step, when given
  bool automatic = false;             // park: "automatic", a begin asked by a policy, not by a person
  std::int64_t tracer = 0;            // park, step tracer: the pid of the helper that holds the threads
};

// Whether every request must be signed: as configured, and always on tcp://.
bool signature_required(const ServerConfig& config);

// The check of incoming requests with one server config. Signed requests are
// admitted once (the replay guard it keeps), so the check has state.
class RequestCheck {
 public:
  explicit RequestCheck(const ServerConfig& config);

  // One request, as the ROUTER socket delivered it (routing id first), at
  // now_ns (CLOCK_REALTIME): the number of frames and bytes, the signature,
  // the JSON (at most kMaxRequestDepth deep), "protocol", "kind", "id",
  // "time_ns" and the replay window for signed requests, the fields of its
  // kind ("limit", "timeout_s"), and that a drain is signed under a key.
  // What it cannot judge is left to the server: the kernel's state and a
  // drain already running (server.411, server.412).
  CheckedRequest check(std::span<const std::string_view> frames, std::int64_t now_ns);

  // Signatures remembered against replay.
  std::size_t remembered() const noexcept { return replay_.size(); }

 private:
  void check_body(CheckedRequest& out, std::span<const std::string_view> parts, std::int64_t now_ns);

  std::string key_;
  bool require_signature_;
  std::size_t max_request_bytes_;
  double replay_window_s_;
  double drain_timeout_s_;
  double max_drain_timeout_s_;
  detail::ReplayGuard replay_;
};

// {"ok": false, "kind": "error", "id": id, "error": {"id": ..., "message": "[<id>] <message>"}}
// (the server adds "protocol" and "time_ns" to every reply).
nlohmann::json error_reply(const nlohmann::json& id, const Rejection& rejection);

// The message published for one cell record: {"kernel", "kind": "record",
// "protocol", "record", "seq", "time_ns"} as dump() writes it (keys in
// order), with the record's text inside as it is. record_text must be one
// JSON object (the C ABI checks it with json::accept).
std::string record_message(const nlohmann::json& kernel, std::string_view record_text, std::uint64_t seq,
                           std::int64_t time_ns);

// JSON text as the server writes it: invalid UTF-8 (records come from Python
// and may carry anything) is replaced, never an exception.
std::string dump_json(const nlohmann::json& value);

}  // namespace gpucleanup
