// Placeholder until the ZeroMQ status server lands: every start fails with a
// clear message, so the library links and cleanup works without it.
#include "status_server.hpp"

#include "errors.hpp"

namespace gpucleanup {

struct StatusServer::Impl {};

StatusServer::StatusServer(ServerConfig, ServerHooks) : impl_(std::make_unique<Impl>()) {}
StatusServer::~StatusServer() = default;
nlohmann::json StatusServer::start() {
  GPUCLEANUP_FAIL("gpucleanup.server.501", "this build has no status server");
}
void StatusServer::stop() noexcept {}
void StatusServer::set_state(nlohmann::json) {}
void StatusServer::publish(nlohmann::json) {}

}  // namespace gpucleanup
