// The status server's configuration and its hooks: what the server's parts
// (endpoint checks, transport, protocol checks, jobs) take from their owner,
// in a header of their own so that none of them includes status_server.hpp.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

namespace zmq {
class context_t;
}

namespace gpucleanup {

struct ServerConfig {
  std::string endpoint;        // "ipc:///dir/sock", "tcp://127.0.0.1:0", "inproc://name"
  std::string key;             // HMAC-SHA256 key; required for tcp://
  nlohmann::json kernel = nlohmann::json::object();  // echoed in replies
  std::size_t history_limit = 50;
  std::size_t max_request_bytes = 64 * 1024;

  // Where records are published; "" derives it from `endpoint` (ipc: "<path>.pub",
  // tcp: same host on a free port, inproc: "<name>-pub").
  std::string pub_endpoint;
  // Every request must be signed. Always true for tcp://; drain requests need
  // a signature whatever this says.
  bool require_signature = false;
  // Signed requests older (or further ahead) than this are refused; their
  // signatures are remembered this long, at most replay_capacity of them.
  double replay_window_s = 60.0;
  std::size_t replay_capacity = 65536;
  // A status reply waits at most this long for the snapshot hook, then answers
  // with the last snapshot it has, marked stale.
  double snapshot_timeout_s = 0.25;
  // Bounds and default of a drain request's "timeout_s".
  double drain_timeout_s = 10.0;
  double max_drain_timeout_s = 60.0;
  // Connection limits (tcp:// and ipc://; inproc:// holds no descriptors).
  // Each of the two sockets (requests, records) keeps at most this many peers
  // connected, and never more than 1/8 of RLIMIT_NOFILE's soft limit, so that
  // both together stay under a quarter of the process's descriptors. At the
  // cap, a new request peer takes the slot of the peer idle longest if that
  // one has been idle for peer_grace_s; otherwise, and always on the records
  // socket, the new peer is refused (its connection closed at once).
  std::size_t max_peers = 64;
  // A request peer without an authenticated request for this long is dropped
  // (0: never). Watchers on the records socket stay while they answer heartbeats.
  double peer_idle_timeout_s = 10.0;
  double peer_grace_s = 1.0;
  // The ZMTP handshake must finish within this (0: no limit).
  double handshake_timeout_s = 2.0;
  // ZMTP heartbeats: a PING this often; a peer silent for 3 intervals is
  // dropped (0: no heartbeats).
  double heartbeat_interval_s = 2.0;
  // A libzmq context to share (inproc:// clients need the server's context);
  // nullptr: the server owns one.
  zmq::context_t* context = nullptr;
};

// The config of gpucleanup_server_start's JSON: endpoint, key, kernel,
// history_limit, and optionally pub_endpoint, require_signature,
// max_request_bytes, replay_window_s, snapshot_timeout_s, drain_timeout_s,
// max_peers, peer_idle_timeout_s, peer_grace_s, handshake_timeout_s,
// heartbeat_interval_s.
// Throws gpucleanup::Error (gpucleanup.server.506) on a wrong type.
ServerConfig server_config_from_json(const nlohmann::json& config);

struct ServerHooks {
  std::function<nlohmann::json()> snapshot;              // live device snapshot
  std::function<nlohmann::json(double timeout_s)> drain; // native drain
};

}  // namespace gpucleanup
