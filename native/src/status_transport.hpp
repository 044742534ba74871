// The status server's transport: the ZeroMQ context and sockets (ROUTER for
// requests, PUB for records, a wake-up pipe, the ZAP handler), the peers of
// each listener (PeerGuard), and the loop of the server thread that reads them.
// It knows the protocol only as frames and signatures: what a request means is
// the handler's business.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include "peer_guard.hpp"
#include "server_config.hpp"

namespace gpucleanup {

class StatusTransport {
 public:
  // What the server thread's loop calls, all on that thread.
  struct Handlers {
    // Once a round, after the connections were read: records to send, a drain's answer.
    std::function<void()> between;
    // One request (routing id first) from connection `fd` (-1: unknown); returns whether it authenticated
    // (the peer spoke the protocol: its connection is not dropped as idle).
    std::function<bool(std::vector<zmq::message_t>& frames, int fd)> request;
    // The descriptor of a peer waiting for an answer (a drain), never dropped as idle; -1: none.
    std::function<int()> busy_fd;
    // A fault of the loop itself, counted as an error.
    std::function<void()> fault;
  };

  explicit StatusTransport(const ServerConfig& config);  // config outlives the transport
  StatusTransport(const StatusTransport&) = delete;
  StatusTransport& operator=(const StatusTransport&) = delete;

  // Binds the request and publish endpoints (checked first). Returns {"endpoint", "pub_endpoint"} as bound.
  // Throws gpucleanup::Error (server.501 to 505), with everything closed again.
  nlohmann::json open();
  // Closes every socket and removes the ipc socket files. Idempotent.
  void close() noexcept;

  // Serves until `stopping` (checked at each wake-up: set it, then wake()).
  void serve(const std::atomic<bool>& stopping, const Handlers& handlers);
  // Wakes the loop. Safe from any thread.
  void wake() noexcept;

  // A reply: the envelope, the signature, the body with "protocol" and "time_ns". Never blocks.
  void reply(const std::vector<std::string>& envelope, nlohmann::json body);
  // An answer went to connection `fd`: it is not idle (server thread).
  void touch(int fd);
  // Record messages on PUB, each signed. Never blocks: PUB drops for slow subscribers.
  void publish(const std::deque<std::string>& messages);

  const std::string& endpoint() const { return endpoint_; }
  const std::string& pub_endpoint() const { return pub_endpoint_; }
  // As StatusServer::connections(). Safe from any thread.
  nlohmann::json connections() const;

 private:
  std::string sign(const std::string& body) const;
  PeerGuard::Limits peer_limits(int busy_fd) const;
  void guard_connections(int busy_fd);
  std::vector<std::vector<zmq::message_t>> read_zap_requests();
  void answer_zap_requests(std::vector<std::vector<zmq::message_t>>& requests);
  std::chrono::milliseconds poll_timeout() const;

  const ServerConfig& config_;
  std::unique_ptr<zmq::context_t> own_context_;
  zmq::context_t* context_ = nullptr;
  zmq::socket_t router_;
  zmq::socket_t pub_;
  zmq::socket_t wake_rx_;
  // The ZAP handler (RFC 27) of the server's own context: every ZMTP handshake
  // waits for its answer, which the server thread gives only after it has read
  // the monitors. A connection refused at accept is shut down before its
  // handshake can finish, so its client keeps the request and sends it again
  // on the next connection instead of losing it.
  zmq::socket_t zap_;
  std::mutex wake_mutex_;
  zmq::socket_t wake_tx_;
  bool wake_open_ = false;
  std::string endpoint_;
  std::string pub_endpoint_;
  // Server thread only (and open/close, before and after it).
  PeerGuard router_peers_{true};
  PeerGuard pub_peers_{false};
  std::chrono::steady_clock::time_point next_tick_{};
  // Read from any thread (connections()).
  std::atomic<std::uint64_t> refused_connections_{0};
  std::atomic<std::uint64_t> dropped_idle_{0};
};

}  // namespace gpucleanup
