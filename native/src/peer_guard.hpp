// The connections accepted by one listening socket (tcp or ipc), followed
// through a libzmq socket monitor: ZMQ_EVENT_ACCEPTED carries the new
// connection's descriptor, ZMQ_EVENT_DISCONNECTED its end. libzmq keeps a
// connected peer that sends nothing for ever and has no call to drop one peer
// of a bound socket; shutdown(2) on the descriptor makes libzmq's engine read
// end-of-file and close the connection its usual way (and report it
// disconnected). A descriptor is only ever shut down after checking that it is
// still the socket seen at accept (same inode) and a connection accepted on
// this listener (same local address), so a number the process reused
// meanwhile is never touched.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>

#include <zmq.hpp>

namespace gpucleanup {

// Peers per socket: max_peers, and never more than an eighth of the
// descriptors the process may open, so that the two sockets together hold at
// most a quarter of them (read at every accept: the process may change it).
std::size_t peer_cap(std::size_t max_peers);

class PeerGuard {
 public:
  using clock = std::chrono::steady_clock;

  // Events waiting beyond this are dropped by libzmq (a memory bound under a
  // flood); rescan() finds what a lost event would have said.
  static constexpr int kMonitorQueue = 4096;
  static constexpr std::size_t kRescanAfterEvents = 1000;

  struct Limits {
    std::size_t cap = 1;
    clock::duration grace{};
    clock::duration idle_timeout{};  // zero: never
    int busy_fd = -1;                // a peer waiting for an answer (drain)
  };

  // requests: the request socket (its peers are dropped when idle); else the records socket.
  explicit PeerGuard(bool requests) : requests_(requests) {}

  // Before bind, so that no connection is missed.
  void attach(zmq::context_t& context, zmq::socket_t& socket, const std::string& name);
  // After bind: the listener's address, as accepted connections report it locally.
  void listen(const std::string& bound);

  bool active() const { return monitor_.handle() != nullptr && family_ != AF_UNSPEC; }
  void* monitor_handle() { return monitor_.handle(); }
  bool tracking() const { return !peers_.empty() || events_since_scan_ >= kRescanAfterEvents; }
  // Peers connected and not shut down. Safe from any thread.
  std::size_t live() const { return live_.load(); }

  // Reads the monitor's events; returns how many connections were refused.
  std::uint64_t read_events(clock::time_point now, const Limits& limits);
  // An authenticated request came from this descriptor.
  void touch(int fd, clock::time_point now);
  // Drops request peers idle past the timeout, forgets connections whose end
  // was not reported, and after a burst of events (some may have been lost)
  // looks for connections it has not seen. Returns how many were dropped idle.
  std::uint64_t tick(clock::time_point now, const Limits& limits, std::uint64_t& refused);
  void close() noexcept;

 private:
  struct Peer {
    ino_t inode = 0;
    clock::time_point active{};  // accepted, or the last authenticated request
    bool closing = false;        // shut down here; libzmq closes it
    clock::time_point closing_since{};
    bool uid_known = false;  // asked only when the records socket is full (tcp_peer_uid reads a table)
    std::optional<uid_t> uid;
  };

  ino_t accepted_here(int fd) const;
  void close_peer(int fd, Peer& peer);
  std::uint64_t admit(int fd, clock::time_point now, const Limits& limits);
  void forget(int fd);
  std::uint64_t rescan(clock::time_point now, const Limits& limits);

  bool requests_;
  zmq::socket_t monitor_;
  int family_ = AF_UNSPEC;
  std::uint16_t port_ = 0;
  in_addr addr4_{};
  in6_addr addr6_{};
  std::string path_;
  std::unordered_map<int, Peer> peers_;
  std::atomic<std::size_t> live_{0};
  std::size_t events_since_scan_ = 0;
};

}  // namespace gpucleanup
