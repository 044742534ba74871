// What a status server's endpoint is and may be: its scheme and host, the
// checks that keep it private to the user (a 0700 directory for ipc, loopback
// and a key for tcp), the publish endpoint derived from it, and the socket
// file an ipc listener leaves behind.
#pragma once

#include <string>

#include "server_config.hpp"

namespace gpucleanup {

// "ipc", "tcp", "inproc", or "" when the endpoint has no "://".
std::string scheme_of(const std::string& endpoint);
// The host of "tcp://host:port" ("[::1]" keeps its brackets).
std::string tcp_host(const std::string& endpoint);
// ipc: "<path>.pub", inproc: "<name>-pub", tcp: the same host on a free port.
std::string derive_pub_endpoint(const std::string& endpoint);
// The endpoint and the publish endpoint of `config`, as start() may bind them;
// throws gpucleanup::Error (gpucleanup.server.501 to 504) naming what to change.
void check_endpoints(const ServerConfig& config);
// A bound ipc socket made 0600 (libzmq creates it with the umask); others untouched.
void restrict_ipc_socket(const std::string& bound);
// The socket file a closed ipc listener leaves behind, removed; others untouched.
void remove_ipc_socket(const std::string& bound) noexcept;

}  // namespace gpucleanup
