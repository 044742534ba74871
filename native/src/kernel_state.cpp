#include "kernel_state.hpp"

#include <time.h>

#include <algorithm>
#include <utility>

namespace gpucleanup {

using json = nlohmann::json;

std::int64_t realtime_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

KernelState::KernelState() { since_ns_ = updated_ns_ = realtime_ns(); }

void KernelState::set(json state) {
  const std::int64_t now = realtime_ns();
  std::int64_t since = now;
  if (const auto it = state.find("since_ns"); it != state.end() && it->is_number_integer()) since = it->get<std::int64_t>();
  std::lock_guard<std::mutex> lock(mutex_);
  if (park_state_locked() != 0) return;  // only park() ends a park
  const bool was_cell = cell_runs_locked();
  cell_state_.reset();
  state_ = std::move(state);
  since_ns_ = since;
  updated_ns_ = now;
  note_cell_end_locked(was_cell, std::min(since, now));  // an "idle" said with the time the cell ended
}

int KernelState::set_cell(bool running, std::int64_t cell) noexcept {
  const std::int64_t now = realtime_ns();
  std::lock_guard<std::mutex> lock(mutex_);
  if (const int parked = park_state_locked(); parked != 0) return parked;  // only park() ends a park
  // A cell's state as it was, read without building the JSON object when it is the fast path's own.
  const bool was_cell = cell_state_ ? cell_state_->running : cell_runs_locked();
  cell_state_ = CellState{running, cell < 0 ? -1 : cell};
  since_ns_ = now;
  updated_ns_ = now;
  note_cell_end_locked(was_cell, now);
  return 0;
}

bool KernelState::cell_runs_locked() {
  if (cell_state_) return cell_state_->running;
  const auto name = state_.find("state");
  if (name == state_.end() || !name->is_string()) return false;
  const auto& word = name->get_ref<const std::string&>();
  if (word == "running") return true;
  if (word != "waiting" && word != "draining") return false;
  const auto cell = state_.find("cell");
  return cell != state_.end() && cell->is_number_integer();
}

void KernelState::note_cell_end_locked(bool was_cell, std::int64_t when) {
  if (was_cell && !cell_runs_locked()) last_cell_ended_ns_ = when;
}

std::optional<std::int64_t> KernelState::last_cell_ended_ns() const noexcept {
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    return last_cell_ended_ns_;
  } catch (...) {
    return std::nullopt;
  }
}

json& KernelState::state_locked() {
  if (cell_state_) {
    json value = json::object();
    value["state"] = cell_state_->running ? "running" : "idle";
    value["since_ns"] = since_ns_;
    if (cell_state_->running) value["cell"] = cell_state_->cell < 0 ? json(nullptr) : json(cell_state_->cell);
    state_ = std::move(value);
    cell_state_.reset();
  }
  return state_;
}

std::string KernelState::name_locked() {
  const json& state = state_locked();
  const auto it = state.find("state");
  return it != state.end() && it->is_string() ? it->get<std::string>() : "unknown";
}

json KernelState::view(std::int64_t now_ns) {
  std::lock_guard<std::mutex> lock(mutex_);
  json view = state_locked();
  view["since_ns"] = since_ns_;
  view["updated_ns"] = updated_ns_;
  view["age_s"] = static_cast<double>(now_ns - since_ns_) / 1e9;
  view["last_cell_ended_ns"] = last_cell_ended_ns_ ? json(*last_cell_ended_ns_) : json(nullptr);
  // What keeps an automatic park away (a notebook's thread still runs), for park --check and the page's bulk park.
  if (!park_blocker_.empty()) view["park_blocker"] = park_blocker_;
  return view;
}

bool KernelState::outside_drain_locked() {
  const json& state = state_locked();
  const auto name = state.find("state");
  if (name == state.end() || !name->is_string() || name->get_ref<const std::string&>() != "draining") return false;
  const auto cell = state.find("cell");
  return cell == state.end() || cell->is_null();
}

int KernelState::park_state_locked() const {
  if (cell_state_) return 0;  // a cell's state: idle or running
  const auto it = state_.find("state");
  if (it == state_.end() || !it->is_string()) return 0;
  const auto& name = it->get_ref<const std::string&>();
  // lost: a resume that could not bring the process back; like parked, no driver call and no cell's state replaces it
  return name == "parking" ? 1 : (name == "parked" || name == "lost") ? 2 : 0;
}

std::optional<ParkRefusal> KernelState::park(const std::string& step, std::optional<std::int64_t> bytes, json& after,
                                             const json* then, bool automatic,
                                             const std::function<bool()>& drain_running) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int parked = park_state_locked();
  const std::string name = name_locked();
  const std::int64_t now = realtime_ns();
  if (step == "begin") {
    // A drain from outside: its wait for queued work (the jobs' drain), then the kernel's own cleanup, said as
    // "draining", which can run the user's finalizers (__del__) for as long as they take. Both end by themselves.
    if (outside_drain_locked()) {
      return ParkRefusal{true, "park refused: a drain from outside (gpucleanup drain, the page's Drain) is running "
                               "the kernel's own cleanup (the frameworks' caches, then garbage collection, where "
                               "objects' finalizers run); it ends by itself: ask again when the kernel is idle"};
    }
    if (name != "idle") {
      return ParkRefusal{false, "park refused: the kernel is " + name +
                                    (parked ? "" : "; a park starts only between cells (state idle): ask again when "
                                                   "the cell has ended")};
    }
    if (drain_running()) {
      return ParkRefusal{true, "park refused: a drain from outside (gpucleanup drain, the page's Drain) is waiting "
                               "for the kernel's queued GPU work, at most its time limit; it ends by itself: ask "
                               "again when it has answered"};
    }
    if (background_ > 0) {
      return ParkRefusal{true, "park refused: gpucleanup is giving the frameworks' caches back on a thread of its "
                               "own; ask again in a few seconds"};
    }
    if (automatic && !park_blocker_.empty()) return ParkRefusal{false, park_blocker_};
    before_park_ = BeforePark{std::move(state_), since_ns_, updated_ns_};
    state_ = json{{"state", "parking"}};
  } else if (step == "parked" || step == "failed") {
    if (parked != 1) {
      return ParkRefusal{false, "park step \"" + step + "\" refused: the kernel is " + name + ", not parking"};
    }
    if (step == "failed" && before_park_) {
      // Idle again as if no park had been asked for: the same object, idle since the same time.
      state_ = std::move(before_park_->state);
      since_ns_ = before_park_->since_ns;
      updated_ns_ = before_park_->updated_ns;
      before_park_.reset();
      after = state_;
      after["since_ns"] = since_ns_;
      return std::nullopt;
    }
    before_park_.reset();  // parked: what comes next is the resume's own state
    state_ = step == "parked" ? json{{"state", "parked"}, {"bytes", bytes ? json(*bytes) : json(nullptr)}}
                              : json{{"state", "idle"}};  // no "begin" (set() said parking): idle from now
  } else if (step == "lost") {
    if (parked == 0) return ParkRefusal{false, "park step \"lost\" refused: the kernel is " + name + ", not parked"};
    before_park_.reset();
    state_ = json{{"state", "lost"}};
  } else if (step == "resumed") {
    if (parked == 0) return ParkRefusal{false, "park step \"resumed\" refused: the kernel is " + name + ", not parked"};
    before_park_.reset();
    json was = state_;
    was["since_ns"] = since_ns_;
    state_ = then != nullptr ? *then : json{{"state", "idle"}};
    since_ns_ = now;
    updated_ns_ = now;
    after = state_;
    after["since_ns"] = now;
    after["was"] = std::move(was);  // what the park was: its bytes, since when
    return std::nullopt;
  } else {
    return ParkRefusal{false, "unknown park step \"" + step + "\": use begin, parked, failed, resumed or lost"};
  }
  since_ns_ = now;
  updated_ns_ = now;
  after = state_;
  after["since_ns"] = now;
  return std::nullopt;
}

int KernelState::park_state() const noexcept {
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    return park_state_locked();
  } catch (...) {
    return 0;
  }
}

void KernelState::set_park_blocker(std::string why) noexcept {
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    park_blocker_ = std::move(why);
  } catch (...) {
  }
}

int KernelState::background(int kind) noexcept {
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    if (kind != 1) {
      if (background_ > 0) --background_;
      if (kind == 2 && name_locked() == "idle") {
        // a request that ran the user's code (a completion, an inspection, a silent execute) is activity, as
        // it is for Jupyter's culling clock: the idle time a park policy waits for starts again from its end
        since_ns_ = updated_ns_ = realtime_ns();
      }
      return 0;
    }
    if (const int parked = park_state_locked(); parked != 0) return parked;
    ++background_;
    return 0;
  } catch (...) {
    return 0;
  }
}

}  // namespace gpucleanup
