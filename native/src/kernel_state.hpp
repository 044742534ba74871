// The kernel's state as the status server reports it, and the park state
// machine over it: idle -> parking ("begin") -> parked ("parked") -> idle
// ("resumed"), or parking -> idle ("failed"). One lock; every method is safe
// from any thread. It knows no socket and no job: whether a drain runs is
// asked through a function, under this lock (a park and a drain never both
// begin: each takes this lock, then the jobs').
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace gpucleanup {

// CLOCK_REALTIME in nanoseconds, the clock of every "*_ns" the server reports.
std::int64_t realtime_ns();

// Why a park step was refused. `passing`: only for a moment (a drain, or the
// kernel's own release on a thread, is under way): the caller may ask again
// at once (server.421 on the socket, server.510 in the process), where every
// other refusal (server.420, server.509) stands until the state changes.
struct ParkRefusal {
  bool passing;
  std::string message;
};

class KernelState {
 public:
  KernelState();  // "unknown", since now

  // As StatusServer::set_state (the object already checked): ignored while a park is in place.
  void set(nlohmann::json state);
  // As StatusServer::set_cell_state: returns the park state after it.
  int set_cell(bool running, std::int64_t cell) noexcept;
  // The state with "since_ns", "updated_ns", "age_s" at `now_ns`, and "last_cell_ended_ns".
  nlohmann::json view(std::int64_t now_ns);
  // When the kernel's last cell ended (CLOCK_REALTIME ns); nullopt while no cell has ended since this state
  // was made (the status server's start). Moved only by a cell's end: set() or set_cell() taking the state
  // from a cell's (running; waiting or draining of a cell) to one that is not. A park's steps, a drain from
  // outside's own states (draining of no cell, the idle after it) and the kernel's background releases leave
  // it as it is, so that the time since it is the kernel's idle time whatever was done to the kernel since.
  std::optional<std::int64_t> last_cell_ended_ns() const noexcept;

  // One park step (StatusServer::park_step); the refusal, or nullopt with the
  // state after it in `after`. `automatic`: a begin asked by a policy, which
  // the park blocker refuses. `drain_running` is asked under the lock.
  std::optional<ParkRefusal> park(const std::string& step, std::optional<std::int64_t> bytes, nlohmann::json& after,
                                  const nlohmann::json* then, bool automatic,
                                  const std::function<bool()>& drain_running);
  // 0: not parked; 1: parking; 2: parked.
  int park_state() const noexcept;
  void set_park_blocker(std::string why) noexcept;
  // As StatusServer::background.
  int background(int kind) noexcept;

  // Runs `body(name, outside)` under the lock, name being the state's ("idle", "running", ...; "unknown" when
  // it has none), `outside` whether it is the kernel's own cleanup for a drain from outside ("draining" of no
  // cell): what starts there (a drain) cannot cross a park that begins.
  template <class Body>
  auto with_state_name(Body&& body) {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::string name = name_locked();
    return body(name, outside_drain_locked());
  }

 private:
  // A cell's own state as set_cell() said it last, twice per cell, without a JSON object made and freed:
  // `state_` is built from it only when something reads it (state_locked()). nullopt: `state_` stands.
  struct CellState {
    bool running = false;
    std::int64_t cell = -1;  // < 0: none
  };
  // The idle state a park's "begin" replaced, with its times: "failed" puts it back as it was. A park that did
  // not happen must leave no trace: a fresh idle time would make the kernel look just idle, and the server's
  // automatic park (GPUCleanupServer.park_idle_after_s), which remembers a refused kernel by its idle time,
  // would try it again every round while the page's "idle for" never grew past a round.
  struct BeforePark {
    nlohmann::json state;
    std::int64_t since_ns = 0;
    std::int64_t updated_ns = 0;
  };

  nlohmann::json& state_locked();
  // Whether the state now is a cell's: "running" (of a cell, numbered or not), or "waiting" or "draining" of
  // a numbered cell (a drain from outside says them with no cell).
  bool cell_runs_locked();
  // A cell's state said by set() or set_cell() has replaced the state, which was a cell's (`was_cell`) or not:
  // the cell's end at `when` where it leaves a cell's state for one that is not.
  void note_cell_end_locked(bool was_cell, std::int64_t when);
  std::string name_locked();
  // "draining" with no cell: the kernel's own cleanup for a drain from outside (a cell's says its number).
  bool outside_drain_locked();
  int park_state_locked() const;

  mutable std::mutex mutex_;
  nlohmann::json state_ = nlohmann::json{{"state", "unknown"}};
  std::optional<CellState> cell_state_;
  std::int64_t since_ns_ = 0;
  std::int64_t updated_ns_ = 0;
  std::optional<BeforePark> before_park_;
  std::optional<std::int64_t> last_cell_ended_ns_;  // see last_cell_ended_ns()
  // Why no automatic park may begin now (empty: it may), as the kernel last said it (set_park_blocker): a
  // thread a cell started still runs, and its GPU calls would stop for as long as the kernel stayed parked.
  std::string park_blocker_;
  // The kernel's own releases under way on threads of their own: no park begins while one runs, because a
  // driver call made after the lock waits for the restore, and a thread that holds the interpreter lock while
  // it waits keeps the kernel from ever running the cell that would resume it.
  int background_ = 0;
};

}  // namespace gpucleanup
