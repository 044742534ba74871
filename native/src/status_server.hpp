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
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "server_config.hpp"

namespace gpucleanup {

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

  // The kernel's state, a JSON object such as {"state": "running", "cell": 12,
  // "since_ns": ...}; replies add "age_s" from since_ns (or from this call).
  // Throws gpucleanup::Error (gpucleanup.server.507) if it is not an object.
  // While the kernel is parking or parked (park_step), a state of a cell
  // (idle, running, draining, waiting) does not replace the park: a cell that
  // starts finds it through park_state() and resumes the process first.
  void set_state(nlohmann::json state);
  // A cell's own state, twice per cell: {"state": "running", "cell": cell (null when < 0)} or {"state": "idle"},
  // since now; what set_state does for these, with no JSON object made until a reply reads the state. Returns
  // park_state() as it stands after it (a park in place keeps its state). Safe from any thread.
  int set_cell_state(bool running, std::int64_t cell) noexcept;

  // Parking moves the state idle -> parking ("begin") -> parked ("parked",
  // with the bytes moved to host memory) -> idle ("resumed"), or parking ->
  // idle ("failed"); "resumed" also ends a park that never finished. While
  // parking or parked no snapshot is taken: a driver call of the parked process
  // waits until it is restored (share/FACTS.md section 10). Returns the state
  // after the step; a step the state does not allow throws gpucleanup::Error
  // gpucleanup.server.509 with a sentence that says why. `then`, with
  // "resumed" only: the state to go to instead of idle, in the same step (the
  // kernel's own resume before a cell goes straight to running, so that no
  // park can begin between the two).
  nlohmann::json park_step(const std::string& step, std::optional<std::int64_t> bytes,
                           const nlohmann::json* then = nullptr);
  // 0: not parked; 1: parking; 2: parked. Safe from any thread.
  int park_state() const noexcept;
  // Why no automatic park may begin now ("" : it may): a park request's begin marked "automatic" is refused
  // (server.420) with this sentence, a park asked for by a person is not. Safe from any thread.
  void set_park_blocker(std::string why) noexcept;
  // The kernel's own work on a thread of its own (a release once the kernel is idle) begins (begin) or ends.
  // Begin: counted, and 0 returned, unless a park is under way: then its park_state() and nothing counted
  // (the work must not run: its driver calls would wait for the restore). Until every counted one has ended,
  // park_step("begin") is refused. End: always 0. Safe from any thread.
  // kind: 1 begin; 0 end; 2 the end of a request that ran the user's code outside a cell, which also starts
  // an idle kernel's idle time again (since_ns): activity, as for Jupyter's culling clock.
  int background(int kind) noexcept;
  // One finished cell's record: kept in the bounded history, sent on PUB.
  void publish(const nlohmann::json& record);
  // The same from its JSON text, which the caller has checked to be one JSON
  // object (the C ABI does): kept and sent as it is, parsed again only when a
  // status or history request asks for it, so a record costs the kernel no DOM.
  void publish_text(std::string record);

  bool running() const noexcept;

  // The connection counters, as the status reply's "connections" carries them:
  // {"max_peers", "peers", "pub_peers", "refused_connections", "dropped_idle",
  // "peer_idle_timeout_s"}. Safe from any thread.
  nlohmann::json connections() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gpucleanup
