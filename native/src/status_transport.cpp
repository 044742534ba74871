#include "status_transport.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <iterator>
#include <string_view>

#include <zmq_addon.hpp>

#include "detail/hmac.hpp"
#include "errors.hpp"
#include "kernel_state.hpp"
#include "status_endpoint.hpp"
#include "status_protocol.hpp"

namespace gpucleanup {
namespace {

using json = nlohmann::json;
using steady = std::chrono::steady_clock;

steady::duration to_duration(double seconds) {
  return std::chrono::duration_cast<steady::duration>(std::chrono::duration<double>(std::min(seconds, 1e6)));
}

int milliseconds_option(double value_s) {
  return static_cast<int>(std::min(value_s * 1000.0, 3600.0 * 1000.0));
}

}  // namespace

StatusTransport::StatusTransport(const ServerConfig& config) : config_(config) {}

json StatusTransport::open() {
  check_endpoints(config_);
  if (config_.endpoint.empty()) GPUCLEANUP_FAIL("gpucleanup.server.501", "the status server needs an endpoint");
  try {
    if (config_.context != nullptr) {
      context_ = config_.context;
    } else {
      own_context_ = std::make_unique<zmq::context_t>(1);
      context_ = own_context_.get();
    }
    const auto frame_limit = static_cast<std::int64_t>(std::min<std::size_t>(
        std::max<std::size_t>(std::size_t{1} << 20, 16 * config_.max_request_bytes), std::size_t{1} << 30));
    // A shared context may have its own ZAP handler: then handshakes go
    // without this one (refusals still hold, only a lost request is possible).
    bool zap_bound = false;
    if (config_.context == nullptr) {
      zap_ = zmq::socket_t(*context_, zmq::socket_type::router);
      zap_.set(zmq::sockopt::linger, 0);
      zap_.bind("inproc://zeromq.zap.01");
      zap_bound = true;
    }
    static std::atomic<std::uint64_t> generation{0};
    const std::string tag = std::to_string(reinterpret_cast<std::uintptr_t>(this)) + "-" + std::to_string(++generation);
    auto bind = [&](zmq::socket_t& socket, PeerGuard& peers, const std::string& where, const char* name) {
      socket.set(zmq::sockopt::linger, 0);
      if (scheme_of(where) == "tcp" && tcp_host(where).front() == '[') socket.set(zmq::sockopt::ipv6, 1);
      // A peer gets this long to finish the ZMTP handshake (raw connections
      // that never speak are closed), and must answer heartbeats to stay.
      socket.set(zmq::sockopt::handshake_ivl, milliseconds_option(config_.handshake_timeout_s));
      if (config_.heartbeat_interval_s > 0) {
        socket.set(zmq::sockopt::heartbeat_ivl, std::max(1, milliseconds_option(config_.heartbeat_interval_s)));
        socket.set(zmq::sockopt::heartbeat_timeout, std::max(3, milliseconds_option(3 * config_.heartbeat_interval_s)));
      }
      const std::string scheme = scheme_of(where);
      if (scheme == "tcp" || scheme == "ipc") {
        peers.attach(*context_, socket, "inproc://gpucleanup-status-monitor-" + tag + "-" + name);
        if (zap_bound) socket.set(zmq::sockopt::zap_domain, "gpucleanup-status");
      }
      try {
        socket.bind(where);
      } catch (const zmq::error_t& error) {
        GPUCLEANUP_FAIL("gpucleanup.server.505", "cannot bind " + where + ": " + error.what() +
                                                     " (is the path too long for a socket, or the name taken?)");
      }
      std::string bound = socket.get(zmq::sockopt::last_endpoint);
      restrict_ipc_socket(bound);
      peers.listen(bound);
      return bound;
    };
    router_ = zmq::socket_t(*context_, zmq::socket_type::router);
    // Beyond this a peer is disconnected without a reply: a memory bound, far
    // above max_request_bytes, which gets its own error reply.
    router_.set(zmq::sockopt::maxmsgsize, frame_limit);
    endpoint_ = bind(router_, router_peers_, config_.endpoint, "router");
    pub_ = zmq::socket_t(*context_, zmq::socket_type::pub);
    pub_endpoint_ = bind(pub_, pub_peers_,
                         config_.pub_endpoint.empty() ? derive_pub_endpoint(config_.endpoint) : config_.pub_endpoint,
                         "pub");
    const std::string wake = "inproc://gpucleanup-status-wake-" + std::to_string(reinterpret_cast<std::uintptr_t>(this));
    wake_rx_ = zmq::socket_t(*context_, zmq::socket_type::pair);
    wake_rx_.set(zmq::sockopt::linger, 0);
    wake_rx_.bind(wake);
    {
      std::lock_guard<std::mutex> lock(wake_mutex_);
      wake_tx_ = zmq::socket_t(*context_, zmq::socket_type::pair);
      wake_tx_.set(zmq::sockopt::linger, 0);
      wake_tx_.connect(wake);
      wake_open_ = true;
    }
  } catch (const Error&) {
    close();
    throw;
  } catch (const std::exception& e) {
    close();
    GPUCLEANUP_FAIL("gpucleanup.server.505", std::string("cannot start the status server: ") + e.what());
  }
  refused_connections_ = 0;
  dropped_idle_ = 0;
  next_tick_ = steady::now();
  return json{{"endpoint", endpoint_}, {"pub_endpoint", pub_endpoint_}};
}

void StatusTransport::close() noexcept {
  // libzmq leaves the socket files of a closed listener behind.
  remove_ipc_socket(endpoint_);
  remove_ipc_socket(pub_endpoint_);
  endpoint_.clear();
  pub_endpoint_.clear();
  {
    std::lock_guard<std::mutex> lock(wake_mutex_);
    wake_open_ = false;
    wake_tx_.close();
  }
  for (zmq::socket_t* socket : {&router_, &pub_}) {
    if (socket->handle() != nullptr) (void)zmq_socket_monitor(socket->handle(), nullptr, 0);
  }
  router_peers_.close();
  pub_peers_.close();
  router_.close();
  pub_.close();
  zap_.close();
  wake_rx_.close();
  own_context_.reset();
  context_ = nullptr;
}

json StatusTransport::connections() const {
  return json{{"max_peers", peer_cap(config_.max_peers)},
              {"peers", router_peers_.live()},
              {"pub_peers", pub_peers_.live()},
              {"refused_connections", refused_connections_.load()},
              {"dropped_idle", dropped_idle_.load()},
              {"peer_idle_timeout_s", config_.peer_idle_timeout_s}};
}

PeerGuard::Limits StatusTransport::peer_limits(int busy_fd) const {
  PeerGuard::Limits limits;
  limits.cap = peer_cap(config_.max_peers);
  limits.grace = to_duration(config_.peer_grace_s);
  limits.idle_timeout = to_duration(config_.peer_idle_timeout_s);
  limits.busy_fd = busy_fd;
  return limits;
}

// The monitors' news, then (every 250 ms while there are peers) the idle.
void StatusTransport::guard_connections(int busy_fd) {
  const auto now = steady::now();
  const PeerGuard::Limits limits = peer_limits(busy_fd);
  std::uint64_t refused = 0;
  std::uint64_t dropped = 0;
  for (PeerGuard* guard : {&router_peers_, &pub_peers_}) {
    if (guard->active()) refused += guard->read_events(now, limits);
  }
  if (now >= next_tick_) {
    next_tick_ = now + std::chrono::milliseconds(250);
    for (PeerGuard* guard : {&router_peers_, &pub_peers_}) {
      if (guard->active()) dropped += guard->tick(now, limits, refused);
    }
  }
  if (refused != 0) refused_connections_ += refused;
  if (dropped != 0) dropped_idle_ += dropped;
}

std::vector<std::vector<zmq::message_t>> StatusTransport::read_zap_requests() {
  std::vector<std::vector<zmq::message_t>> requests;
  if (zap_.handle() == nullptr) return requests;
  // Bounded like the monitor: what is left waits for the next round.
  for (int i = 0; i < PeerGuard::kMonitorQueue; ++i) {
    std::vector<zmq::message_t> frames;
    if (!zmq::recv_multipart(zap_, std::back_inserter(frames), zmq::recv_flags::dontwait)) break;
    requests.push_back(std::move(frames));
  }
  return requests;
}

// [routing id, "", "1.0", request id, domain, address, identity, mechanism,
// credentials...] -> [routing id, "", "1.0", request id, "200", "OK", user
// id, metadata]. Every handshake is let through: the connections refused
// were shut down before this answer, and their handshake fails on that.
void StatusTransport::answer_zap_requests(std::vector<std::vector<zmq::message_t>>& requests) {
  for (auto& frames : requests) {
    if (frames.size() < 4 || frames[1].size() != 0) continue;
    std::array<zmq::const_buffer, 8> reply{zmq::const_buffer(frames[0].data(), frames[0].size()),
                                           zmq::const_buffer("", 0),
                                           zmq::buffer(std::string_view("1.0")),
                                           zmq::const_buffer(frames[3].data(), frames[3].size()),
                                           zmq::buffer(std::string_view("200")),
                                           zmq::buffer(std::string_view("OK")),
                                           zmq::const_buffer("", 0),
                                           zmq::const_buffer("", 0)};
    (void)zmq::send_multipart(zap_, reply, zmq::send_flags::dontwait);
  }
}

std::chrono::milliseconds StatusTransport::poll_timeout() const {
  if (!router_peers_.tracking() && !pub_peers_.tracking()) return std::chrono::milliseconds(-1);
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(next_tick_ - steady::now());
  return std::clamp(left + std::chrono::milliseconds(1), std::chrono::milliseconds(1), std::chrono::milliseconds(250));
}

void StatusTransport::wake() noexcept {
  std::lock_guard<std::mutex> lock(wake_mutex_);
  if (!wake_open_) return;
  try {
    // A full pipe already holds a wake-up: EAGAIN is fine.
    (void)wake_tx_.send(zmq::const_buffer("w", 1), zmq::send_flags::dontwait);
  } catch (...) {
  }
}

std::string StatusTransport::sign(const std::string& body) const {
  return config_.key.empty() ? std::string() : detail::hmac_sha256_hex(config_.key, body);
}

void StatusTransport::reply(const std::vector<std::string>& envelope, json body) {
  body["protocol"] = kStatusProtocol;
  body["time_ns"] = realtime_ns();
  const std::string text = dump_json(body);
  std::vector<zmq::const_buffer> frames;
  for (const auto& frame : envelope) frames.emplace_back(frame.data(), frame.size());
  const std::string signature = sign(text);
  frames.emplace_back(signature.data(), signature.size());
  frames.emplace_back(text.data(), text.size());
  // A client that went away takes its reply with it; never block here.
  (void)zmq::send_multipart(router_, frames, zmq::send_flags::dontwait);
}

void StatusTransport::touch(int fd) { router_peers_.touch(fd, steady::now()); }

void StatusTransport::publish(const std::deque<std::string>& messages) {
  for (const auto& body : messages) {
    const std::string signature = sign(body);
    std::array<zmq::const_buffer, 3> frames{zmq::buffer(std::string_view("record")),
                                            zmq::const_buffer(signature.data(), signature.size()),
                                            zmq::const_buffer(body.data(), body.size())};
    (void)zmq::send_multipart(pub_, frames, zmq::send_flags::dontwait);
  }
}

void StatusTransport::serve(const std::atomic<bool>& stopping, const Handlers& handlers) {
  std::vector<zmq::pollitem_t> items{{router_.handle(), 0, ZMQ_POLLIN, 0}, {wake_rx_.handle(), 0, ZMQ_POLLIN, 0}};
  for (PeerGuard* guard : {&router_peers_, &pub_peers_}) {
    if (guard->active()) items.push_back({guard->monitor_handle(), 0, ZMQ_POLLIN, 0});
  }
  if (zap_.handle() != nullptr) items.push_back({zap_.handle(), 0, ZMQ_POLLIN, 0});
  while (!stopping.load()) {
    try {
      zmq::poll(items.data(), items.size(), poll_timeout());
      if (items[1].revents & ZMQ_POLLIN) {
        zmq::message_t ignored;
        while (wake_rx_.recv(ignored, zmq::recv_flags::dontwait)) {
        }
      }
      if (stopping.load()) break;
      // The handshakes waiting, then the connections they belong to.
      std::vector<std::vector<zmq::message_t>> handshakes = read_zap_requests();
      // Before the requests, so that a request's connection is known.
      guard_connections(handlers.busy_fd());
      answer_zap_requests(handshakes);
      handlers.between();
      if (items[0].revents & ZMQ_POLLIN) {
        // Bounded, so a flood of requests cannot starve the outbox.
        for (int i = 0; i < 256; ++i) {
          std::vector<zmq::message_t> frames;
          if (!zmq::recv_multipart(router_, std::back_inserter(frames), zmq::recv_flags::dontwait)) break;
          // ZMQ_SRCFD: the connection the message came in on (libzmq 4.3 still sets it).
          const int fd = frames.empty() ? -1 : zmq_msg_get(frames.back().handle(), ZMQ_SRCFD);
          if (handlers.request(frames, fd) && fd >= 0) touch(fd);
        }
      }
    } catch (const zmq::error_t& error) {
      if (error.num() == ETERM) break;
      if (error.num() != EINTR) handlers.fault();
    } catch (...) {
      handlers.fault();
    }
  }
}

}  // namespace gpucleanup
