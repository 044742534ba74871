#include "thread_hold.hpp"

#include <dirent.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/wait.h>
#include <csignal>
#include <pthread.h>
#include <signal.h>
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

ThreadHold::ThreadHold(pid_t pid, HoldChoice choice, std::chrono::milliseconds limit)
    : pid_(pid), choice_(std::move(choice)) {
  const auto deadline = Clock::now() + limit;
  std::set<pid_t> seized;      // seized and interrupted, not yet seen stopped
  std::set<pid_t> gone;        // exited while being held
  std::set<pid_t> left;        // held by the park's hold while parked
  for (;;) {
    // Seize what is new; a thread that is not stopped yet may still start another, so the list is read
    // again after every round of stops, until a round finds nothing new.
    bool fresh = false;
    for (const pid_t tid : threads_of(pid_)) {
      if (choice_.spare.count(tid) || seized.count(tid) || stopped_.count(tid) || gone.count(tid) ||
          left.count(tid) || (choice_.only_listed && !choice_.only.count(tid))) {
        continue;
      }
      if (ptrace(PTRACE_SEIZE, tid, nullptr, nullptr) != 0) {
        const int err = errno;
        if (err == ESRCH) continue;  // it ended meanwhile
        if (err == EPERM && choice_.held_by > 0 && tracer_of(pid_, tid) == choice_.held_by) {
          left.insert(tid);  // stopped by the park's hold since the park: it stays stopped there
          continue;
        }
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
  by_holder_ = static_cast<int>(left.size());
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
  nlohmann::json out{{"held", held_}, {"threads", count_}, {"missed", missed_}};
  if (!choice_.only_listed) out["spared"] = choice_.spare.empty() ? 0 : *choice_.spare.begin();
  if (choice_.held_by > 0) out["held_since_park"] = by_holder_;
  if (!why_.empty()) out["why"] = why_;
  if (!released_.empty()) out["released"] = "let go before the restore ended: " + released_ + " came for the process";
  if (error_ != 0) out["errno"] = error_;
  return out;
}

pid_t tracer_of(pid_t pid, pid_t tid) noexcept {
  const std::string path = "/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/status";
  std::FILE* file = std::fopen(path.c_str(), "re");
  if (file == nullptr) return -1;
  char line[256];
  long tracer = -1;
  while (std::fgets(line, sizeof line, file) != nullptr) {
    if (std::strncmp(line, "TracerPid:", 10) == 0) {
      tracer = std::strtol(line + 10, nullptr, 10);
      break;
    }
  }
  std::fclose(file);
  return static_cast<pid_t>(tracer);
}

nlohmann::json hold_while_parked(pid_t pid, const std::set<pid_t>& only, std::chrono::milliseconds limit,
                                 int report_fd) {
  sigset_t wanted;
  sigemptyset(&wanted);
  for (const int signal : {SIGUSR1, SIGTERM, SIGINT, SIGHUP}) sigaddset(&wanted, signal);
  sigset_t before;
  pthread_sigmask(SIG_BLOCK, &wanted, &before);
  ThreadHold hold(pid, HoldChoice{{}, only, true, 0}, limit);
  nlohmann::json out = hold.report();
  out["holder"] = static_cast<long>(getpid());
  out["pid"] = static_cast<long>(pid);
  const std::string line = out.dump() + "\n";
  for (std::size_t done = 0; done < line.size();) {
    const ssize_t wrote = write(report_fd, line.data() + done, line.size() - done);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) break;  // nobody reads the report: the hold goes on all the same
    done += static_cast<std::size_t>(wrote);
  }
  std::string ended = !hold.held() ? "not held" : out.value("threads", 0) == 0 ? "no thread to hold" : "";
  const timespec tick{0, 50 * 1000 * 1000};
  while (ended.empty()) {
    const int got = sigtimedwait(&wanted, nullptr, &tick);
    if (got > 0) {
      ended = std::string("released by ") + (got == SIGUSR1 ? "SIGUSR1 (the resume is done)" : strsignal(got));
      break;
    }
    if (!hold.watch()) {
      const nlohmann::json now = hold.report();
      ended = now.contains("released") ? now["released"].get<std::string>() : "the held threads ended";
    }
  }
  hold.release();
  pthread_sigmask(SIG_SETMASK, &before, nullptr);
  out["ended"] = ended;
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
