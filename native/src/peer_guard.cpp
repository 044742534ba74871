#include "peer_guard.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <vector>

#include <zmq_addon.hpp>

#include "status_endpoint.hpp"

namespace gpucleanup {
namespace {

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

bool same_socket(int fd, ino_t inode) {
  struct stat info {};
  return fstat(fd, &info) == 0 && S_ISSOCK(info.st_mode) && info.st_ino == inode;
}

}  // namespace

std::size_t peer_cap(std::size_t max_peers) {
  std::size_t cap = max_peers;
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    cap = std::min<std::size_t>(cap, static_cast<std::size_t>(limit.rlim_cur / 8));
  }
  return std::max<std::size_t>(cap, 1);
}

void PeerGuard::attach(zmq::context_t& context, zmq::socket_t& socket, const std::string& name) {
  if (zmq_socket_monitor(socket.handle(), name.c_str(), ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED) != 0) {
    throw zmq::error_t();
  }
  monitor_ = zmq::socket_t(context, zmq::socket_type::pair);
  monitor_.set(zmq::sockopt::linger, 0);
  monitor_.set(zmq::sockopt::rcvhwm, kMonitorQueue);
  monitor_.connect(name);
}

void PeerGuard::listen(const std::string& bound) {
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

std::uint64_t PeerGuard::read_events(clock::time_point now, const Limits& limits) {
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

void PeerGuard::touch(int fd, clock::time_point now) {
  const auto it = peers_.find(fd);
  if (it != peers_.end() && !it->second.closing) it->second.active = now;
}

std::uint64_t PeerGuard::tick(clock::time_point now, const Limits& limits, std::uint64_t& refused) {
  std::uint64_t dropped = 0;
  for (auto it = peers_.begin(); it != peers_.end();) {
    Peer& peer = it->second;
    if (!same_socket(it->first, peer.inode)) {
      if (!peer.closing) --live_;
      it = peers_.erase(it);
      continue;
    }
    if (!peer.closing && requests_ && limits.idle_timeout > clock::duration::zero() && it->first != limits.busy_fd &&
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

void PeerGuard::close() noexcept {
  monitor_.close();
  peers_.clear();
  live_ = 0;
  events_since_scan_ = 0;
  family_ = AF_UNSPEC;
}

// A connected socket accepted on this listener: its inode, else 0.
ino_t PeerGuard::accepted_here(int fd) const {
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

void PeerGuard::close_peer(int fd, Peer& peer) {
  (void)shutdown(fd, SHUT_RDWR);
  if (!peer.closing) --live_;
  peer.closing = true;
  peer.closing_since = clock::now();
}

// A new connection: kept while under the cap; at the cap a request socket
// drops its peer idle longest (idle for the grace at least) to make room;
// the records socket (whose subscribers never send anything to tell them
// apart) makes room for a newcomer of this process's own user on tcp by
// dropping the oldest peer of another user, so that other local users
// cannot lock the owner out of its own records; otherwise the newcomer is
// refused. Returns 1 if one was refused.
std::uint64_t PeerGuard::admit(int fd, clock::time_point now, const Limits& limits) {
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

void PeerGuard::forget(int fd) {
  const auto it = peers_.find(fd);
  if (it == peers_.end()) return;
  if (!it->second.closing) --live_;
  peers_.erase(it);
}

// The connections of this listener that no event announced.
std::uint64_t PeerGuard::rescan(clock::time_point now, const Limits& limits) {
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

}  // namespace gpucleanup
