// The status server: a thread of its own with ZeroMQ sockets that answers
// status requests from native state, never from Python.
//
// It knows nothing of the driver: the snapshot and drain it serves come in as
// hooks, so the server is tested without any driver, and cleanup never
// depends on it.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace gpucleanup {

struct ServerConfig {
  std::string endpoint;        // "ipc:///dir/sock", "tcp://127.0.0.1:0", "inproc://name"
  std::string key;             // HMAC-SHA256 key; required for tcp://
  nlohmann::json kernel = nlohmann::json::object();  // echoed in replies
  std::size_t history_limit = 50;
  std::size_t max_request_bytes = 64 * 1024;
};

struct ServerHooks {
  std::function<nlohmann::json()> snapshot;              // live device snapshot
  std::function<nlohmann::json(double timeout_s)> drain; // native drain
};

class StatusServer {
 public:
  StatusServer(ServerConfig config, ServerHooks hooks);
  ~StatusServer();  // stops; never throws
  StatusServer(const StatusServer&) = delete;
  StatusServer& operator=(const StatusServer&) = delete;

  // Binds and starts the thread. Returns {"endpoint": ..., "pub_endpoint": ...}
  // with the endpoints actually bound. Throws gpucleanup::Error on failure.
  nlohmann::json start();
  // Stops the thread and closes the sockets. Idempotent.
  void stop() noexcept;

  void set_state(nlohmann::json state);
  void publish(nlohmann::json record);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gpucleanup
