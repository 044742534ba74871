#include "status_protocol.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include "detail/hmac.hpp"

namespace gpucleanup {
namespace {

using json = nlohmann::json;

std::string scheme_of(const std::string& endpoint) {
  const auto pos = endpoint.find("://");
  return pos == std::string::npos ? std::string() : endpoint.substr(0, pos);
}

}  // namespace

void reject(const char* number, std::string message) {
  throw Rejection{std::string("gpucleanup.server.") + number, std::move(message)};
}

const char* request_kind_name(RequestKind kind) noexcept {
  switch (kind) {
    case RequestKind::status:
      return "status";
    case RequestKind::history:
      return "history";
    case RequestKind::ping:
      return "ping";
    case RequestKind::drain:
      return "drain";
    case RequestKind::park:
      return "park";
  }
  return "unknown";
}

bool signature_required(const ServerConfig& config) {
  return config.require_signature || scheme_of(config.endpoint) == "tcp";
}

std::string dump_json(const json& value) { return value.dump(-1, ' ', false, json::error_handler_t::replace); }

RequestCheck::RequestCheck(const ServerConfig& config)
    : key_(config.key),
      require_signature_(signature_required(config)),
      max_request_bytes_(config.max_request_bytes),
      replay_window_s_(config.replay_window_s),
      drain_timeout_s_(config.drain_timeout_s),
      max_drain_timeout_s_(config.max_drain_timeout_s),
      replay_(detail::ReplayGuard::window_of(config.replay_window_s), config.replay_capacity) {}

CheckedRequest RequestCheck::check(std::span<const std::string_view> frames, std::int64_t now_ns) {
  CheckedRequest out;
  // The routing id, then REQ's empty delimiter when the client sent one.
  out.envelope = frames.size() >= 3 && frames[1].empty() ? 2 : 1;
  try {
    check_body(out, frames.subspan(std::min(out.envelope, frames.size())), now_ns);
  } catch (const Rejection& rejection) {
    out.rejection = rejection;
  }
  return out;
}

void RequestCheck::check_body(CheckedRequest& out, std::span<const std::string_view> parts, std::int64_t now_ns) {
  if (parts.size() < 1 || parts.size() > 2) {
    reject("407", "request must be [signature, body] or [body] after the routing envelope, got " +
                      std::to_string(parts.size()) + " frames");
  }
  std::size_t bytes = 0;
  for (const std::string_view part : parts) bytes += part.size();
  if (bytes > max_request_bytes_) {
    reject("406", "request is too large (" + std::to_string(bytes) + " bytes, limit " +
                      std::to_string(max_request_bytes_) + "): send one small JSON object");
  }
  const std::string signature = parts.size() == 2 ? std::string(parts[0]) : std::string();
  const std::string_view body = parts.back();
  const bool is_signed = !signature.empty();
  if (is_signed) {
    if (key_.empty()) {
      reject("415", "request is signed but this server has no key: send it unsigned, with an empty signature frame");
    }
    if (!detail::hmac_sha256_verify(key_, body, signature)) {
      reject("403", "bad signature: sign the body with HMAC-SHA256 (hex digest) under the key from the "
                    "kernel's key file");
    }
  } else if (require_signature_) {
    reject("401", "request is not signed: this endpoint needs every request signed with HMAC-SHA256 under the "
                  "key from the kernel's key file");
  }
  out.authenticated = true;

  json request;
  try {
    request = json::parse(body, [](int depth, json::parse_event_t, json&) {
      if (depth > kMaxRequestDepth) {
        throw Rejection{"gpucleanup.server.408", "request is malformed: nested deeper than 32 levels"};
      }
      return true;
    });
  } catch (const json::exception&) {
    reject("402", "request is not valid JSON: send one JSON object per message");
  }
  if (!request.is_object()) reject("408", "request is malformed: the body must be a JSON object");
  if (const auto it = request.find("id"); it != request.end()) {
    if (!it->is_null() && !(it->is_string() && it->get_ref<const std::string&>().size() <= kMaxRequestIdLength)) {
      reject("408", "request is malformed: \"id\" must be a string of at most 256 characters");
    }
    out.id = *it;
  }
  const auto protocol = request.find("protocol");
  if (protocol == request.end() || !protocol->is_number_integer()) {
    reject("408", "request is malformed: \"protocol\" must be the integer 1");
  }
  if (protocol->get<std::int64_t>() != kStatusProtocol) {
    reject("409", "protocol version " + dump_json(*protocol) + " is not supported: this server speaks protocol 1");
  }
  const auto kind = request.find("kind");
  if (kind == request.end() || !kind->is_string()) {
    reject("408", "request is malformed: \"kind\" must be a string (status, history, drain, park or ping)");
  }
  if (is_signed) {
    const auto time = request.find("time_ns");
    if (time == request.end() || !time->is_number_integer()) {
      reject("408", "request is malformed: a signed request needs \"time_ns\", the current time in ns");
    }
    switch (replay_.admit(signature, time->get<std::int64_t>(), now_ns)) {
      case detail::ReplayGuard::Verdict::fresh:
        break;
      case detail::ReplayGuard::Verdict::duplicate:
        reject("404", "duplicate signature: a signed request is accepted once; send a new id and time_ns");
      case detail::ReplayGuard::Verdict::stale:
      case detail::ReplayGuard::Verdict::future: {
        char window[32];
        std::snprintf(window, sizeof window, "%g", replay_window_s_);
        reject("405", std::string("request time is outside the replay window of ") + window +
                          " s: set \"time_ns\" to the current time (CLOCK_REALTIME, ns)");
      }
    }
  }

  const std::string& what = kind->get_ref<const std::string&>();
  if (what == "status") {
    out.kind = RequestKind::status;
  } else if (what == "history") {
    out.kind = RequestKind::history;
    if (const auto it = request.find("limit"); it != request.end() && !it->is_null()) {
      if (!it->is_number_integer() || it->get<std::int64_t>() < 0) {
        reject("408", "request is malformed: \"limit\" must be an integer >= 0");
      }
      out.limit = it->get<std::size_t>();
    }
  } else if (what == "ping") {
    out.kind = RequestKind::ping;
  } else if (what == "drain") {
    out.kind = RequestKind::drain;
    if (key_.empty()) {
      reject("413", "drain is disabled: this server has no key, and a drain must be signed; start it with a key");
    }
    if (!is_signed) {
      reject("414", "drain needs a signed request: sign it with HMAC-SHA256 under the key from the kernel's key file");
    }
    out.timeout_s = drain_timeout_s_;
    if (const auto it = request.find("timeout_s"); it != request.end() && !it->is_null()) {
      if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() < 0 ||
          it->get<double>() > max_drain_timeout_s_) {
        char limit[32];
        std::snprintf(limit, sizeof limit, "%g", max_drain_timeout_s_);
        reject("408", std::string("request is malformed: \"timeout_s\" must be a number of seconds from 0 to ") + limit);
      }
      out.timeout_s = it->get<double>();
    }
  } else if (what == "park") {
    out.kind = RequestKind::park;
    if (key_.empty()) {
      reject("418", "park is disabled: this server has no key, and a park step must be signed; start it with a key");
    }
    if (!is_signed) {
      reject("419", "park needs a signed request: sign it with HMAC-SHA256 under the key from the kernel's key file");
    }
    const auto step = request.find("step");
    static const char* const steps[] = {"begin", "parked", "failed", "resumed", "lost", "tracer"};
    if (step == request.end() || !step->is_string() ||
        std::find(std::begin(steps), std::end(steps), step->get_ref<const std::string&>()) == std::end(steps)) {
      reject("408", "request is malformed: a park request needs \"step\": begin, parked, failed, resumed, lost or tracer");
    }
    out.park_step = step->get<std::string>();
    if (out.park_step == "tracer") {
      const auto pid = request.find("pid");
      if (pid == request.end() || !pid->is_number_integer() || pid->get<std::int64_t>() < 1 ||
          pid->get<std::int64_t>() > 2147483647) {
        reject("408", "request is malformed: a park step tracer needs \"pid\": the helper's process id, 1 to 2^31-1");
      }
      out.tracer = pid->get<std::int64_t>();
    }
    if (const auto it = request.find("bytes"); it != request.end() && !it->is_null()) {
      if (!it->is_number_integer() || it->get<std::int64_t>() < 0) {
        reject("408", "request is malformed: \"bytes\" must be an integer >= 0 or null");
      }
      out.bytes = it->get<std::int64_t>();
    }
    if (const auto it = request.find("automatic"); it != request.end() && !it->is_null()) {
      if (!it->is_boolean()) reject("408", "request is malformed: \"automatic\" must be true or false");
      out.automatic = it->get<bool>();
    }
  } else {
    reject("410", "unknown request kind \"" + what + "\": use status, history, drain, park or ping");
  }
  out.is_signed = is_signed;
}

json error_reply(const json& id, const Rejection& rejection) {
  return json{{"ok", false},
              {"kind", "error"},
              {"id", id},
              {"error", {{"id", rejection.id}, {"message", "[" + rejection.id + "] " + rejection.message}}}};
}

std::string record_message(const json& kernel, std::string_view record_text, std::uint64_t seq, std::int64_t time_ns) {
  std::string message;
  message.reserve(record_text.size() + 160);
  message += "{\"kernel\":";
  message += dump_json(kernel);
  message += ",\"kind\":\"record\",\"protocol\":";
  message += dump_json(kStatusProtocol);
  message += ",\"record\":";
  message += record_text;
  message += ",\"seq\":";
  message += std::to_string(seq);
  message += ",\"time_ns\":";
  message += std::to_string(time_ns);
  message += '}';
  return message;
}

}  // namespace gpucleanup
