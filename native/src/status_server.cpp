#include "status_server.hpp"
#include "thread_hold.hpp"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <zmq.hpp>

#include "errors.hpp"
#include "kernel_state.hpp"
#include "record_log.hpp"
#include "status_endpoint.hpp"
#include "status_jobs.hpp"
#include "status_protocol.hpp"
#include "status_transport.hpp"

// The server is an owner wiring four parts, each over its own data: the
// transport (sockets and peers, the server thread's loop), the kernel's state
// with the park state machine, the cells' records, and the jobs (snapshot and
// drain hooks on a worker). What a request means is decided here.
namespace gpucleanup {
namespace {

using json = nlohmann::json;

// Records come from Python and may carry anything; invalid UTF-8 must not
// turn a reply into an exception.
std::string dump(const json& value) { return dump_json(value); }

}  // namespace

ServerConfig server_config_from_json(const json& config) {
  if (!config.is_object()) {
    GPUCLEANUP_FAIL("gpucleanup.server.506", "server config must be a JSON object with at least \"endpoint\"");
  }
  ServerConfig out;
  auto field = [&](const char* name, auto& target, auto check, const char* expected) {
    const auto it = config.find(name);
    if (it == config.end() || it->is_null()) return;
    if (!check(*it)) {
      GPUCLEANUP_FAIL("gpucleanup.server.506",
                      std::string("server config \"") + name + "\" must be " + expected + ", got " + dump(*it));
    }
    it->get_to(target);
  };
  const auto is_string = [](const json& v) { return v.is_string(); };
  const auto is_count = [](const json& v) { return v.is_number_integer() && v.get<std::int64_t>() >= 0; };
  const auto is_seconds = [](const json& v) {
    return v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= 0;
  };
  field("endpoint", out.endpoint, is_string, "a string");
  field("pub_endpoint", out.pub_endpoint, is_string, "a string");
  field("key", out.key, is_string, "a string");
  field("history_limit", out.history_limit, is_count, "an integer >= 0");
  field("max_request_bytes", out.max_request_bytes, is_count, "an integer >= 0");
  field("require_signature", out.require_signature, [](const json& v) { return v.is_boolean(); }, "true or false");
  field("replay_window_s", out.replay_window_s, is_seconds, "a number of seconds >= 0");
  field("snapshot_timeout_s", out.snapshot_timeout_s, is_seconds, "a number of seconds >= 0");
  field("drain_timeout_s", out.drain_timeout_s, is_seconds, "a number of seconds >= 0");
  field("max_drain_timeout_s", out.max_drain_timeout_s, is_seconds, "a number of seconds >= 0");
  field("max_peers", out.max_peers, [](const json& v) { return v.is_number_integer() && v.get<std::int64_t>() >= 1; },
        "an integer >= 1");
  field("peer_idle_timeout_s", out.peer_idle_timeout_s, is_seconds, "a number of seconds >= 0");
  field("peer_grace_s", out.peer_grace_s, is_seconds, "a number of seconds >= 0");
  field("handshake_timeout_s", out.handshake_timeout_s, is_seconds, "a number of seconds >= 0");
  field("heartbeat_interval_s", out.heartbeat_interval_s, is_seconds, "a number of seconds >= 0");
  if (const auto it = config.find("kernel"); it != config.end() && !it->is_null()) out.kernel = *it;
  if (out.endpoint.empty()) {
    GPUCLEANUP_FAIL("gpucleanup.server.506", "server config needs \"endpoint\": ipc:///dir/socket or tcp://127.0.0.1:0");
  }
  return out;
}

struct StatusServer::Impl {
  // A drain request accepted and not yet answered (server thread only).
  struct PendingDrain {
    std::vector<std::string> envelope;
    json id;
    double timeout_s = 0;
    int fd = -1;  // kept connected until answered
  };

  Impl(ServerConfig c, ServerHooks h)
      : config(with_signature_rule(std::move(c))),
        transport(config),
        kernel(),
        records(config.history_limit, config.kernel, scheme_of(config.endpoint) == "tcp"),
        jobs(std::move(h), config.snapshot_timeout_s),
        check(config) {}

  static ServerConfig with_signature_rule(ServerConfig c) {
    c.require_signature = signature_required(c);
    return c;
  }

  const ServerConfig config;
  StatusTransport transport;
  KernelState kernel;
  RecordLog records;
  StatusJobs jobs;

  std::mutex lifecycle;  // start and stop
  bool started = false;
  pid_t owner_pid = 0;
  std::atomic<bool> stopping{false};
  std::thread thread;

  // Server thread only.
  std::optional<PendingDrain> pending_drain;
  RequestCheck check;  // keeps the signatures seen (replay)
  std::int64_t started_ns = 0;
  std::uint64_t requests = 0;
  std::uint64_t errors = 0;

  void send_error(const std::vector<std::string>& envelope, const json& id, const Rejection& rejection) {
    ++errors;
    transport.reply(envelope, error_reply(id, rejection));
  }

  json status_reply(bool is_signed) {
    const std::int64_t now = realtime_ns();
    json reply{{"ok", true}, {"kind", "status"}, {"kernel", config.kernel}, {"state", kernel.view(now)}};
    const bool draining = jobs.drain_running();
    const RecordLog::Summary logged = records.summary();
    reply["last_record"] = logged.last ? json::parse(*logged.last) : json(nullptr);
    reply["server"] = {{"pid", static_cast<long long>(getpid())},
                       {"endpoint", transport.endpoint()},
                       {"pub_endpoint", transport.pub_endpoint()},
                       {"started_ns", started_ns},
                       {"uptime_s", static_cast<double>(now - started_ns) / 1e9},
                       {"requests", requests},
                       {"errors", errors},
                       {"records", logged.published},
                       {"history_size", logged.size},
                       {"history_limit", config.history_limit},
                       {"require_signature", config.require_signature},
                       {"drain_enabled", !config.key.empty()},
                       {"drain_running", draining},
                       {"request_signed", is_signed}};
    reply["connections"] = transport.connections();
    jobs.add_snapshot(reply);
    return reply;
  }

  json history_reply(std::optional<std::size_t> requested) {
    const std::size_t limit = std::min<std::size_t>(config.history_limit, requested.value_or(config.history_limit));
    std::uint64_t published = 0;
    json kept = records.records(limit, published);
    return json{{"ok", true},
                {"kind", "history"},
                {"kernel", config.kernel},
                {"records", std::move(kept)},
                {"history_limit", config.history_limit},
                {"records_total", published}};
  }

  // A drain request that passed the check (signed, under a key, timeout_s in bounds).
  void accept_drain(const std::vector<std::string>& envelope, const json& id, double timeout_s, int fd) {
    // Under the state's lock, then the jobs': the order a park takes them, so a park and a drain never both start.
    kernel.with_state_name([&](const std::string& state_name, bool outside_drain) {
      if (outside_drain) {
        // An earlier drain answered while the kernel's own cleanup goes on (its finalizers may take any time).
        reject("412", "drain refused: an earlier drain from outside is still running the kernel's own cleanup "
                      "(garbage collection, where objects' finalizers run, or the frameworks' caches); it ends by "
                      "itself: ask again when the kernel is idle");
      }
      if (state_name != "idle") {
        reject("411", "drain refused: the kernel is " + state_name + "; a drain runs only between cells (state idle)");
      }
      if (!jobs.start_drain(timeout_s)) {
        reject("412", "drain refused: another drain is still running; ask again when it has answered");
      }
    });
    pending_drain = PendingDrain{envelope, id, timeout_s, fd};
  }

  void finish_drain() {
    std::optional<json> result = jobs.take_drain_result();
    if (!result || !pending_drain) return;
    const PendingDrain pending = std::move(*pending_drain);
    pending_drain.reset();
    transport.touch(pending.fd);
    if (result->contains("error")) {
      send_error(pending.envelope, pending.id,
                 Rejection{"gpucleanup.server.417", "drain failed: " + (*result)["error"].get<std::string>()});
      return;
    }
    transport.reply(pending.envelope, json{{"ok", true},
                                           {"kind", "drain"},
                                           {"id", pending.id},
                                           {"kernel", config.kernel},
                                           {"timeout_s", pending.timeout_s},
                                           {"result", std::move((*result)["result"])}});
  }

  // One request; whether it authenticated.
  bool handle(std::vector<zmq::message_t>& frames, int fd) {
    ++requests;
    std::vector<std::string_view> views;
    views.reserve(frames.size());
    for (const auto& frame : frames) views.emplace_back(static_cast<const char*>(frame.data()), frame.size());
    const CheckedRequest request = check.check(views, realtime_ns());
    std::vector<std::string> envelope;
    for (std::size_t i = 0; i < request.envelope && i < frames.size(); ++i) envelope.emplace_back(frames[i].to_string());
    try {
      if (request.rejection) throw *request.rejection;
      json reply;
      switch (request.kind) {
        case RequestKind::status:
          reply = status_reply(request.is_signed);
          break;
        case RequestKind::history:
          reply = history_reply(request.limit);
          break;
        case RequestKind::ping:
          reply = json{{"ok", true}, {"kind", "ping"}, {"kernel", config.kernel}};
          break;
        case RequestKind::drain:
          accept_drain(envelope, request.id, request.timeout_s, fd);
          return request.authenticated;  // answered when the hook is done
        case RequestKind::park: {
          if (request.park_step == "tracer") {
            // A resume's helper holds the kernel's threads during the restore (thread_hold.hpp): only while the
            // kernel is parking or parked, and only the helper the signed request names.
            if (kernel.park_state() == 0) {
              reject("420", "park step tracer refused: the kernel is not parked, so there is no restore to hold it for");
            }
            reply = json{{"ok", true}, {"kind", "park"}, {"kernel", config.kernel}, {"step", "tracer"},
                         {"errno", allow_tracer(static_cast<pid_t>(request.tracer))}, {"state", kernel.view(realtime_ns())}};
            break;
          }
          json after;
          if (auto refused = kernel.park(request.park_step, request.bytes, after, nullptr, request.automatic,
                                         [this] { return jobs.drain_running(); })) {
            reject(refused->passing ? "421" : "420", std::move(refused->message));
          }
          reply = json{{"ok", true}, {"kind", "park"}, {"kernel", config.kernel}, {"step", request.park_step},
                       {"state", std::move(after)}};
          break;
        }
      }
      reply["id"] = request.id;
      transport.reply(envelope, std::move(reply));
    } catch (const Rejection& rejection) {
      send_error(envelope, request.id, rejection);
    }
    return request.authenticated;
  }

  void serve() {
    const StatusTransport::Handlers handlers{
        [this] {
          transport.publish(records.take_outbox());
          finish_drain();
        },
        [this](std::vector<zmq::message_t>& frames, int fd) { return handle(frames, fd); },
        [this] { return pending_drain ? pending_drain->fd : -1; },
        [this] { ++errors; }};
    transport.serve(stopping, handlers);
    try {
      if (pending_drain) {
        send_error(pending_drain->envelope, pending_drain->id,
                   Rejection{"gpucleanup.server.416", "the server stopped before the drain finished"});
        pending_drain.reset();
      }
    } catch (...) {
    }
  }
};

StatusServer::StatusServer(ServerConfig config, ServerHooks hooks)
    : impl_(std::make_unique<Impl>(std::move(config), std::move(hooks))) {}

StatusServer::~StatusServer() { stop(); }

nlohmann::json StatusServer::start() {
  if (!impl_) GPUCLEANUP_FAIL("gpucleanup.server.509", "this status server was abandoned by fork(): make a new one");
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lifecycle(s.lifecycle);
  if (s.started) GPUCLEANUP_FAIL("gpucleanup.server.509", "the status server is already running: stop it first");
  json bound = s.transport.open();
  s.stopping = false;
  s.started_ns = realtime_ns();
  s.requests = s.errors = 0;
  s.check = RequestCheck(s.config);
  s.owner_pid = getpid();
  s.jobs.start([&s] { return s.kernel.park_state() != 0; }, [&s] { s.transport.wake(); });
  s.thread = std::thread([&s] {
    // named, so that the park's hold while parked leaves it running (gpucleanup.park.threads)
    pthread_setname_np(pthread_self(), "gpucleanup-srv");
    s.serve();
  });
  s.started = true;
  return bound;
}

void StatusServer::stop() noexcept {
  if (!impl_) return;
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lifecycle(s.lifecycle);
  if (!s.started) return;
  if (getpid() != s.owner_pid) {
    // A forked child has the memory but not the threads: joining them would
    // hang and libzmq's context is unusable here. Leave all of it alone.
    (void)impl_.release();
    return;
  }
  s.stopping = true;
  s.transport.wake();
  if (s.thread.joinable()) s.thread.join();
  s.jobs.stop();
  s.transport.close();
  s.started = false;
}

void StatusServer::set_state(nlohmann::json state) {
  if (!state.is_object()) {
    GPUCLEANUP_FAIL("gpucleanup.server.507", "state must be a JSON object such as {\"state\": \"idle\"}, got " + dump(state));
  }
  if (!impl_) return;
  impl_->kernel.set(std::move(state));
}

int StatusServer::set_cell_state(bool running, std::int64_t cell) noexcept {
  return impl_ ? impl_->kernel.set_cell(running, cell) : 0;
}

nlohmann::json StatusServer::park_step(const std::string& step, std::optional<std::int64_t> bytes,
                                       const nlohmann::json* then) {
  if (!impl_) GPUCLEANUP_FAIL("gpucleanup.server.509", "park step refused: the status server is not running");
  if (then != nullptr && (step != "resumed" || !then->is_object())) {
    GPUCLEANUP_FAIL("gpucleanup.server.509", "park step refused: only \"resumed\" takes the state to go to, an object");
  }
  nlohmann::json after;
  Impl& s = *impl_;
  if (auto refused = s.kernel.park(step, bytes, after, then, false, [&s] { return s.jobs.drain_running(); })) {
    GPUCLEANUP_FAIL(refused->passing ? "gpucleanup.server.510" : "gpucleanup.server.509", refused->message);
  }
  return after;
}

int StatusServer::background(int kind) noexcept { return impl_ ? impl_->kernel.background(kind) : 0; }

void StatusServer::set_park_blocker(std::string why) noexcept {
  if (impl_) impl_->kernel.set_park_blocker(std::move(why));
}

int StatusServer::park_state() const noexcept { return impl_ ? impl_->kernel.park_state() : 0; }

void StatusServer::publish(const nlohmann::json& record) {
  if (!record.is_object()) {
    GPUCLEANUP_FAIL("gpucleanup.server.508", "a cell record must be a JSON object, got " + dump(record));
  }
  publish_text(dump(record));
}

void StatusServer::publish_text(std::string record) {
  if (!impl_) return;
  impl_->records.publish(std::move(record));
  impl_->transport.wake();
}

nlohmann::json StatusServer::connections() const {
  if (!impl_) return json{{"max_peers", 0}, {"peers", 0}, {"pub_peers", 0}, {"refused_connections", 0},
                          {"dropped_idle", 0}, {"peer_idle_timeout_s", 0}};
  return impl_->transport.connections();
}

bool StatusServer::running() const noexcept {
  if (!impl_) return false;
  std::lock_guard<std::mutex> lifecycle(impl_->lifecycle);
  return impl_->started;
}

}  // namespace gpucleanup
