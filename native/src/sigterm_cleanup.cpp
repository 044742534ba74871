// SIGTERM ends a kernel as cleanly as a shutdown request: the files its status endpoint made (discovery file, key,
// ipc sockets, their private directory) are removed in the signal handler itself, then the default action ends the
// process as before (exit by SIGTERM).
//
// Python's own handlers run only when the main thread next runs Python code, which a kernel waiting in native code
// for its GPU does not do for up to settle_timeout; a handler of the C library runs at once, on whichever thread
// the signal lands. It calls only async-signal-safe functions (getpid, lstat, unlink, rmdir, sigaction, raise), on
// paths copied into static storage beforehand; a forked child (another pid) removes nothing of its parent's.
//
// A path is removed only if it is still the file or directory that was there when the list was set (the same
// device and inode, taken with lstat then): a runtime directory shared by several machines or containers may hold,
// at one of these names, a file another process put there since, and that file is not ours to remove. A path that
// did not exist when the list was set is never removed.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

#include <nlohmann/json.hpp>

#include "api_input.hpp"
#include "gpucleanup/gpucleanup.h"
#include "sigterm_cleanup.hpp"

namespace {

constexpr int kMaxPaths = 8;
constexpr std::size_t kMaxPath = 4096;

struct Entry {
  char path[kMaxPath];
  dev_t dev;
  ino_t ino;
  bool known;  // lstat found it when the list was set
};

struct Paths {
  Entry files[kMaxPaths];
  Entry dirs[kMaxPaths];
};

Paths g_paths;
std::atomic<int> g_files{0};
std::atomic<int> g_dirs{0};
std::atomic<pid_t> g_owner{0};
std::atomic<bool> g_installed{false};

// Still the entry that was recorded? (There is a window between this lstat and the unlink in which the same user
// could swap the name again; nobody else can write in the user's private directories.)
bool still_ours(const Entry& entry) {
  struct stat now {};
  return entry.known && lstat(entry.path, &now) == 0 && now.st_dev == entry.dev && now.st_ino == entry.ino;
}

void on_sigterm(int signo) {
  const int saved = errno;
  if (getpid() == g_owner.load()) {
    const int files = g_files.load();
    for (int i = 0; i < files; ++i) {
      if (still_ours(g_paths.files[i])) unlink(g_paths.files[i].path);
    }
    const int dirs = g_dirs.load();
    for (int i = 0; i < dirs; ++i) {
      if (still_ours(g_paths.dirs[i])) rmdir(g_paths.dirs[i].path);
    }
  }
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(signo, &dfl, nullptr);
  errno = saved;
  raise(signo);  // delivered once this handler returns: the process ends by SIGTERM, as without it
}

bool copy_list(const nlohmann::json& list, Entry* out, std::atomic<int>& count) {
  if (!list.is_array() || list.size() > kMaxPaths) return false;
  int n = 0;
  for (const auto& item : list) {
    if (!item.is_string()) return false;
    const auto& text = item.get_ref<const std::string&>();
    if (text.empty() || text.size() >= kMaxPath || text.find('\0') != std::string::npos || text[0] != '/') return false;
  }
  for (const auto& item : list) {
    const auto& text = item.get_ref<const std::string&>();
    Entry& entry = out[n];
    std::memcpy(entry.path, text.c_str(), text.size() + 1);
    struct stat now {};
    entry.known = lstat(entry.path, &now) == 0;
    entry.dev = entry.known ? now.st_dev : 0;
    entry.ino = entry.known ? now.st_ino : 0;
    ++n;
  }
  count.store(n);
  return true;
}

}  // namespace

namespace gpucleanup {

void set_sigterm_cleanup(const char* paths_json) {
  // The handler reads nothing while the lists change: it sees zero paths until they are whole.
  g_files.store(0);
  g_dirs.store(0);
  if (paths_json == nullptr) {
    if (g_installed.exchange(false)) {
      struct sigaction current {};
      if (sigaction(SIGTERM, nullptr, &current) == 0 && current.sa_handler == on_sigterm) {
        struct sigaction dfl {};
        dfl.sa_handler = SIG_DFL;
        sigemptyset(&dfl.sa_mask);
        sigaction(SIGTERM, &dfl, nullptr);
      }
    }
    return;
  }
  const auto config = nlohmann::json::parse(paths_json, nullptr, false);
  if (!config.is_object()) {
    fail(GPUCLEANUP_ERR_INVALID_ARGUMENT, "[gpucleanup.api.130] sigterm cleanup: paths_json must be a JSON object "
                                          "{\"files\": [...], \"dirs\": [...]}");
  }
  const auto files = config.value("files", nlohmann::json::array());
  const auto dirs = config.value("dirs", nlohmann::json::array());
  if (!copy_list(files, g_paths.files, g_files) || !copy_list(dirs, g_paths.dirs, g_dirs)) {
    g_files.store(0);
    g_dirs.store(0);
    fail(GPUCLEANUP_ERR_INVALID_ARGUMENT, "[gpucleanup.api.130] sigterm cleanup: files and dirs must be lists of at "
                                          "most 8 absolute paths each, shorter than 4096 bytes");
  }
  g_owner.store(getpid());
  struct sigaction current {};
  if (sigaction(SIGTERM, nullptr, &current) != 0) {
    fail(GPUCLEANUP_ERR_INTERNAL, "[gpucleanup.api.131] sigterm cleanup: cannot read SIGTERM's action");
  }
  if (current.sa_handler == on_sigterm) {
    g_installed.store(true);
    return;
  }
  // Only in place of the default action: a handler someone else set (the user's, a framework's) stays theirs.
  if ((current.sa_flags & SA_SIGINFO) != 0 || current.sa_handler != SIG_DFL) {
    fail(GPUCLEANUP_ERR_BUSY, "[gpucleanup.api.132] sigterm cleanup: SIGTERM already has a handler; it is left as it is");
  }
  struct sigaction ours {};
  ours.sa_handler = on_sigterm;
  sigemptyset(&ours.sa_mask);
  ours.sa_flags = SA_RESTART;
  if (sigaction(SIGTERM, &ours, nullptr) != 0) {
    fail(GPUCLEANUP_ERR_INTERNAL, "[gpucleanup.api.131] sigterm cleanup: cannot set SIGTERM's action");
  }
  g_installed.store(true);
}

}  // namespace gpucleanup
