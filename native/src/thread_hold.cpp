#include "thread_hold.hpp"

#include <dirent.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/wait.h>
#include <csignal>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

namespace gpucleanup {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::microseconds(500);

// The threads of `pid` now (/proc/<pid>/task); empty when it is gone.
std::vector<pid_t> threads_of(pid_t pid) {
  std::vector<pid_t> out;
  const std::string path = "/proc/" + std::to_string(pid) + "/task";
  DIR* dir = opendir(path.c_str());
  if (dir == nullptr) return out;
  while (const dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long tid = std::strtol(entry->d_name, &end, 10);
    if (end != entry->d_name && *end == '\0' && tid > 0) out.push_back(static_cast<pid_t>(tid));
  }
  closedir(dir);
  return out;
}

}  // namespace

ThreadHold::ThreadHold(pid_t pid, pid_t spare, std::chrono::milliseconds limit) : pid_(pid), spare_(spare) {
  const auto deadline = Clock::now() + limit;
  std::set<pid_t> seized;      // seized and interrupted, not yet seen stopped
  std::set<pid_t> gone;        // exited while being held
  for (;;) {
    // Seize what is new; a thread that is not stopped yet may still start another, so the list is read
    // again after every round of stops, until a round finds nothing new.
    bool fresh = false;
    for (const pid_t tid : threads_of(pid_)) {
      if (tid == spare_ || seized.count(tid) || stopped_.count(tid) || gone.count(tid)) continue;
      if (ptrace(PTRACE_SEIZE, tid, nullptr, nullptr) != 0) {
        const int err = errno;
        if (err == ESRCH) continue;  // it ended meanwhile
        if ((err == EPERM || err == EACCES) && seized.empty() && stopped_.empty() && Clock::now() < deadline) {
          // The kernel names this helper as its tracer a moment after starting it: ask again.
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
          fresh = true;
          break;
        }
        error_ = err;
        why_ = std::string("thread ") + std::to_string(tid) + " of process " + std::to_string(pid_) +
               " could not be held (ptrace: " + std::strerror(err) + ")";
        if (err == EPERM || err == EACCES) {
          const int scope = ptrace_scope();
          why_ += scope >= 0 ? " under Yama's ptrace_scope " + std::to_string(scope) : std::string();
        }
        release();
        return;
      }
      seized.insert(tid);
      fresh = true;
      if (ptrace(PTRACE_INTERRUPT, tid, nullptr, nullptr) != 0 && errno == ESRCH) {
        seized.erase(tid);
        gone.insert(tid);
      }
    }
    // Wait for each seized thread's stop: an interrupt stop, or a signal arriving first (handed back on release).
    while (!seized.empty() && Clock::now() < deadline) {
      for (auto it = seized.begin(); it != seized.end();) {
        int status = 0;
        const pid_t got = waitpid(*it, &status, __WALL | WNOHANG);
        if (got == *it && WIFSTOPPED(status)) {
          const bool event_stop = (status >> 16) == PTRACE_EVENT_STOP;
          stopped_[*it] = event_stop ? 0 : WSTOPSIG(status);
          it = seized.erase(it);
        } else if ((got == *it && (WIFEXITED(status) || WIFSIGNALED(status))) || (got < 0 && errno == ECHILD)) {
          gone.insert(*it);
          it = seized.erase(it);
        } else {
          ++it;
        }
      }
      if (!seized.empty()) std::this_thread::sleep_for(kPoll);
    }
    if (!seized.empty() || Clock::now() >= deadline) break;
    if (!fresh) break;
  }
  missed_ = static_cast<int>(seized.size());
  count_ = static_cast<int>(stopped_.size());
  if (threads_of(pid_).empty()) {
    why_ = "process " + std::to_string(pid_) + " is gone";
    release();
    return;
  }
  if (missed_ > 0) {
    why_ = std::to_string(missed_) + " thread" + (missed_ > 1 ? "s" : "") + " of process " + std::to_string(pid_) +
           " did not stop in time (in an uninterruptible call)";
  }
  held_ = missed_ == 0;
}

ThreadHold::~ThreadHold() { release(); }

namespace {

// The signals pending for the whole process (ShdPnd of /proc/<pid>/status), as a mask; 0 when unreadable.
unsigned long long shared_pending(pid_t pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/status";
  std::FILE* file = std::fopen(path.c_str(), "re");
  if (file == nullptr) return 0;
  char line[256];
  unsigned long long mask = 0;
  while (std::fgets(line, sizeof line, file) != nullptr) {
    if (std::strncmp(line, "ShdPnd:", 7) == 0) {
      mask = std::strtoull(line + 7, nullptr, 16);
      break;
    }
  }
  std::fclose(file);
  return mask;
}

}  // namespace

bool ThreadHold::watch() noexcept {
  if (stopped_.empty()) return false;
  for (auto it = stopped_.begin(); it != stopped_.end();) {
    int status = 0;
    const pid_t got = waitpid(it->first, &status, __WALL | WNOHANG);
    if ((got == it->first && (WIFEXITED(status) || WIFSIGNALED(status))) || (got < 0 && errno == ECHILD)) {
      it = stopped_.erase(it);  // ended (killed): reaped here, so that its parent can reap the process
    } else {
      ++it;
    }
  }
  constexpr unsigned long long kEnding = (1ULL << (SIGTERM - 1)) | (1ULL << (SIGHUP - 1)) | (1ULL << (SIGQUIT - 1));
  if (const unsigned long long pending = shared_pending(pid_) & kEnding; pending != 0 && released_.empty()) {
    released_ = pending & (1ULL << (SIGTERM - 1)) ? "SIGTERM" : pending & (1ULL << (SIGHUP - 1)) ? "SIGHUP" : "SIGQUIT";
    release();
  }
  return !stopped_.empty();
}

void ThreadHold::release() noexcept {
  for (const auto& [tid, signal] : stopped_) {
    // A thread that stopped on a signal gets it back; the others simply go on.
    (void)ptrace(PTRACE_DETACH, tid, nullptr, reinterpret_cast<void*>(static_cast<long>(signal)));
  }
  stopped_.clear();
  // Seized threads that never stopped cannot be detached while they run: this helper's exit lets them go.
}

nlohmann::json ThreadHold::report() const {
  nlohmann::json out{{"held", held_}, {"threads", count_}, {"spared", spare_}, {"missed", missed_}};
  if (!why_.empty()) out["why"] = why_;
  if (!released_.empty()) out["released"] = "let go before the restore ended: " + released_ + " came for the process";
  if (error_ != 0) out["errno"] = error_;
  return out;
}

int allow_tracer(pid_t tracer) noexcept {
  if (prctl(PR_SET_PTRACER, static_cast<unsigned long>(tracer), 0UL, 0UL, 0UL) == 0) return 0;
  return errno;
}

int ptrace_scope() noexcept {
  std::FILE* file = std::fopen("/proc/sys/kernel/yama/ptrace_scope", "re");
  if (file == nullptr) return -1;
  int scope = -1;
  if (std::fscanf(file, "%d", &scope) != 1) scope = -1;
  std::fclose(file);
  return scope;
}

}  // namespace gpucleanup
