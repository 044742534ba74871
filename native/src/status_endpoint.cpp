#include "status_endpoint.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "errors.hpp"

namespace gpucleanup {
namespace {

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

}  // namespace

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

std::string derive_pub_endpoint(const std::string& endpoint) {
  const std::string scheme = scheme_of(endpoint);
  if (scheme == "ipc") return endpoint + ".pub";
  if (scheme == "inproc") return endpoint + "-pub";
  return "tcp://" + tcp_host(endpoint) + ":0";
}

void check_endpoints(const ServerConfig& config) {
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

// The directory already keeps others out; this is the second lock.
void restrict_ipc_socket(const std::string& bound) {
  if (scheme_of(bound) == "ipc") chmod(bound.substr(6).c_str(), 0600);
}

void remove_ipc_socket(const std::string& bound) noexcept {
  if (scheme_of(bound) != "ipc") return;
  struct stat info {};
  const std::string path = bound.substr(6);
  if (lstat(path.c_str(), &info) == 0 && S_ISSOCK(info.st_mode)) unlink(path.c_str());
}

}  // namespace gpucleanup
