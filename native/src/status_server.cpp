#include "status_server.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iterator>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "detail/hmac.hpp"
#include "errors.hpp"
#include "status_protocol.hpp"

namespace gpucleanup {
namespace {

using json = nlohmann::json;
using steady = std::chrono::steady_clock;

constexpr int kProtocol = kStatusProtocol;

std::int64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// Records come from Python and may carry anything; invalid UTF-8 must not
// turn a reply into an exception.
std::string dump(const json& value) { return dump_json(value); }

std::string scheme_of(const std::string& endpoint) {
  const auto pos = endpoint.find("://");
  return pos == std::string::npos ? std::string() : endpoint.substr(0, pos);
}

std::string tcp_host(const std::string& endpoint) {
  const std::string rest = endpoint.substr(6);  // after "tcp://"
  if (!rest.empty() && rest.front() == '[') {
    const auto close = rest.find(']');
    return close == std::string::npos ? rest : rest.substr(0, close + 1);
  }
  return rest.substr(0, rest.rfind(':'));
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

// An ipc socket is as private as the directory that holds it.
void check_ipc_directory(const std::string& endpoint) {
  const std::string path = endpoint.substr(6);  // after "ipc://"
  if (path.empty() || path.front() != '/') {
    GPUCLEANUP_FAIL("gpucleanup.server.504",
                    "ipc endpoint " + endpoint +
                        " is not an absolute path (abstract sockets have no permissions): use ipc:///dir/socket "
                        "in a directory of mode 0700");
  }
  const std::string dir = path.substr(0, std::max<std::size_t>(path.rfind('/'), 1));
  struct stat info {};
  if (stat(dir.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    GPUCLEANUP_FAIL("gpucleanup.server.504", "directory " + dir + " of ipc endpoint does not exist: create it with mode 0700");
  }
  if (info.st_uid != geteuid() || (info.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(info.st_mode & 07777));
    GPUCLEANUP_FAIL("gpucleanup.server.504", "directory " + dir + " of ipc endpoint is open to others (mode " + mode +
                                                 "): use a directory of your own with mode 0700");
  }
}

std::string derive_pub_endpoint(const std::string& endpoint) {
  const std::string scheme = scheme_of(endpoint);
  if (scheme == "ipc") return endpoint + ".pub";
  if (scheme == "inproc") return endpoint + "-pub";
  return "tcp://" + tcp_host(endpoint) + ":0";
}

void validate(const ServerConfig& config) {
  for (const std::string* endpoint : {&config.endpoint, &config.pub_endpoint}) {
    if (endpoint->empty()) continue;
    const std::string scheme = scheme_of(*endpoint);
    if (scheme == "ipc") {
      check_ipc_directory(*endpoint);
    } else if (scheme == "tcp") {
      if (!is_loopback(tcp_host(*endpoint))) {
        GPUCLEANUP_FAIL("gpucleanup.server.502", "tcp endpoint " + *endpoint +
                                                     " is not loopback: bind 127.0.0.1 or [::1]; the status server "
                                                     "never listens beyond this machine");
      }
      if (config.key.empty()) {
        GPUCLEANUP_FAIL("gpucleanup.server.503",
                        "tcp endpoint " + *endpoint + " needs a key: every request over tcp is signed");
      }
    } else if (scheme != "inproc") {
      GPUCLEANUP_FAIL("gpucleanup.server.501", "endpoint \"" + *endpoint +
                                                   "\" is not supported: use ipc:///dir/socket, "
                                                   "tcp://127.0.0.1:0 or inproc://name");
    }
  }
}

// libzmq's ipc listener creates the socket with the umask; the directory
// already keeps others out, this is the second lock.
void restrict_ipc_socket(const std::string& bound) {
  if (scheme_of(bound) == "ipc") chmod(bound.substr(6).c_str(), 0600);
}

steady::duration to_duration(double seconds) {
  return std::chrono::duration_cast<steady::duration>(std::chrono::duration<double>(std::min(seconds, 1e6)));
}

int milliseconds_option(double value_s) {
  return static_cast<int>(std::min(value_s * 1000.0, 3600.0 * 1000.0));
}

// Peers per socket: config.max_peers, and never more than an eighth of the
// descriptors the process may open, so that the two sockets together hold at
// most a quarter of them (read at every accept: the process may change it).
std::size_t peer_cap(std::size_t max_peers) {
  std::size_t cap = max_peers;
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    cap = std::min<std::size_t>(cap, static_cast<std::size_t>(limit.rlim_cur / 8));
  }
  return std::max<std::size_t>(cap, 1);
}

// The user owning the other end of a loopback tcp connection: the socket
// whose local address is this connection's peer address and whose remote
// address is this connection's local address, in /proc/net/tcp (or tcp6) of
// this network namespace (its "uid" column, as ss -e shows it). std::nullopt
// when it cannot be told (no /proc, not found): unknown is never the owner.
// An ipc peer needs none of this: the socket's 0700 directory keeps others out.
std::string proc_net_address(const sockaddr_storage& address) {
  // The kernel prints each 32-bit word of the address in host byte order, then
  // the port: 127.0.0.1:8080 on x86 is "0100007F:1F90".
  char text[64] = {};
  if (address.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(address);
    std::snprintf(text, sizeof text, "%08X:%04X", static_cast<unsigned>(in.sin_addr.s_addr), ntohs(in.sin_port));
  } else if (address.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(address);
    std::uint32_t words[4];
    std::memcpy(words, &in6.sin6_addr, sizeof words);
    std::snprintf(text, sizeof text, "%08X%08X%08X%08X:%04X", static_cast<unsigned>(words[0]),
                  static_cast<unsigned>(words[1]), static_cast<unsigned>(words[2]), static_cast<unsigned>(words[3]),
                  ntohs(in6.sin6_port));
  } else {
    return {};
  }
  return text;
}

std::optional<uid_t> tcp_peer_uid(int fd) {
  sockaddr_storage local{};
  sockaddr_storage peer{};
  socklen_t local_size = sizeof local;
  socklen_t peer_size = sizeof peer;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_size) != 0 ||
      getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_size) != 0 || local.ss_family != peer.ss_family) {
    return std::nullopt;
  }
  const std::string theirs = proc_net_address(peer);
  const std::string ours = proc_net_address(local);
  if (theirs.empty()) return std::nullopt;
  FILE* table = std::fopen(local.ss_family == AF_INET ? "/proc/net/tcp" : "/proc/net/tcp6", "re");
  if (table == nullptr) return std::nullopt;
  std::optional<uid_t> uid;
  char line[512];
  while (std::fgets(line, sizeof line, table) != nullptr) {
    char slot[16], local_text[64], remote_text[64], state[8], queues[40], timer[40], retransmits[16];
    unsigned long owner = 0;
    if (std::sscanf(line, "%15s %63s %63s %7s %39s %39s %15s %lu", slot, local_text, remote_text, state, queues,
                    timer, retransmits, &owner) != 8) {
      continue;  // the header
    }
    if (theirs == local_text && ours == remote_text) {
      uid = static_cast<uid_t>(owner);
      break;
    }
  }
  std::fclose(table);
  return uid;
}

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
class PeerGuard {
 public:
  // Events waiting beyond this are dropped by libzmq (a memory bound under a
  // flood); rescan() finds what a lost event would have said.
  static constexpr int kMonitorQueue = 4096;
  static constexpr std::size_t kRescanAfterEvents = 1000;

  struct Limits {
    std::size_t cap = 1;
    steady::duration grace{};
    steady::duration idle_timeout{};  // zero: never
    int busy_fd = -1;                 // a peer waiting for an answer (drain)
  };

  explicit PeerGuard(bool requests) : requests_(requests) {}

  // Before bind, so that no connection is missed.
  void attach(zmq::context_t& context, zmq::socket_t& socket, const std::string& name) {
    if (zmq_socket_monitor(socket.handle(), name.c_str(), ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED) != 0) {
      throw zmq::error_t();
    }
    monitor_ = zmq::socket_t(context, zmq::socket_type::pair);
    monitor_.set(zmq::sockopt::linger, 0);
    monitor_.set(zmq::sockopt::rcvhwm, kMonitorQueue);
    monitor_.connect(name);
  }

  // After bind: the listener's address, as accepted connections report it locally.
  void listen(const std::string& bound) {
    const std::string scheme = scheme_of(bound);
    if (scheme == "ipc") {
      path_ = bound.substr(6);
      family_ = AF_UNIX;
    } else if (scheme == "tcp") {
      std::string host = tcp_host(bound);
      port_ = static_cast<std::uint16_t>(std::strtoul(bound.substr(bound.rfind(':') + 1).c_str(), nullptr, 10));
      if (!host.empty() && host.front() == '[') {
        family_ = AF_INET6;
        host = host.substr(1, host.size() - 2);
        if (inet_pton(AF_INET6, host.c_str(), &addr6_) != 1) family_ = AF_UNSPEC;
      } else {
        family_ = AF_INET;
        if (inet_pton(AF_INET, host.c_str(), &addr4_) != 1) family_ = AF_UNSPEC;
      }
    }
  }

  bool active() const { return monitor_.handle() != nullptr && family_ != AF_UNSPEC; }
  void* monitor_handle() { return monitor_.handle(); }
  bool tracking() const { return !peers_.empty() || events_since_scan_ >= kRescanAfterEvents; }
  std::size_t live() const { return live_.load(); }

  // Reads the monitor's events; returns how many connections were refused.
  std::uint64_t read_events(steady::time_point now, const Limits& limits) {
    std::uint64_t refused = 0;
    for (int i = 0; i < kMonitorQueue; ++i) {
      std::vector<zmq::message_t> frames;
      if (!zmq::recv_multipart(monitor_, std::back_inserter(frames), zmq::recv_flags::dontwait)) break;
      ++events_since_scan_;
      if (frames.empty() || frames[0].size() < 6) continue;
      std::uint16_t event = 0;
      std::int32_t fd = -1;
      std::memcpy(&event, frames[0].data(), sizeof event);
      std::memcpy(&fd, static_cast<const char*>(frames[0].data()) + 2, sizeof fd);
      if (event == ZMQ_EVENT_ACCEPTED) {
        refused += admit(fd, now, limits);
      } else if (event == ZMQ_EVENT_DISCONNECTED) {
        forget(fd);
      }
    }
    return refused;
  }

  // An authenticated request came from this descriptor.
  void touch(int fd, steady::time_point now) {
    const auto it = peers_.find(fd);
    if (it != peers_.end() && !it->second.closing) it->second.active = now;
  }

  // Drops request peers idle past the timeout, forgets connections whose end
  // was not reported, and after a burst of events (some may have been lost)
  // looks for connections it has not seen. Returns how many were dropped idle.
  std::uint64_t tick(steady::time_point now, const Limits& limits, std::uint64_t& refused) {
    std::uint64_t dropped = 0;
    for (auto it = peers_.begin(); it != peers_.end();) {
      Peer& peer = it->second;
      if (!same_socket(it->first, peer.inode)) {
        if (!peer.closing) --live_;
        it = peers_.erase(it);
        continue;
      }
      if (!peer.closing && requests_ && limits.idle_timeout > steady::duration::zero() && it->first != limits.busy_fd &&
          now - peer.active >= limits.idle_timeout) {
        close_peer(it->first, peer);
        ++dropped;
      } else if (peer.closing && now - peer.closing_since >= std::chrono::seconds(1)) {
        (void)shutdown(it->first, SHUT_RDWR);  // still open: say it again
        peer.closing_since = now;
      }
      ++it;
    }
    if (events_since_scan_ >= kRescanAfterEvents) refused += rescan(now, limits);
    return dropped;
  }

  void close() noexcept {
    monitor_.close();
    peers_.clear();
    live_ = 0;
    events_since_scan_ = 0;
    family_ = AF_UNSPEC;
  }

 private:
  struct Peer {
    ino_t inode = 0;
    steady::time_point active{};  // accepted, or the last authenticated request
    bool closing = false;         // shut down here; libzmq closes it
    steady::time_point closing_since{};
    bool uid_known = false;  // asked only when the records socket is full (tcp_peer_uid reads a table)
    std::optional<uid_t> uid;
  };

  static bool same_socket(int fd, ino_t inode) {
    struct stat info {};
    return fstat(fd, &info) == 0 && S_ISSOCK(info.st_mode) && info.st_ino == inode;
  }

  // A connected socket accepted on this listener: its inode, else 0.
  ino_t accepted_here(int fd) const {
    struct stat info {};
    if (fd < 0 || fstat(fd, &info) != 0 || !S_ISSOCK(info.st_mode)) return 0;
    int listening = 0;
    socklen_t size = sizeof listening;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &size) != 0 || listening != 0) return 0;
    sockaddr_storage local{};
    socklen_t length = sizeof local;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) != 0 || local.ss_family != family_) return 0;
    bool same = false;
    if (family_ == AF_INET) {
      const auto& in = reinterpret_cast<const sockaddr_in&>(local);
      same = ntohs(in.sin_port) == port_ && std::memcmp(&in.sin_addr, &addr4_, sizeof addr4_) == 0;
    } else if (family_ == AF_INET6) {
      const auto& in6 = reinterpret_cast<const sockaddr_in6&>(local);
      same = ntohs(in6.sin6_port) == port_ && std::memcmp(&in6.sin6_addr, &addr6_, sizeof addr6_) == 0;
    } else if (family_ == AF_UNIX) {
      const auto& un = reinterpret_cast<const sockaddr_un&>(local);
      const std::size_t offset = offsetof(sockaddr_un, sun_path);
      const std::size_t size_of_path = length > offset ? length - offset : 0;
      same = std::string(un.sun_path, strnlen(un.sun_path, size_of_path)) == path_;
    }
    return same ? info.st_ino : 0;
  }

  void close_peer(int fd, Peer& peer) {
    (void)shutdown(fd, SHUT_RDWR);
    if (!peer.closing) --live_;
    peer.closing = true;
    peer.closing_since = std::chrono::steady_clock::now();
  }

  // A new connection: kept while under the cap; at the cap a request socket
  // drops its peer idle longest (idle for the grace at least) to make room;
  // the records socket (whose subscribers never send anything to tell them
  // apart) makes room for a newcomer of this process's own user on tcp by
  // dropping the oldest peer of another user, so that other local users
  // cannot lock the owner out of its own records; otherwise the newcomer is
  // refused. Returns 1 if one was refused.
  std::uint64_t admit(int fd, steady::time_point now, const Limits& limits) {
    const ino_t inode = accepted_here(fd);
    if (inode == 0) return 0;  // already gone; its end is reported next
    if (const auto it = peers_.find(fd); it != peers_.end()) {
      if (it->second.inode == inode) return 0;  // seen by rescan()
      forget(fd);                               // its end was lost
    }
    Peer peer{inode, now, false, {}, false, std::nullopt};
    std::uint64_t refused = 0;
    if (live_ >= limits.cap) {
      refused = 1;
      auto victim = peers_.end();
      if (requests_) {
        for (auto it = peers_.begin(); it != peers_.end(); ++it) {
          if (it->second.closing || it->first == limits.busy_fd || now - it->second.active < limits.grace) continue;
          if (victim == peers_.end() || it->second.active < victim->second.active) victim = it;
        }
      } else if (family_ != AF_UNIX && tcp_peer_uid(fd) == geteuid()) {
        for (auto it = peers_.begin(); it != peers_.end(); ++it) {
          if (it->second.closing) continue;
          if (!it->second.uid_known) {
            it->second.uid = tcp_peer_uid(it->first);
            it->second.uid_known = true;
          }
          if (it->second.uid == geteuid()) continue;
          if (victim == peers_.end() || it->second.active < victim->second.active) victim = it;
        }
      }
      if (victim != peers_.end()) {
        if (same_socket(victim->first, victim->second.inode)) {
          close_peer(victim->first, victim->second);
        } else {
          forget(victim->first);  // gone unannounced: its slot is free
        }
      } else {
        (void)shutdown(fd, SHUT_RDWR);
        peer.closing = true;
        peer.closing_since = now;
      }
    }
    if (!peer.closing) ++live_;
    peers_[fd] = peer;
    return refused;
  }

  void forget(int fd) {
    const auto it = peers_.find(fd);
    if (it == peers_.end()) return;
    if (!it->second.closing) --live_;
    peers_.erase(it);
  }

  // The connections of this listener that no event announced.
  std::uint64_t rescan(steady::time_point now, const Limits& limits) {
    events_since_scan_ = 0;
    std::uint64_t refused = 0;
    DIR* dir = opendir("/proc/self/fd");
    if (dir == nullptr) return 0;
    std::vector<int> fds;
    while (const dirent* entry = readdir(dir)) {
      char* end = nullptr;
      const long fd = std::strtol(entry->d_name, &end, 10);
      if (end != entry->d_name && *end == '\0' && fd != dirfd(dir)) fds.push_back(static_cast<int>(fd));
    }
    closedir(dir);
    for (const int fd : fds) {
      if (peers_.count(fd) == 0) refused += admit(fd, now, limits);
    }
    return refused;
  }

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

}  // namespace

ServerConfig server_config_from_json(const json& config) {
  if (!config.is_object()) {
    GPUCLEANUP_FAIL("gpucleanup.server.506", "server config must be a JSON object with at least \"endpoint\"");
  }
  ServerConfig out;
  auto field = [&](const char* name, auto& target, auto check, const char* expected) {
    const auto it = config.find(name);
    if (it == config.end() || it->is_null()) return;
    if (!check(*it)) {
      GPUCLEANUP_FAIL("gpucleanup.server.506",
                      std::string("server config \"") + name + "\" must be " + expected + ", got " + dump(*it));
    }
    it->get_to(target);
  };
  const auto is_string = [](const json& v) { return v.is_string(); };
  const auto is_count = [](const json& v) { return v.is_number_integer() && v.get<std::int64_t>() >= 0; };
  const auto is_seconds = [](const json& v) {
    return v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= 0;
  };
  field("endpoint", out.endpoint, is_string, "a string");
  field("pub_endpoint", out.pub_endpoint, is_string, "a string");
  field("key", out.key, is_string, "a string");
  field("history_limit", out.history_limit, is_count, "an integer >= 0");
  field("max_request_bytes", out.max_request_bytes, is_count, "an integer >= 0");
  field("require_signature", out.require_signature, [](const json& v) { return v.is_boolean(); }, "true or false");
  field("replay_window_s", out.replay_window_s, is_seconds, "a number of seconds >= 0");
  field("snapshot_timeout_s", out.snapshot_timeout_s, is_seconds, "a number of seconds >= 0");
  field("drain_timeout_s", out.drain_timeout_s, is_seconds, "a number of seconds >= 0");
  field("max_drain_timeout_s", out.max_drain_timeout_s, is_seconds, "a number of seconds >= 0");
  field("max_peers", out.max_peers, [](const json& v) { return v.is_number_integer() && v.get<std::int64_t>() >= 1; },
        "an integer >= 1");
  field("peer_idle_timeout_s", out.peer_idle_timeout_s, is_seconds, "a number of seconds >= 0");
  field("peer_grace_s", out.peer_grace_s, is_seconds, "a number of seconds >= 0");
  field("handshake_timeout_s", out.handshake_timeout_s, is_seconds, "a number of seconds >= 0");
  field("heartbeat_interval_s", out.heartbeat_interval_s, is_seconds, "a number of seconds >= 0");
  if (const auto it = config.find("kernel"); it != config.end() && !it->is_null()) out.kernel = *it;
  if (out.endpoint.empty()) {
    GPUCLEANUP_FAIL("gpucleanup.server.506", "server config needs \"endpoint\": ipc:///dir/socket or tcp://127.0.0.1:0");
  }
  return out;
}

// Why a park step was refused. `passing`: only for a moment (a drain, or the
// kernel's own release on a thread, is under way): the caller may ask again
// at once (server.421 on the socket, server.510 in the process), where every
// other refusal (server.420, server.509) stands until the state changes.
struct ParkRefusal {
  bool passing;
  std::string message;
};

struct StatusServer::Impl {
  struct PendingDrain {
    std::vector<std::string> envelope;
    json id;
    double timeout_s = 0;
    int fd = -1;  // kept connected until answered
  };

  Impl(ServerConfig c, ServerHooks h)
      : config(std::move(c)),
        hooks(std::move(h)),
        check(config) {
    config.require_signature = signature_required(config);
    state_since_ns = state_updated_ns = now_ns();
  }

  ServerConfig config;
  ServerHooks hooks;

  std::mutex lifecycle;  // start and stop
  bool started = false;
  pid_t owner_pid = 0;
  std::atomic<bool> stopping{false};

  std::unique_ptr<zmq::context_t> own_context;
  zmq::context_t* context = nullptr;
  zmq::socket_t router;
  zmq::socket_t pub;
  zmq::socket_t wake_rx;
  // The ZAP handler (RFC 27) of the server's own context: every ZMTP handshake
  // waits for its answer, which the server thread gives only after it has read
  // the monitors. A connection refused at accept is shut down before its
  // handshake can finish, so its client keeps the request and sends it again
  // on the next connection instead of losing it.
  zmq::socket_t zap;
  std::mutex wake_mutex;
  zmq::socket_t wake_tx;
  bool wake_open = false;
  std::string endpoint;
  std::string pub_endpoint;
  std::thread thread;

  // Shared with set_state and publish, which come from Python's threads.
  std::mutex state_mutex;
  // The kernel's own releases under way on threads of their own (state_mutex): no park begins while one runs,
  // because a driver call made after the lock waits for the restore, and a thread that holds the interpreter
  // lock while it waits keeps the kernel from ever running the cell that would resume it.
  int background = 0;
  json state = json{{"state", "unknown"}};
  // A cell's own state as set_cell_state() said it last, twice per cell, without a JSON object made and freed:
  // `state` is built from it only when something reads it (state_locked()). nullopt: `state` stands.
  struct CellState {
    bool running = false;
    std::int64_t cell = -1;  // < 0: none
  };
  std::optional<CellState> cell_state;
  std::int64_t state_since_ns = 0;
  std::int64_t state_updated_ns = 0;
  // The idle state a park's "begin" replaced, with its times: "failed" puts it back as it was. A park that did
  // not happen must leave no trace: a fresh idle time would make the kernel look just idle, and the server's
  // automatic park (GPUCleanupServer.park_idle_after_s), which remembers a refused kernel by its idle time,
  // would try it again every round while the page's "idle for" never grew past a round.
  struct BeforePark {
    json state;
    std::int64_t since_ns = 0;
    std::int64_t updated_ns = 0;
  };
  std::optional<BeforePark> before_park;
  // Why no automatic park may begin now (empty: it may), as the kernel last said it (set_park_blocker): a
  // thread a cell started still runs, and its GPU calls would stop for as long as the kernel stayed parked.
  std::string park_blocker;
  std::deque<std::string> history;  // each a JSON object's text (publish_text)
  std::deque<std::string> outbox;
  std::uint64_t published = 0;

  // The hook worker: hooks may block (the library serialises snapshot and
  // drain), so they never run on the thread that answers.
  std::thread worker;
  std::mutex job_mutex;
  std::condition_variable job_cv;
  std::condition_variable snapshot_cv;
  bool worker_stop = false;
  std::uint64_t snapshot_requested = 0;
  std::uint64_t snapshot_done = 0;
  steady::time_point snapshot_started{};
  json last_snapshot;  // null until the first snapshot
  std::int64_t last_snapshot_ns = 0;
  std::string last_snapshot_error;
  std::optional<double> drain_job;         // timeout of a drain to run
  std::optional<json> drain_result;        // finished drain (result or error reply)
  bool drain_running = false;

  // Server thread only.
  std::optional<PendingDrain> pending_drain;
  RequestCheck check;  // keeps the signatures seen (replay)
  std::int64_t started_ns = 0;
  std::uint64_t requests = 0;
  std::uint64_t errors = 0;
  int request_fd = -1;             // the descriptor the request in hand came from
  bool request_authenticated = false;
  PeerGuard router_peers{true};
  PeerGuard pub_peers{false};
  steady::time_point next_tick{};

  // Read from any thread (connections()).
  std::atomic<std::uint64_t> refused_connections{0};
  std::atomic<std::uint64_t> dropped_idle{0};

  json connections_view() const {
    return json{{"max_peers", peer_cap(config.max_peers)},
                {"peers", router_peers.live()},
                {"pub_peers", pub_peers.live()},
                {"refused_connections", refused_connections.load()},
                {"dropped_idle", dropped_idle.load()},
                {"peer_idle_timeout_s", config.peer_idle_timeout_s}};
  }

  PeerGuard::Limits peer_limits() const {
    PeerGuard::Limits limits;
    limits.cap = peer_cap(config.max_peers);
    limits.grace = to_duration(config.peer_grace_s);
    limits.idle_timeout = to_duration(config.peer_idle_timeout_s);
    limits.busy_fd = pending_drain ? pending_drain->fd : -1;
    return limits;
  }

  // The monitors' news, then (every 250 ms while there are peers) the idle.
  void guard_connections() {
    const auto now = steady::now();
    const PeerGuard::Limits limits = peer_limits();
    std::uint64_t refused = 0;
    std::uint64_t dropped = 0;
    for (PeerGuard* guard : {&router_peers, &pub_peers}) {
      if (guard->active()) refused += guard->read_events(now, limits);
    }
    if (now >= next_tick) {
      next_tick = now + std::chrono::milliseconds(250);
      for (PeerGuard* guard : {&router_peers, &pub_peers}) {
        if (guard->active()) dropped += guard->tick(now, limits, refused);
      }
    }
    if (refused != 0) refused_connections += refused;
    if (dropped != 0) dropped_idle += dropped;
  }

  std::vector<std::vector<zmq::message_t>> read_zap_requests() {
    std::vector<std::vector<zmq::message_t>> requests;
    if (zap.handle() == nullptr) return requests;
    // Bounded like the monitor: what is left waits for the next round.
    for (int i = 0; i < PeerGuard::kMonitorQueue; ++i) {
      std::vector<zmq::message_t> frames;
      if (!zmq::recv_multipart(zap, std::back_inserter(frames), zmq::recv_flags::dontwait)) break;
      requests.push_back(std::move(frames));
    }
    return requests;
  }

  // [routing id, "", "1.0", request id, domain, address, identity, mechanism,
  // credentials...] -> [routing id, "", "1.0", request id, "200", "OK", user
  // id, metadata]. Every handshake is let through: the connections refused
  // were shut down before this answer, and their handshake fails on that.
  void answer_zap_requests(std::vector<std::vector<zmq::message_t>>& requests) {
    for (auto& frames : requests) {
      if (frames.size() < 4 || frames[1].size() != 0) continue;
      std::array<zmq::const_buffer, 8> reply{zmq::const_buffer(frames[0].data(), frames[0].size()),
                                             zmq::const_buffer("", 0),
                                             zmq::buffer(std::string_view("1.0")),
                                             zmq::const_buffer(frames[3].data(), frames[3].size()),
                                             zmq::buffer(std::string_view("200")),
                                             zmq::buffer(std::string_view("OK")),
                                             zmq::const_buffer("", 0),
                                             zmq::const_buffer("", 0)};
      (void)zmq::send_multipart(zap, reply, zmq::send_flags::dontwait);
    }
  }

  std::chrono::milliseconds poll_timeout() const {
    if (!router_peers.tracking() && !pub_peers.tracking()) return std::chrono::milliseconds(-1);
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(next_tick - steady::now());
    return std::clamp(left + std::chrono::milliseconds(1), std::chrono::milliseconds(1), std::chrono::milliseconds(250));
  }

  void wake() noexcept {
    std::lock_guard<std::mutex> lock(wake_mutex);
    if (!wake_open) return;
    try {
      // A full pipe already holds a wake-up: EAGAIN is fine.
      (void)wake_tx.send(zmq::const_buffer("w", 1), zmq::send_flags::dontwait);
    } catch (...) {
    }
  }

  std::string sign(const std::string& body) const {
    return config.key.empty() ? std::string() : detail::hmac_sha256_hex(config.key, body);
  }

  void send_reply(const std::vector<std::string>& envelope, json body) {
    body["protocol"] = kProtocol;
    body["time_ns"] = now_ns();
    const std::string text = dump(body);
    std::vector<zmq::const_buffer> frames;
    for (const auto& frame : envelope) frames.emplace_back(frame.data(), frame.size());
    const std::string signature = sign(text);
    frames.emplace_back(signature.data(), signature.size());
    frames.emplace_back(text.data(), text.size());
    // A client that went away takes its reply with it; never block here.
    (void)zmq::send_multipart(router, frames, zmq::send_flags::dontwait);
  }

  void send_error(const std::vector<std::string>& envelope, const json& id, const Rejection& rejection) {
    ++errors;
    send_reply(envelope, error_reply(id, rejection));
  }

  // The state object (state_mutex held): built from the last cell's state when a cell said it last.
  json& state_locked() {
    if (cell_state) {
      json value = json::object();
      value["state"] = cell_state->running ? "running" : "idle";
      value["since_ns"] = state_since_ns;
      if (cell_state->running) value["cell"] = cell_state->cell < 0 ? json(nullptr) : json(cell_state->cell);
      state = std::move(value);
      cell_state.reset();
    }
    return state;
  }

  json state_view(std::int64_t now) {
    std::lock_guard<std::mutex> lock(state_mutex);
    json view = state_locked();
    view["since_ns"] = state_since_ns;
    view["updated_ns"] = state_updated_ns;
    view["age_s"] = static_cast<double>(now - state_since_ns) / 1e9;
    return view;
  }

  // 0: not parked, 1: parking, 2: parked (state_mutex held).
  int park_state_locked() const {
    if (cell_state) return 0;  // a cell's state: idle or running
    const auto it = state.find("state");
    if (it == state.end() || !it->is_string()) return 0;
    const auto& name = it->get_ref<const std::string&>();
    return name == "parking" ? 1 : name == "parked" ? 2 : 0;
  }

  // One park step under the state lock; the refusal, or nullopt with the new
  // state in `after`.
  std::optional<ParkRefusal> park_transition(const std::string& step, std::optional<std::int64_t> bytes,
                                             json& after, const json* then = nullptr, bool automatic = false) {
    std::lock_guard<std::mutex> lock(state_mutex);
    const int parked = park_state_locked();
    state_locked();
    const auto name_it = state.find("state");
    const std::string name = name_it != state.end() && name_it->is_string() ? name_it->get<std::string>() : "unknown";
    const std::int64_t now = now_ns();
    if (step == "begin") {
      if (name != "idle") {
        return ParkRefusal{false, "park refused: the kernel is " + name +
                                      (parked ? "" : "; a park starts only between cells (state idle): ask again when "
                                                     "the cell has ended")};
      }
      {
        std::lock_guard<std::mutex> jobs(job_mutex);
        if (drain_running) return ParkRefusal{true, "park refused: a drain is running; ask again when it has answered"};
      }
      if (background > 0) {
        return ParkRefusal{true, "park refused: gpucleanup is giving the frameworks' caches back on a thread of its "
                                 "own; ask again in a few seconds"};
      }
      if (automatic && !park_blocker.empty()) return ParkRefusal{false, park_blocker};
      before_park = BeforePark{std::move(state), state_since_ns, state_updated_ns};
      state = json{{"state", "parking"}};
    } else if (step == "parked" || step == "failed") {
      if (parked != 1) {
        return ParkRefusal{false, "park step \"" + step + "\" refused: the kernel is " + name + ", not parking"};
      }
      if (step == "failed" && before_park) {
        // Idle again as if no park had been asked for: the same object, idle since the same time.
        state = std::move(before_park->state);
        state_since_ns = before_park->since_ns;
        state_updated_ns = before_park->updated_ns;
        before_park.reset();
        after = state;
        after["since_ns"] = state_since_ns;
        return std::nullopt;
      }
      before_park.reset();  // parked: what comes next is the resume's own state
      state = step == "parked" ? json{{"state", "parked"}, {"bytes", bytes ? json(*bytes) : json(nullptr)}}
                               : json{{"state", "idle"}};  // no "begin" (set_state() said parking): idle from now
    } else if (step == "resumed") {
      if (parked == 0) return ParkRefusal{false, "park step \"resumed\" refused: the kernel is " + name + ", not parked"};
      before_park.reset();
      json was = state;
      was["since_ns"] = state_since_ns;
      state = then != nullptr ? *then : json{{"state", "idle"}};
      state_since_ns = now;
      state_updated_ns = now;
      after = state;
      after["since_ns"] = now;
      after["was"] = std::move(was);  // what the park was: its bytes, since when
      return std::nullopt;
    } else {
      return ParkRefusal{false, "unknown park step \"" + step + "\": use begin, parked, failed or resumed"};
    }
    state_since_ns = now;
    state_updated_ns = now;
    after = state;
    after["since_ns"] = now;
    return std::nullopt;
  }

  bool parked_now() {
    std::lock_guard<std::mutex> lock(state_mutex);
    return park_state_locked() != 0;
  }

  // The freshest snapshot available within snapshot_timeout_s of the request
  // that started it; a stuck hook makes replies stale, never late.
  void add_snapshot(json& reply) {
    std::unique_lock<std::mutex> lock(job_mutex);
    if (!hooks.snapshot) {
      reply["snapshot"] = nullptr;
      reply["snapshot_status"] = "unavailable";
      reply["snapshot_age_s"] = nullptr;
      reply["snapshot_error"] = "this server has no snapshot hook";
      return;
    }
    if (snapshot_done == snapshot_requested) {
      ++snapshot_requested;
      snapshot_started = steady::now();
      job_cv.notify_all();
    }
    const std::uint64_t target = snapshot_requested;
    // Bounded (to_duration): a timeout of centuries must not overflow the clock.
    const auto deadline = snapshot_started + to_duration(config.snapshot_timeout_s);
    const bool fresh = snapshot_cv.wait_until(lock, deadline, [&] { return snapshot_done >= target; });
    reply["snapshot"] = last_snapshot;
    if (last_snapshot.is_null()) {
      reply["snapshot_status"] = "unavailable";
      reply["snapshot_age_s"] = nullptr;
    } else {
      reply["snapshot_status"] = fresh && last_snapshot_error.empty() ? "fresh" : "stale";
      reply["snapshot_age_s"] = static_cast<double>(now_ns() - last_snapshot_ns) / 1e9;
    }
    reply["snapshot_error"] = last_snapshot_error.empty() ? json(nullptr) : json(last_snapshot_error);
  }

  json status_reply(bool is_signed) {
    const std::int64_t now = now_ns();
    json reply{{"ok", true}, {"kind", "status"}, {"kernel", config.kernel}, {"state", state_view(now)}};
    bool draining = false;
    {
      std::lock_guard<std::mutex> lock(job_mutex);
      draining = drain_running;
    }
    {
      std::lock_guard<std::mutex> lock(state_mutex);
      reply["last_record"] = history.empty() ? json(nullptr) : json::parse(history.back());
      reply["server"] = {{"pid", static_cast<long long>(getpid())},
                         {"endpoint", endpoint},
                         {"pub_endpoint", pub_endpoint},
                         {"started_ns", started_ns},
                         {"uptime_s", static_cast<double>(now - started_ns) / 1e9},
                         {"requests", requests},
                         {"errors", errors},
                         {"records", published},
                         {"history_size", history.size()},
                         {"history_limit", config.history_limit},
                         {"require_signature", config.require_signature},
                         {"drain_enabled", !config.key.empty()},
                         {"drain_running", draining},
                         {"request_signed", is_signed}};
    }
    reply["connections"] = connections_view();
    add_snapshot(reply);
    return reply;
  }

  json history_reply(std::optional<std::size_t> requested) {
    const std::size_t limit = std::min<std::size_t>(config.history_limit, requested.value_or(config.history_limit));
    std::lock_guard<std::mutex> lock(state_mutex);
    json records = json::array();
    const std::size_t skip = history.size() > limit ? history.size() - limit : 0;
    for (std::size_t i = skip; i < history.size(); ++i) records.push_back(json::parse(history[i]));
    return json{{"ok", true},
                {"kind", "history"},
                {"kernel", config.kernel},
                {"records", std::move(records)},
                {"history_limit", config.history_limit},
                {"records_total", published}};
  }

  // A drain request that passed the check (signed, under a key, timeout_s in bounds).
  void accept_drain(const std::vector<std::string>& envelope, const json& id, double timeout_s) {
    // state, then jobs: the order park_transition takes them, so a park and a drain never both start.
    std::lock_guard<std::mutex> state_lock(state_mutex);
    state_locked();
    const auto it = state.find("state");
    const std::string state_name = it != state.end() && it->is_string() ? it->get<std::string>() : "unknown";
    if (state_name != "idle") {
      reject("411", "drain refused: the kernel is " + state_name + "; a drain runs only between cells (state idle)");
    }
    std::lock_guard<std::mutex> lock(job_mutex);
    if (drain_running) reject("412", "drain refused: another drain is still running; ask again when it has answered");
    drain_running = true;
    drain_job = timeout_s;
    pending_drain = PendingDrain{envelope, id, timeout_s, request_fd};
    job_cv.notify_all();
  }

  void finish_drain() {
    std::optional<json> result;
    {
      std::lock_guard<std::mutex> lock(job_mutex);
      if (!drain_result) return;
      result = std::move(drain_result);
      drain_result.reset();
      drain_running = false;
    }
    if (!pending_drain) return;
    const PendingDrain pending = std::move(*pending_drain);
    pending_drain.reset();
    router_peers.touch(pending.fd, steady::now());
    if (result->contains("error")) {
      send_error(pending.envelope, pending.id,
                 Rejection{"gpucleanup.server.417", "drain failed: " + (*result)["error"].get<std::string>()});
      return;
    }
    send_reply(pending.envelope, json{{"ok", true},
                                      {"kind", "drain"},
                                      {"id", pending.id},
                                      {"kernel", config.kernel},
                                      {"timeout_s", pending.timeout_s},
                                      {"result", std::move((*result)["result"])}});
  }

  void flush_outbox() {
    std::deque<std::string> out;
    {
      std::lock_guard<std::mutex> lock(state_mutex);
      out.swap(outbox);
    }
    for (const auto& body : out) {
      const std::string signature = sign(body);
      std::array<zmq::const_buffer, 3> frames{zmq::buffer(std::string_view("record")),
                                              zmq::const_buffer(signature.data(), signature.size()),
                                              zmq::const_buffer(body.data(), body.size())};
      // PUB drops for slow subscribers rather than block the server.
      (void)zmq::send_multipart(pub, frames, zmq::send_flags::dontwait);
    }
  }

  void handle(std::vector<zmq::message_t>& frames) {
    ++requests;
    std::vector<std::string_view> views;
    views.reserve(frames.size());
    for (const auto& frame : frames) views.emplace_back(static_cast<const char*>(frame.data()), frame.size());
    const CheckedRequest request = check.check(views, now_ns());
    std::vector<std::string> envelope;
    for (std::size_t i = 0; i < request.envelope && i < frames.size(); ++i) envelope.emplace_back(frames[i].to_string());
    // Keeps the peer's connection from being dropped as idle.
    request_authenticated = request.authenticated;
    try {
      if (request.rejection) throw *request.rejection;
      json reply;
      switch (request.kind) {
        case RequestKind::status:
          reply = status_reply(request.is_signed);
          break;
        case RequestKind::history:
          reply = history_reply(request.limit);
          break;
        case RequestKind::ping:
          reply = json{{"ok", true}, {"kind", "ping"}, {"kernel", config.kernel}};
          break;
        case RequestKind::drain:
          accept_drain(envelope, request.id, request.timeout_s);
          return;  // answered when the hook is done
        case RequestKind::park: {
          json after;
          if (auto refused = park_transition(request.park_step, request.bytes, after, nullptr, request.automatic)) {
            reject(refused->passing ? "421" : "420", std::move(refused->message));
          }
          reply = json{{"ok", true}, {"kind", "park"}, {"kernel", config.kernel}, {"step", request.park_step},
                       {"state", std::move(after)}};
          break;
        }
      }
      reply["id"] = request.id;
      send_reply(envelope, std::move(reply));
    } catch (const Rejection& rejection) {
      send_error(envelope, request.id, rejection);
    }
  }

  void serve() {
    std::vector<zmq::pollitem_t> items{{router.handle(), 0, ZMQ_POLLIN, 0}, {wake_rx.handle(), 0, ZMQ_POLLIN, 0}};
    for (PeerGuard* guard : {&router_peers, &pub_peers}) {
      if (guard->active()) items.push_back({guard->monitor_handle(), 0, ZMQ_POLLIN, 0});
    }
    if (zap.handle() != nullptr) items.push_back({zap.handle(), 0, ZMQ_POLLIN, 0});
    while (!stopping.load()) {
      try {
        zmq::poll(items.data(), items.size(), poll_timeout());
        if (items[1].revents & ZMQ_POLLIN) {
          zmq::message_t ignored;
          while (wake_rx.recv(ignored, zmq::recv_flags::dontwait)) {
          }
        }
        if (stopping.load()) break;
        // The handshakes waiting, then the connections they belong to.
        std::vector<std::vector<zmq::message_t>> handshakes = read_zap_requests();
        // Before the requests, so that a request's connection is known.
        guard_connections();
        answer_zap_requests(handshakes);
        flush_outbox();
        finish_drain();
        if (items[0].revents & ZMQ_POLLIN) {
          // Bounded, so a flood of requests cannot starve the outbox.
          for (int i = 0; i < 256; ++i) {
            std::vector<zmq::message_t> frames;
            if (!zmq::recv_multipart(router, std::back_inserter(frames), zmq::recv_flags::dontwait)) break;
            // ZMQ_SRCFD: the connection the message came in on (libzmq 4.3 still sets it).
            request_fd = frames.empty() ? -1 : zmq_msg_get(frames.back().handle(), ZMQ_SRCFD);
            request_authenticated = false;
            handle(frames);
            if (request_authenticated && request_fd >= 0) router_peers.touch(request_fd, steady::now());
            request_fd = -1;
          }
        }
      } catch (const zmq::error_t& error) {
        if (error.num() == ETERM) break;
        if (error.num() != EINTR) ++errors;
      } catch (...) {
        ++errors;
      }
    }
    try {
      if (pending_drain) {
        send_error(pending_drain->envelope, pending_drain->id,
                   Rejection{"gpucleanup.server.416", "the server stopped before the drain finished"});
        pending_drain.reset();
      }
    } catch (...) {
    }
  }

  void work() {
    std::unique_lock<std::mutex> lock(job_mutex);
    while (true) {
      job_cv.wait(lock, [&] { return worker_stop || snapshot_done < snapshot_requested || drain_job.has_value(); });
      if (worker_stop) return;
      if (snapshot_done < snapshot_requested) {
        const std::uint64_t target = snapshot_requested;
        lock.unlock();
        json snapshot;
        std::string error;
        try {
          // A parked process's driver calls wait until it is restored: none is made.
          if (parked_now()) throw std::runtime_error("the kernel is parked: its GPU memory is in host memory, "
                                                     "and no driver call is made until its next cell resumes it");
          snapshot = hooks.snapshot();
        } catch (const std::exception& e) {
          error = e.what();
        } catch (...) {
          error = "unknown exception";
        }
        lock.lock();
        if (error.empty()) {
          last_snapshot = std::move(snapshot);
          last_snapshot_ns = now_ns();
          last_snapshot_error.clear();
        } else {
          last_snapshot_error = "snapshot failed: " + error;
        }
        snapshot_done = target;
        snapshot_cv.notify_all();
        continue;
      }
      const double timeout_s = *drain_job;
      drain_job.reset();
      lock.unlock();
      json outcome;
      try {
        if (!hooks.drain) throw std::runtime_error("this server has no drain hook");
        outcome = json{{"result", hooks.drain(timeout_s)}};
      } catch (const std::exception& e) {
        outcome = json{{"error", e.what()}};
      } catch (...) {
        outcome = json{{"error", "unknown exception"}};
      }
      lock.lock();
      drain_result = std::move(outcome);
      lock.unlock();
      wake();
      lock.lock();
    }
  }

  void close_sockets() noexcept {
    // libzmq leaves the socket files of a closed listener behind.
    for (const std::string* bound : {&endpoint, &pub_endpoint}) {
      if (scheme_of(*bound) != "ipc") continue;
      struct stat info {};
      const std::string path = bound->substr(6);
      if (lstat(path.c_str(), &info) == 0 && S_ISSOCK(info.st_mode)) unlink(path.c_str());
    }
    endpoint.clear();
    pub_endpoint.clear();
    {
      std::lock_guard<std::mutex> lock(wake_mutex);
      wake_open = false;
      wake_tx.close();
    }
    for (zmq::socket_t* socket : {&router, &pub}) {
      if (socket->handle() != nullptr) (void)zmq_socket_monitor(socket->handle(), nullptr, 0);
    }
    router_peers.close();
    pub_peers.close();
    router.close();
    pub.close();
    zap.close();
    wake_rx.close();
    own_context.reset();
    context = nullptr;
  }
};

StatusServer::StatusServer(ServerConfig config, ServerHooks hooks)
    : impl_(std::make_unique<Impl>(std::move(config), std::move(hooks))) {}

StatusServer::~StatusServer() { stop(); }

nlohmann::json StatusServer::start() {
  if (!impl_) GPUCLEANUP_FAIL("gpucleanup.server.509", "this status server was abandoned by fork(): make a new one");
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lifecycle(s.lifecycle);
  if (s.started) GPUCLEANUP_FAIL("gpucleanup.server.509", "the status server is already running: stop it first");
  validate(s.config);
  if (s.config.endpoint.empty()) GPUCLEANUP_FAIL("gpucleanup.server.501", "the status server needs an endpoint");
  try {
    if (s.config.context != nullptr) {
      s.context = s.config.context;
    } else {
      s.own_context = std::make_unique<zmq::context_t>(1);
      s.context = s.own_context.get();
    }
    const auto frame_limit = static_cast<std::int64_t>(std::min<std::size_t>(
        std::max<std::size_t>(std::size_t{1} << 20, 16 * s.config.max_request_bytes), std::size_t{1} << 30));
    // A shared context may have its own ZAP handler: then handshakes go
    // without this one (refusals still hold, only a lost request is possible).
    bool zap_bound = false;
    if (s.config.context == nullptr) {
      s.zap = zmq::socket_t(*s.context, zmq::socket_type::router);
      s.zap.set(zmq::sockopt::linger, 0);
      s.zap.bind("inproc://zeromq.zap.01");
      zap_bound = true;
    }
    static std::atomic<std::uint64_t> generation{0};
    const std::string tag = std::to_string(reinterpret_cast<std::uintptr_t>(&s)) + "-" + std::to_string(++generation);
    auto bind = [&](zmq::socket_t& socket, PeerGuard& peers, const std::string& where, const char* name) {
      socket.set(zmq::sockopt::linger, 0);
      if (scheme_of(where) == "tcp" && tcp_host(where).front() == '[') socket.set(zmq::sockopt::ipv6, 1);
      // A peer gets this long to finish the ZMTP handshake (raw connections
      // that never speak are closed), and must answer heartbeats to stay.
      socket.set(zmq::sockopt::handshake_ivl, milliseconds_option(s.config.handshake_timeout_s));
      if (s.config.heartbeat_interval_s > 0) {
        socket.set(zmq::sockopt::heartbeat_ivl, std::max(1, milliseconds_option(s.config.heartbeat_interval_s)));
        socket.set(zmq::sockopt::heartbeat_timeout, std::max(3, milliseconds_option(3 * s.config.heartbeat_interval_s)));
      }
      const std::string scheme = scheme_of(where);
      if (scheme == "tcp" || scheme == "ipc") {
        peers.attach(*s.context, socket, "inproc://gpucleanup-status-monitor-" + tag + "-" + name);
        if (zap_bound) socket.set(zmq::sockopt::zap_domain, "gpucleanup-status");
      }
      try {
        socket.bind(where);
      } catch (const zmq::error_t& error) {
        GPUCLEANUP_FAIL("gpucleanup.server.505", "cannot bind " + where + ": " + error.what() +
                                                     " (is the path too long for a socket, or the name taken?)");
      }
      std::string bound = socket.get(zmq::sockopt::last_endpoint);
      restrict_ipc_socket(bound);
      peers.listen(bound);
      return bound;
    };
    s.router = zmq::socket_t(*s.context, zmq::socket_type::router);
    // Beyond this a peer is disconnected without a reply: a memory bound, far
    // above max_request_bytes, which gets its own error reply.
    s.router.set(zmq::sockopt::maxmsgsize, frame_limit);
    s.endpoint = bind(s.router, s.router_peers, s.config.endpoint, "router");
    s.pub = zmq::socket_t(*s.context, zmq::socket_type::pub);
    s.pub_endpoint = bind(s.pub, s.pub_peers,
                          s.config.pub_endpoint.empty() ? derive_pub_endpoint(s.config.endpoint) : s.config.pub_endpoint,
                          "pub");
    const std::string wake = "inproc://gpucleanup-status-wake-" + std::to_string(reinterpret_cast<std::uintptr_t>(&s));
    s.wake_rx = zmq::socket_t(*s.context, zmq::socket_type::pair);
    s.wake_rx.set(zmq::sockopt::linger, 0);
    s.wake_rx.bind(wake);
    {
      std::lock_guard<std::mutex> lock(s.wake_mutex);
      s.wake_tx = zmq::socket_t(*s.context, zmq::socket_type::pair);
      s.wake_tx.set(zmq::sockopt::linger, 0);
      s.wake_tx.connect(wake);
      s.wake_open = true;
    }
  } catch (const Error&) {
    s.close_sockets();
    throw;
  } catch (const std::exception& e) {
    s.close_sockets();
    GPUCLEANUP_FAIL("gpucleanup.server.505", std::string("cannot start the status server: ") + e.what());
  }
  s.stopping = false;
  s.worker_stop = false;
  s.started_ns = now_ns();
  s.requests = s.errors = 0;
  s.refused_connections = 0;
  s.dropped_idle = 0;
  s.next_tick = steady::now();
  s.check = RequestCheck(s.config);
  s.owner_pid = getpid();
  s.worker = std::thread([&s] { s.work(); });
  s.thread = std::thread([&s] { s.serve(); });
  s.started = true;
  return json{{"endpoint", s.endpoint}, {"pub_endpoint", s.pub_endpoint}};
}

void StatusServer::stop() noexcept {
  if (!impl_) return;
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lifecycle(s.lifecycle);
  if (!s.started) return;
  if (getpid() != s.owner_pid) {
    // A forked child has the memory but not the threads: joining them would
    // hang and libzmq's context is unusable here. Leave all of it alone.
    (void)impl_.release();
    return;
  }
  s.stopping = true;
  s.wake();
  if (s.thread.joinable()) s.thread.join();
  {
    std::lock_guard<std::mutex> lock(s.job_mutex);
    s.worker_stop = true;
    s.drain_job.reset();
    s.drain_result.reset();
    s.drain_running = false;
  }
  s.job_cv.notify_all();
  if (s.worker.joinable()) s.worker.join();
  s.close_sockets();
  s.started = false;
}

void StatusServer::set_state(nlohmann::json state) {
  if (!state.is_object()) {
    GPUCLEANUP_FAIL("gpucleanup.server.507", "state must be a JSON object such as {\"state\": \"idle\"}, got " + dump(state));
  }
  if (!impl_) return;
  const std::int64_t now = now_ns();
  std::int64_t since = now;
  if (const auto it = state.find("since_ns"); it != state.end() && it->is_number_integer()) since = it->get<std::int64_t>();
  std::lock_guard<std::mutex> lock(impl_->state_mutex);
  if (impl_->park_state_locked() != 0) return;  // only park_step ends a park
  impl_->cell_state.reset();
  impl_->state = std::move(state);
  impl_->state_since_ns = since;
  impl_->state_updated_ns = now;
}

int StatusServer::set_cell_state(bool running, std::int64_t cell) noexcept {
  if (!impl_) return 0;
  const std::int64_t now = now_ns();
  std::lock_guard<std::mutex> lock(impl_->state_mutex);
  if (const int parked = impl_->park_state_locked(); parked != 0) return parked;  // only park_step ends a park
  impl_->cell_state = Impl::CellState{running, cell < 0 ? -1 : cell};
  impl_->state_since_ns = now;
  impl_->state_updated_ns = now;
  return 0;
}

nlohmann::json StatusServer::park_step(const std::string& step, std::optional<std::int64_t> bytes,
                                       const nlohmann::json* then) {
  if (!impl_) GPUCLEANUP_FAIL("gpucleanup.server.509", "park step refused: the status server is not running");
  if (then != nullptr && (step != "resumed" || !then->is_object())) {
    GPUCLEANUP_FAIL("gpucleanup.server.509", "park step refused: only \"resumed\" takes the state to go to, an object");
  }
  nlohmann::json after;
  if (auto refused = impl_->park_transition(step, bytes, after, then)) {
    GPUCLEANUP_FAIL(refused->passing ? "gpucleanup.server.510" : "gpucleanup.server.509", refused->message);
  }
  return after;
}

int StatusServer::background(bool begin) noexcept {
  if (!impl_) return 0;
  try {
    std::lock_guard<std::mutex> lock(impl_->state_mutex);
    if (!begin) {
      if (impl_->background > 0) --impl_->background;
      return 0;
    }
    if (const int parked = impl_->park_state_locked(); parked != 0) return parked;
    ++impl_->background;
    return 0;
  } catch (...) {
    return 0;
  }
}

void StatusServer::set_park_blocker(std::string why) noexcept {
  if (!impl_) return;
  try {
    std::lock_guard<std::mutex> lock(impl_->state_mutex);
    impl_->park_blocker = std::move(why);
  } catch (...) {
  }
}

int StatusServer::park_state() const noexcept {
  if (!impl_) return 0;
  try {
    std::lock_guard<std::mutex> lock(impl_->state_mutex);
    return impl_->park_state_locked();
  } catch (...) {
    return 0;
  }
}

void StatusServer::publish(const nlohmann::json& record) {
  if (!record.is_object()) {
    GPUCLEANUP_FAIL("gpucleanup.server.508", "a cell record must be a JSON object, got " + dump(record));
  }
  publish_text(dump(record));
}

namespace {

// What a record published on tcp keeps. Any local user can subscribe to a tcp PUB socket (ZeroMQ has no access
// control there), so what goes out is built from an allow-list of the memory figures (share/schema/
// cell_record.schema.json): a field added to the record later stays private until it is named here. Left out:
// the notes, the variables and output entries that hold memory, the traced allocation sites (file names, lines,
// functions), what frameworks printed; the kernel's description goes as its pid only (publish_text). The full
// record stays in the history, which answers signed requests only on tcp.
const char* const kPublicRecordFields[] = {"cell",    "time_ns",  "elapsed_s", "driver_state", "interrupted",
                                           "devices", "pinned",   "gc",        "touched",      "shown",
                                           "release", "deferred", "idle",      "totals"};
// Of each entry of "devices": its figures. "message" (a driver or framework message) is left out.
const char* const kPublicDeviceFields[] = {"index",         "name",           "state",
                                           "settle",        "total_bytes",    "used_at_start_bytes",
                                           "used_before_bytes", "used_after_bytes", "freed_bytes",
                                           "live_bytes",    "cached_bytes",   "quiet",
                                           "outside_bytes", "outside_growth_bytes"};

template <std::size_t N>
json allowed_fields(const json& from, const char* const (&names)[N]) {
  json out = json::object();
  for (const char* name : names) {
    if (const auto it = from.find(name); it != from.end()) out[name] = *it;
  }
  return out;
}

std::string public_record_text(const std::string& record) {
  const json value = json::parse(record, nullptr, false);
  if (!value.is_object()) return "{}";
  json out = allowed_fields(value, kPublicRecordFields);
  if (const auto devices = out.find("devices"); devices != out.end()) {
    json kept = json::array();
    if (devices->is_array()) {
      for (const json& device : *devices) {
        if (device.is_object()) kept.push_back(allowed_fields(device, kPublicDeviceFields));
      }
    }
    *devices = std::move(kept);
  }
  return dump(out);
}

}  // namespace

void StatusServer::publish_text(std::string record) {
  if (!impl_) return;
  Impl& s = *impl_;
  const bool open_to_others = scheme_of(s.config.endpoint) == "tcp";
  const std::string public_text = open_to_others ? public_record_text(record) : std::string();
  {
    std::lock_guard<std::mutex> lock(s.state_mutex);
    ++s.published;
    // The message as dump() writes it (keys in order), with the record's text inside; on tcp the public copy,
    // and of the kernel only its pid.
    if (open_to_others) {
      json kernel = json::object();
      if (const auto it = s.config.kernel.find("pid"); s.config.kernel.is_object() && it != s.config.kernel.end()) {
        kernel["pid"] = *it;
      }
      s.outbox.push_back(record_message(kernel, public_text, s.published, now_ns()));
    } else {
      s.outbox.push_back(record_message(s.config.kernel, record, s.published, now_ns()));
    }
    // Nobody reads a stopped server's outbox; the history is what survives.
    while (s.outbox.size() > std::max<std::size_t>(s.config.history_limit, 1)) s.outbox.pop_front();
    s.history.push_back(std::move(record));
    while (s.history.size() > s.config.history_limit) s.history.pop_front();
  }
  s.wake();
}

nlohmann::json StatusServer::connections() const {
  if (!impl_) return json{{"max_peers", 0}, {"peers", 0}, {"pub_peers", 0}, {"refused_connections", 0},
                          {"dropped_idle", 0}, {"peer_idle_timeout_s", 0}};
  return impl_->connections_view();
}

bool StatusServer::running() const noexcept {
  if (!impl_) return false;
  std::lock_guard<std::mutex> lifecycle(impl_->lifecycle);
  return impl_->started;
}

}  // namespace gpucleanup
