// Holding another process's threads while the driver restores it: a restore
// runs alone (DESIGN rule 12). CRIU's CUDA plugin keeps every thread of the
// process stopped and lets only the driver's restore thread run; a thread that
// calls the driver mid-restore (XLA polling a stream) made the driver raise
// SIGSEGV in it (share/FACTS.md §11). The park helper does the same: it stops
// each thread but the restore thread with PTRACE_SEIZE + PTRACE_INTERRUPT
// (transparent to the thread: an interrupted system call is restarted) and
// lets them go after the restore and the unlock. A helper that dies lets them
// go too: the kernel detaches every tracee of a tracer that exits.
//
// A leaf: no driver, no JSON library beyond the result's shape.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

namespace gpucleanup {

// Which threads a hold stops: every thread of the process but `spare`, or only
// those in `only` (when `only_listed`); a thread another process of ours
// already holds (`held_by`, the park's hold while parked) is left to it and
// counted, never an error.
struct HoldChoice {
  std::set<pid_t> spare;
  std::set<pid_t> only;
  bool only_listed = false;
  pid_t held_by = 0;
};

class ThreadHold {
 public:
  // Stops every thread of `pid` but `spare` (the driver's restore thread);
  // waits at most `limit` for the permission (the kernel names its helper with
  // PR_SET_PTRACER a moment after starting it) and for the threads to stop.
  ThreadHold(pid_t pid, pid_t spare, std::chrono::milliseconds limit)
      : ThreadHold(pid, HoldChoice{{spare}, {}, false, 0}, limit) {}
  ThreadHold(pid_t pid, HoldChoice choice, std::chrono::milliseconds limit);
  ~ThreadHold();  // releases whatever is still held
  ThreadHold(const ThreadHold&) = delete;
  ThreadHold& operator=(const ThreadHold&) = delete;

  bool held() const noexcept { return held_; }
  void release() noexcept;
  // Called by the holding thread while the restore runs: lets every thread go
  // at once when a signal that ends the process waits for it (SIGTERM, SIGHUP,
  // SIGQUIT: a shutdown is never held back), and reaps held threads that ended
  // (a SIGKILL: the kernel's parent can then reap the process). True while held.
  bool watch() noexcept;
  // {"held": bool, "threads": n stopped, "spared": tid, "missed": n that did
  //  not stop in time, "why": the sentence when not held, "errno"}
  nlohmann::json report() const;

 private:
  pid_t pid_;
  HoldChoice choice_;
  bool held_ = false;
  int missed_ = 0;
  int count_ = 0;
  int by_holder_ = 0;  // threads left to the park's hold while parked (HoldChoice::held_by)
  int error_ = 0;
  std::string why_;
  std::string released_;  // why the hold ended before the restore did
  std::map<pid_t, int> stopped_;  // tid -> the signal to hand back on release (0: none)
};

// The park's hold while parked (a JAX kernel's XLA threads poll the driver on
// their own and fault while the process is checkpointed: share/FACTS.md §11):
// stops the threads of `pid` listed in `only`, writes one JSON line on
// `report_fd` (the hold's report with "holder": this process), then keeps
// them stopped until SIGUSR1, SIGTERM, SIGINT or SIGHUP comes for this
// process (the resume's unlock is done), the process ends, or a signal that
// ends the process comes for it (ThreadHold::watch). Returns the last report,
// with "ended": why the hold ended. The signals are blocked in the calling
// thread meanwhile and unblocked after.
nlohmann::json hold_while_parked(pid_t pid, const std::set<pid_t>& only, std::chrono::milliseconds limit,
                                 int report_fd);

// The tracer of thread `tid` of process `pid` (TracerPid in its status), 0
// for none, -1 when unreadable.
pid_t tracer_of(pid_t pid, pid_t tid) noexcept;

// Names `tracer` as the process allowed to trace this one under Yama's
// ptrace_scope 1 (prctl PR_SET_PTRACER); 0 clears it. Returns errno (0: done;
// EINVAL where Yama is absent, when no name is needed).
int allow_tracer(pid_t tracer) noexcept;

// Yama's /proc/sys/kernel/yama/ptrace_scope, -1 when absent.
int ptrace_scope() noexcept;

}  // namespace gpucleanup
