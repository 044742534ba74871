// The status server against plain lambda hooks: no driver anywhere.
#include "status_server.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "detail/hmac.hpp"
#include "detail/status_replay_guard.hpp"
#include "errors.hpp"

namespace gpucleanup {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

constexpr const char* kKey = "0123abcd-4567-89ef-0123-456789abcdef";

std::int64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

json request(const std::string& kind) {
  static std::atomic<int> counter{0};
  return json{{"protocol", 1}, {"kind", kind}, {"id", "req-" + std::to_string(counter++)}, {"time_ns", now_ns()}};
}

std::size_t count_entries(const char* dir) {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir)) ++n;
  return n;
}

// Polls for a condition instead of sleeping a fixed time.
template <typename Predicate>
bool eventually(Predicate predicate, std::chrono::milliseconds limit = 5000ms) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (predicate()) return true;
    std::this_thread::sleep_for(1ms);
  }
  return predicate();
}

// A DEALER that speaks the protocol the way REQ frames it: [""] + payload.
class Client {
 public:
  Client(zmq::context_t& context, const std::string& endpoint, std::string key = "")
      : socket_(context, zmq::socket_type::dealer), key_(std::move(key)) {
    socket_.set(zmq::sockopt::linger, 0);
    socket_.connect(endpoint);
  }

  void send_frames(const std::vector<std::string>& payload) {
    std::vector<zmq::const_buffer> frames{zmq::const_buffer("", 0)};
    for (const auto& frame : payload) frames.emplace_back(frame.data(), frame.size());
    ASSERT_TRUE(zmq::send_multipart(socket_, frames));
  }

  void send_signed(const std::string& body) { send_frames({detail::hmac_sha256_hex(key_, body), body}); }

  // The reply body, or null after `limit`; the reply's signature is checked.
  json receive(std::chrono::milliseconds limit = 5000ms) {
    zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, limit) == 0) return nullptr;
    std::vector<zmq::message_t> frames;
    EXPECT_TRUE(zmq::recv_multipart(socket_, std::back_inserter(frames)));
    EXPECT_EQ(frames.size(), 3u);
    if (frames.size() != 3) return nullptr;
    EXPECT_EQ(frames[0].size(), 0u);
    const std::string body = frames[2].to_string();
    if (!key_.empty()) {
      EXPECT_TRUE(detail::hmac_sha256_verify(key_, body, frames[1].to_string_view())) << body;
    }
    return json::parse(body);
  }

  json ask(const json& body, bool sign = true) {
    const std::string text = body.dump();
    if (sign && !key_.empty()) {
      send_signed(text);
    } else {
      send_frames({"", text});
    }
    return receive();
  }

 private:
  zmq::socket_t socket_;
  std::string key_;
};

class TempDir {
 public:
  TempDir() {
    char pattern[] = "/tmp/gpucleanup-status-test-XXXXXX";
    path_ = mkdtemp(pattern);  // mode 0700
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct Hooks {
  std::atomic<int> snapshots{0};
  std::atomic<int> drains{0};
  std::atomic<double> last_timeout{-1};  // written by the server's worker thread

  ServerHooks make() {
    return ServerHooks{[this] {
                         ++snapshots;
                         return json{{"kind", "snapshot"}, {"devices", json::array({{{"index", 0}}})}};
                       },
                       [this](double timeout_s) {
                         ++drains;
                         last_timeout = timeout_s;
                         return json{{"kind", "drain"}, {"devices", json::array()}};
                       }};
  }
};

void expect_error(const json& reply, const std::string& id, const std::string& message) {
  ASSERT_TRUE(reply.is_object()) << "no reply";
  EXPECT_EQ(reply["protocol"], 1);
  EXPECT_EQ(reply["ok"], false);
  EXPECT_EQ(reply["kind"], "error");
  EXPECT_EQ(reply["error"]["id"], id);
  EXPECT_EQ(reply["error"]["message"], "[" + id + "] " + message);
}

// A running server on tcp with a key, and a signed client.
class SignedServer : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerConfig config;
    config.endpoint = "tcp://127.0.0.1:*";
    config.key = kKey;
    config.kernel = {{"pid", 42}, {"kernel_id", "abc"}};
    server_ = std::make_unique<StatusServer>(config, hooks_.make());
    const json bound = server_->start();
    endpoint_ = bound["endpoint"];
    client_ = std::make_unique<Client>(context_, endpoint_, kKey);
  }
  void TearDown() override { server_->stop(); }

  void expect_good_status() {
    const json reply = client_->ask(request("status"));
    ASSERT_TRUE(reply.is_object());
    EXPECT_EQ(reply["ok"], true) << reply.dump();
    EXPECT_EQ(reply["kind"], "status");
  }

  zmq::context_t context_;
  Hooks hooks_;
  std::unique_ptr<StatusServer> server_;
  std::string endpoint_;
  std::unique_ptr<Client> client_;
};

TEST(StatusServer, RoundTripOnInproc) {
  zmq::context_t context;
  Hooks hooks;
  ServerConfig config;
  config.endpoint = "inproc://status-round-trip";
  config.context = &context;
  config.kernel = {{"pid", 7}};
  StatusServer server(config, hooks.make());
  const json bound = server.start();
  EXPECT_EQ(bound, (json{{"endpoint", "inproc://status-round-trip"}, {"pub_endpoint", "inproc://status-round-trip-pub"}}));
  server.set_state({{"state", "running"}, {"cell", 3}, {"since_ns", now_ns() - 2'000'000'000}});

  Client client(context, bound["endpoint"]);
  const json ping = client.ask(request("ping"));
  EXPECT_EQ(ping["ok"], true);
  EXPECT_EQ(ping["kind"], "ping");
  EXPECT_EQ(ping["protocol"], 1);

  json status_request = request("status");
  const json status = client.ask(status_request);
  EXPECT_EQ(status["id"], status_request["id"]);
  EXPECT_EQ(status["kernel"], (json{{"pid", 7}}));
  EXPECT_EQ(status["state"]["state"], "running");
  EXPECT_EQ(status["state"]["cell"], 3);
  EXPECT_GE(status["state"]["age_s"].get<double>(), 2.0);
  EXPECT_LT(status["state"]["age_s"].get<double>(), 60.0);
  EXPECT_EQ(status["snapshot"]["devices"][0]["index"], 0);
  EXPECT_EQ(status["snapshot_status"], "fresh");
  EXPECT_EQ(status["last_record"], nullptr);
  EXPECT_EQ(status["server"]["require_signature"], false);
  EXPECT_EQ(status["server"]["request_signed"], false);
  EXPECT_EQ(hooks.snapshots.load(), 1);
  server.stop();
}

TEST_F(SignedServer, RoundTripOnTcpReadsTheEndpointBack) {
  EXPECT_EQ(endpoint_.rfind("tcp://127.0.0.1:", 0), 0u);
  EXPECT_NE(endpoint_, "tcp://127.0.0.1:*");
  EXPECT_NE(endpoint_.substr(endpoint_.rfind(':') + 1), "0");
  const json reply = client_->ask(request("status"));
  EXPECT_EQ(reply["ok"], true);
  EXPECT_EQ(reply["kernel"]["kernel_id"], "abc");
  EXPECT_EQ(reply["state"]["state"], "unknown");
  EXPECT_EQ(reply["server"]["request_signed"], true);
  EXPECT_EQ(reply["server"]["require_signature"], true);
}

TEST(StatusServer, TcpPortZeroIsAnyFreePort) {
  ServerConfig config;
  config.endpoint = "tcp://127.0.0.1:0";
  config.key = kKey;
  StatusServer server(config, {});
  const json bound = server.start();
  const std::string endpoint = bound["endpoint"];
  EXPECT_NE(endpoint.substr(endpoint.rfind(':') + 1), "0");
  zmq::context_t context;
  Client client(context, endpoint, kKey);
  const json reply = client.ask(request("status"));
  EXPECT_EQ(reply["ok"], true);
  EXPECT_EQ(reply["snapshot"], nullptr);
  EXPECT_EQ(reply["snapshot_status"], "unavailable");
}

TEST(StatusServer, RoundTripOnIpcInAPrivateDirectory) {
  TempDir dir;
  ServerConfig config;
  config.endpoint = "ipc://" + dir.path() + "/kernel.sock";
  config.key = kKey;
  Hooks hooks;
  StatusServer server(config, hooks.make());
  const json bound = server.start();
  EXPECT_EQ(bound["endpoint"], config.endpoint);
  EXPECT_EQ(bound["pub_endpoint"], config.endpoint + ".pub");
  struct stat info {};
  ASSERT_EQ(stat((dir.path() + "/kernel.sock").c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0600u);

  zmq::context_t context;
  Client unsigned_client(context, config.endpoint);  // no key: does not check the reply's signature
  EXPECT_EQ(unsigned_client.ask(request("ping"))["ok"], true) << "reads need no signature on ipc";
  Client signed_client(context, config.endpoint, kKey);
  const json reply = signed_client.ask(request("status"));
  EXPECT_EQ(reply["server"]["request_signed"], true);
  server.stop();
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/kernel.sock"));
}

TEST(StatusServer, RefusesAnIpcDirectoryOpenToOthers) {
  TempDir dir;
  ASSERT_EQ(chmod(dir.path().c_str(), 0755), 0);
  ServerConfig config;
  config.endpoint = "ipc://" + dir.path() + "/kernel.sock";
  StatusServer server(config, {});
  try {
    server.start();
    FAIL() << "started in a 0755 directory";
  } catch (const Error& error) {
    EXPECT_EQ(std::string(error.what()), "[gpucleanup.server.504] directory " + dir.path() +
                                             " of ipc endpoint is open to others (mode 0755): use a directory of "
                                             "your own with mode 0700");
  }
  EXPECT_FALSE(server.running());
}

TEST(StatusServer, RefusesTcpBeyondLoopbackAndTcpWithoutKey) {
  ServerConfig wide;
  wide.endpoint = "tcp://0.0.0.0:0";
  wide.key = kKey;
  StatusServer open_to_all(wide, {});
  EXPECT_THROW(
      {
        try {
          open_to_all.start();
        } catch (const Error& error) {
          EXPECT_EQ(error.id(), "gpucleanup.server.502");
          throw;
        }
      },
      Error);

  ServerConfig keyless;
  keyless.endpoint = "tcp://127.0.0.1:0";
  StatusServer no_key(keyless, {});
  try {
    no_key.start();
    FAIL() << "started tcp without a key";
  } catch (const Error& error) {
    EXPECT_EQ(std::string(error.what()),
              "[gpucleanup.server.503] tcp endpoint tcp://127.0.0.1:0 needs a key: every request over tcp is signed");
  }
}

TEST(StatusServer, StartingTwiceFailsAndStopIsIdempotent) {
  ServerConfig config;
  config.endpoint = "tcp://127.0.0.1:*";
  config.key = kKey;
  StatusServer server(config, {});
  server.start();
  EXPECT_TRUE(server.running());
  try {
    server.start();
    FAIL() << "started twice";
  } catch (const Error& error) {
    EXPECT_EQ(std::string(error.what()),
              "[gpucleanup.server.509] the status server is already running: stop it first");
  }
  server.stop();
  server.stop();
  EXPECT_FALSE(server.running());
}

TEST_F(SignedServer, BadSignatureGetsAnErrorAndTheNextRequestSucceeds) {
  const std::string body = request("status").dump();
  client_->send_frames({std::string(64, 'f'), body});
  expect_error(client_->receive(), "gpucleanup.server.403",
               "bad signature: sign the body with HMAC-SHA256 (hex digest) under the key from the kernel's key file");
  client_->send_frames({detail::hmac_sha256_hex("another key", body), body});
  EXPECT_EQ(client_->receive()["error"]["id"], "gpucleanup.server.403");
  expect_good_status();
}

TEST_F(SignedServer, UnsignedRequestOnTcpIsRefused) {
  client_->send_frames({"", request("status").dump()});
  expect_error(client_->receive(), "gpucleanup.server.401",
               "request is not signed: this endpoint needs every request signed with HMAC-SHA256 under the key "
               "from the kernel's key file");
  client_->send_frames({request("status").dump()});
  EXPECT_EQ(client_->receive()["error"]["id"], "gpucleanup.server.401");
  expect_good_status();
}

TEST_F(SignedServer, ReplayedRequestIsRefused) {
  const std::string body = request("ping").dump();
  client_->send_signed(body);
  EXPECT_EQ(client_->receive()["ok"], true);
  client_->send_signed(body);
  expect_error(client_->receive(), "gpucleanup.server.404",
               "duplicate signature: a signed request is accepted once; send a new id and time_ns");
  expect_good_status();
}

TEST_F(SignedServer, StaleAndFutureTimestampsAreRefused) {
  for (const std::int64_t offset : {-120'000'000'000LL, 120'000'000'000LL}) {
    json body = request("status");
    body["time_ns"] = now_ns() + offset;
    expect_error(client_->ask(body), "gpucleanup.server.405",
                 "request time is outside the replay window of 60 s: set \"time_ns\" to the current time "
                 "(CLOCK_REALTIME, ns)");
  }
  json untimed = request("status");
  untimed.erase("time_ns");
  expect_error(client_->ask(untimed), "gpucleanup.server.408",
               "request is malformed: a signed request needs \"time_ns\", the current time in ns");
  expect_good_status();
}

TEST_F(SignedServer, MalformedRequestsGetErrorsAndServingGoesOn) {
  client_->send_signed("{not json");
  expect_error(client_->receive(), "gpucleanup.server.402",
               "request is not valid JSON: send one JSON object per message");
  client_->send_signed("[1, 2]");
  expect_error(client_->receive(), "gpucleanup.server.408", "request is malformed: the body must be a JSON object");
  client_->send_signed(std::string(40, '[') + std::string(40, ']'));
  expect_error(client_->receive(), "gpucleanup.server.408", "request is malformed: nested deeper than 32 levels");
  client_->send_signed("\xff\xfe");
  EXPECT_EQ(client_->receive()["error"]["id"], "gpucleanup.server.402");

  json no_kind = request("status");
  no_kind.erase("kind");
  expect_error(client_->ask(no_kind), "gpucleanup.server.408",
               "request is malformed: \"kind\" must be a string (status, history, drain, park or ping)");
  json version = request("status");
  version["protocol"] = 2;
  expect_error(client_->ask(version), "gpucleanup.server.409",
               "protocol version 2 is not supported: this server speaks protocol 1");
  expect_error(client_->ask(request("reboot")), "gpucleanup.server.410",
               "unknown request kind \"reboot\": use status, history, drain, park or ping");
  client_->send_frames({"a", "b", "c"});
  expect_error(client_->receive(), "gpucleanup.server.407",
               "request must be [signature, body] or [body] after the routing envelope, got 3 frames");
  expect_good_status();
  EXPECT_EQ(hooks_.drains.load(), 0);
}

TEST_F(SignedServer, OversizedRequestGetsAnErrorAndServingGoesOn) {
  json big = request("status");
  big["padding"] = std::string(100 * 1024, 'x');
  const json reply = client_->ask(big);
  ASSERT_TRUE(reply.is_object());
  const std::string size = std::to_string(64 + big.dump().size());
  expect_error(reply, "gpucleanup.server.406",
               "request is too large (" + size + " bytes, limit 65536): send one small JSON object");
  expect_good_status();
}

TEST_F(SignedServer, DrainIsRefusedWhileACellRuns) {
  for (const char* state : {"running", "waiting", "draining"}) {
    server_->set_state({{"state", state}, {"cell", 5}});
    expect_error(client_->ask(request("drain")), "gpucleanup.server.411",
                 std::string("drain refused: the kernel is ") + state + "; a drain runs only between cells (state idle)");
  }
  EXPECT_EQ(hooks_.drains.load(), 0);
}

TEST_F(SignedServer, DrainRunsOnceWhenIdle) {
  server_->set_state({{"state", "idle"}});
  json body = request("drain");
  body["timeout_s"] = 2.5;
  const json reply = client_->ask(body);
  EXPECT_EQ(reply["ok"], true) << reply.dump();
  EXPECT_EQ(reply["kind"], "drain");
  EXPECT_EQ(reply["id"], body["id"]);
  EXPECT_EQ(reply["timeout_s"], 2.5);
  EXPECT_EQ(reply["result"]["kind"], "drain");
  EXPECT_EQ(hooks_.drains.load(), 1);
  EXPECT_EQ(hooks_.last_timeout.load(), 2.5);

  json too_long = request("drain");
  too_long["timeout_s"] = 1e9;
  expect_error(client_->ask(too_long), "gpucleanup.server.408",
               "request is malformed: \"timeout_s\" must be a number of seconds from 0 to 60");
  EXPECT_EQ(hooks_.drains.load(), 1);
}

json park_request(const std::string& step) {
  json body = request("park");
  body["step"] = step;
  return body;
}

TEST_F(SignedServer, ParkStepsMoveTheStateAndOnlyBetweenCells) {
  server_->set_state({{"state", "running"}, {"cell", 3}});
  expect_error(client_->ask(park_request("begin")), "gpucleanup.server.420",
               "park refused: the kernel is running; a park starts only between cells (state idle): ask again when "
               "the cell has ended");
  server_->set_state({{"state", "idle"}});
  json reply = client_->ask(park_request("begin"));
  EXPECT_EQ(reply["ok"], true) << reply.dump();
  EXPECT_EQ(reply["kind"], "park");
  EXPECT_EQ(reply["state"]["state"], "parking");
  EXPECT_EQ(server_->park_state(), 1);

  // A cell's state does not replace the park: the cell finds it and resumes first.
  server_->set_state({{"state", "running"}, {"cell", 4}});
  EXPECT_EQ(server_->park_state(), 1);
  expect_error(client_->ask(park_request("begin")), "gpucleanup.server.420", "park refused: the kernel is parking");
  expect_error(client_->ask(request("drain")), "gpucleanup.server.411",
               "drain refused: the kernel is parking; a drain runs only between cells (state idle)");

  json parked = park_request("parked");
  parked["bytes"] = 1 << 30;
  reply = client_->ask(parked);
  EXPECT_EQ(reply["state"]["state"], "parked") << reply.dump();
  EXPECT_EQ(reply["state"]["bytes"], 1 << 30);
  EXPECT_EQ(server_->park_state(), 2);
  const json status = client_->ask(request("status"));
  EXPECT_EQ(status["state"]["state"], "parked");
  EXPECT_EQ(status["state"]["bytes"], 1 << 30);

  reply = client_->ask(park_request("resumed"));
  EXPECT_EQ(reply["state"]["state"], "idle") << reply.dump();
  EXPECT_EQ(reply["state"]["was"]["state"], "parked");
  EXPECT_EQ(reply["state"]["was"]["bytes"], 1 << 30);
  EXPECT_EQ(reply["state"]["was"]["since_ns"], status["state"]["since_ns"]);
  EXPECT_EQ(server_->park_state(), 0);
  expect_error(client_->ask(park_request("resumed")), "gpucleanup.server.420",
               "park step \"resumed\" refused: the kernel is idle, not parked");
  EXPECT_EQ(hooks_.drains.load(), 0);
}

// A cell's own state (set_cell_state, twice per cell, no JSON object made) reads as set_state's would, in a
// status reply and to a park or a drain; a park in place keeps its state and is answered.
TEST_F(SignedServer, ACellsOwnStateReadsAsTheObjectAndKeepsAPark) {
  EXPECT_EQ(server_->set_cell_state(true, 7), 0);
  json status = client_->ask(request("status"));
  EXPECT_EQ(status["state"]["state"], "running") << status.dump();
  EXPECT_EQ(status["state"]["cell"], 7);
  EXPECT_EQ(status["state"]["since_ns"], status["state"]["updated_ns"]);
  expect_error(client_->ask(park_request("begin")), "gpucleanup.server.420",
               "park refused: the kernel is running; a park starts only between cells (state idle): ask again when "
               "the cell has ended");
  expect_error(client_->ask(request("drain")), "gpucleanup.server.411",
               "drain refused: the kernel is running; a drain runs only between cells (state idle)");
  EXPECT_EQ(server_->set_cell_state(true, -1), 0);
  status = client_->ask(request("status"));
  EXPECT_TRUE(status["state"]["cell"].is_null()) << status.dump();

  EXPECT_EQ(server_->set_cell_state(false, 7), 0);
  status = client_->ask(request("status"));
  EXPECT_EQ(status["state"]["state"], "idle") << status.dump();
  EXPECT_FALSE(status["state"].contains("cell"));
  EXPECT_EQ(client_->ask(park_request("begin"))["state"]["state"], "parking");
  EXPECT_EQ(server_->set_cell_state(true, 8), 1);  // the park stands: the cell resumes first
  EXPECT_EQ(client_->ask(request("status"))["state"]["state"], "parking");
  EXPECT_EQ(client_->ask(park_request("failed"))["state"]["state"], "idle");
  EXPECT_EQ(server_->set_cell_state(true, 8), 0);
  EXPECT_EQ(client_->ask(request("status"))["state"]["cell"], 8);
}

TEST_F(SignedServer, AFailedParkGoesBackToIdleAndParkedNeedsParking) {
  server_->set_state({{"state", "idle"}});
  expect_error(client_->ask(park_request("parked")), "gpucleanup.server.420",
               "park step \"parked\" refused: the kernel is idle, not parking");
  EXPECT_EQ(server_->park_step("begin", std::nullopt)["state"], "parking");
  EXPECT_EQ(server_->park_step("failed", std::nullopt)["state"], "idle");
  EXPECT_EQ(server_->park_state(), 0);
  json bad = park_request("sleep");
  expect_error(client_->ask(bad), "gpucleanup.server.408",
               "request is malformed: a park request needs \"step\": begin, parked, failed, resumed, lost or tracer");
  json negative = park_request("parked");
  negative["bytes"] = -1;
  expect_error(client_->ask(negative), "gpucleanup.server.408",
               "request is malformed: \"bytes\" must be an integer >= 0 or null");
  EXPECT_THROW(server_->park_step("parked", 5), gpucleanup::Error);

  // The kernel's own resume goes straight to the cell's state: no park can begin in between.
  server_->park_step("begin", std::nullopt);
  const json running = {{"state", "running"}, {"cell", 9}};
  EXPECT_THROW(server_->park_step("failed", std::nullopt, &running), gpucleanup::Error);
  const json after = server_->park_step("resumed", std::nullopt, &running);
  EXPECT_EQ(after["state"], "running");
  EXPECT_EQ(after["cell"], 9);
  EXPECT_EQ(after["was"]["state"], "parking");
  EXPECT_EQ(client_->ask(request("status"))["state"]["state"], "running");
}

// A park that did not happen leaves the state as "begin" found it, the same object idle since the same time:
// a fresh idle time would make the kernel look just idle, and the server's automatic park, which remembers a
// refused kernel by its idle time, would try it again every round (issue 41, item 10).
TEST_F(SignedServer, AFailedParkLeavesTheStateAsBeginFoundItIdleSinceTheSameTime) {
  const std::int64_t idle_since = now_ns() - 5'000'000'000;
  server_->set_state({{"state", "idle"}, {"since_ns", idle_since}});
  const json before = client_->ask(request("status"))["state"];
  ASSERT_EQ(before["since_ns"], idle_since) << before.dump();

  EXPECT_EQ(client_->ask(park_request("begin"))["state"]["state"], "parking");
  json reply = client_->ask(park_request("failed"));
  EXPECT_EQ(reply["state"], (json{{"state", "idle"}, {"since_ns", idle_since}})) << reply.dump();
  EXPECT_FALSE(reply["state"].contains("was"));
  json after = client_->ask(request("status"))["state"];
  EXPECT_EQ(after["state"], "idle") << after.dump();
  EXPECT_EQ(after["since_ns"], idle_since);
  EXPECT_EQ(after["updated_ns"], before["updated_ns"]);
  EXPECT_GE(after["age_s"].get<double>(), before["age_s"].get<double>());
  EXPECT_EQ(server_->park_state(), 0);

  // Again, in the kernel's own process: every failed park goes back to the same time, however many there are.
  EXPECT_EQ(server_->park_step("begin", std::nullopt)["state"], "parking");
  const json failed = server_->park_step("failed", std::nullopt);
  EXPECT_EQ(failed, (json{{"state", "idle"}, {"since_ns", idle_since}})) << failed.dump();
  EXPECT_EQ(client_->ask(request("status"))["state"]["since_ns"], idle_since);

  // A cell's own state (set_cell_state, no object until read) goes back as it was too, and a cell that
  // starts next sets its state as ever.
  ASSERT_EQ(server_->set_cell_state(false, 3), 0);
  const json cell_idle = client_->ask(request("status"))["state"];
  ASSERT_EQ(cell_idle["state"], "idle") << cell_idle.dump();
  EXPECT_EQ(client_->ask(park_request("begin"))["state"]["state"], "parking");
  EXPECT_EQ(client_->ask(park_request("failed"))["state"]["since_ns"], cell_idle["since_ns"]);
  after = client_->ask(request("status"))["state"];
  EXPECT_EQ(after["state"], "idle") << after.dump();
  EXPECT_EQ(after["since_ns"], cell_idle["since_ns"]);
  EXPECT_EQ(after["updated_ns"], cell_idle["updated_ns"]);
  EXPECT_FALSE(after.contains("cell"));
  EXPECT_EQ(server_->park_state(), 0);
  EXPECT_EQ(server_->set_cell_state(true, 4), 0);
  after = client_->ask(request("status"))["state"];
  EXPECT_EQ(after["state"], "running") << after.dump();
  EXPECT_EQ(after["cell"], 4);
  EXPECT_GE(after["since_ns"].get<std::int64_t>(), cell_idle["since_ns"].get<std::int64_t>());
}

// What the kernel says keeps an automatic park away refuses only a begin marked automatic, and is said in the
// refusal; a park a person asks for goes on; a blocker taken back lets the policy park again.
TEST_F(SignedServer, AParkBlockerRefusesOnlyAnAutomaticBeginWithTheKernelsSentence) {
  server_->set_state({{"state", "idle"}});
  const std::string why = "[gpucleanup.park.642] 1 thread started in a cell still runs (train-loop)";
  server_->set_park_blocker(why);
  json automatic = park_request("begin");
  automatic["automatic"] = true;
  expect_error(client_->ask(automatic), "gpucleanup.server.420", why);
  EXPECT_EQ(server_->park_state(), 0);
  EXPECT_EQ(client_->ask(request("status"))["state"]["state"], "idle");
  json asked = park_request("begin");
  asked["automatic"] = false;
  EXPECT_EQ(client_->ask(asked)["state"]["state"], "parking");
  EXPECT_EQ(client_->ask(park_request("failed"))["state"]["state"], "idle");
  server_->set_park_blocker("");
  automatic = park_request("begin");
  automatic["automatic"] = true;
  EXPECT_EQ(client_->ask(automatic)["state"]["state"], "parking");
  EXPECT_EQ(client_->ask(park_request("failed"))["state"]["state"], "idle");
  json malformed = park_request("begin");
  malformed["automatic"] = "yes";
  expect_error(client_->ask(malformed), "gpucleanup.server.408",
               "request is malformed: \"automatic\" must be true or false");
  EXPECT_EQ(server_->park_state(), 0);
}

// A park that happened ends as before: "resumed" starts a new state from the resume's time, its "was" the
// park; a failed park after it goes back to that new idle state, not to the one before the first park.
TEST_F(SignedServer, AParkThatHappenedIsResumedFromANewTimeAsBefore) {
  const std::int64_t idle_since = now_ns() - 5'000'000'000;
  server_->set_state({{"state", "idle"}, {"since_ns", idle_since}});
  EXPECT_EQ(server_->park_step("begin", std::nullopt)["state"], "parking");
  const json parked = server_->park_step("parked", 42);
  EXPECT_EQ(parked["state"], "parked") << parked.dump();
  EXPECT_EQ(parked["bytes"], 42);
  EXPECT_GT(parked["since_ns"].get<std::int64_t>(), idle_since);
  const json status = client_->ask(request("status"))["state"];
  EXPECT_EQ(status["since_ns"], parked["since_ns"]);

  const json resumed = client_->ask(park_request("resumed"))["state"];
  EXPECT_EQ(resumed["state"], "idle") << resumed.dump();
  EXPECT_GE(resumed["since_ns"].get<std::int64_t>(), parked["since_ns"].get<std::int64_t>());
  EXPECT_EQ(resumed["was"], (json{{"state", "parked"}, {"bytes", 42}, {"since_ns", parked["since_ns"]}}));
  json after = client_->ask(request("status"))["state"];
  EXPECT_EQ(after["state"], "idle") << after.dump();
  EXPECT_EQ(after["since_ns"], resumed["since_ns"]);
  EXPECT_EQ(after["updated_ns"], resumed["since_ns"]);
  EXPECT_FALSE(after.contains("was"));

  EXPECT_EQ(client_->ask(park_request("begin"))["state"]["state"], "parking");
  EXPECT_EQ(client_->ask(park_request("failed"))["state"]["since_ns"], resumed["since_ns"]);
  after = client_->ask(request("status"))["state"];
  EXPECT_EQ(after["state"], "idle") << after.dump();
  EXPECT_EQ(after["since_ns"], resumed["since_ns"]);
}

// The id of the error a park's "begin" in the kernel's own process fails with ("taken" if it did not fail).
std::string begin_refused_in_process(StatusServer& server) {
  try {
    server.park_step("begin", std::nullopt);
  } catch (const gpucleanup::Error& error) {
    return error.id();
  }
  return "taken";
}

TEST_F(SignedServer, AParkAskedForDuringTheKernelsOwnReleaseIsToldToAskAgainAtOnceNotRefused) {
  server_->set_state({{"state", "idle"}});
  ASSERT_EQ(server_->background(true), 0);
  expect_error(client_->ask(park_request("begin")), "gpucleanup.server.421",
               "park refused: gpucleanup is giving the frameworks' caches back on a thread of its own; ask again in "
               "a few seconds");
  EXPECT_EQ(begin_refused_in_process(*server_), "gpucleanup.server.510");
  EXPECT_EQ(server_->park_state(), 0) << "nothing changed";
  // A refusal that stands (a cell runs) keeps its own ids.
  server_->set_state({{"state", "running"}, {"cell", 2}});
  expect_error(client_->ask(park_request("begin")), "gpucleanup.server.420",
               "park refused: the kernel is running; a park starts only between cells (state idle): ask again when "
               "the cell has ended");
  EXPECT_EQ(begin_refused_in_process(*server_), "gpucleanup.server.509");
  server_->set_state({{"state", "idle"}});
  EXPECT_EQ(server_->background(false), 0);
  EXPECT_EQ(client_->ask(park_request("begin"))["state"]["state"], "parking");
}

// The kernel's own cleanup for a drain from outside ("draining" of no cell) can run the user's finalizers for
// any time: a park is told to ask again (it waits), a drain that no earlier drain answered for is refused, and
// each says the drain is the cause. A cell's own "draining" (its number) stays a cell's refusal.
TEST_F(SignedServer, TheKernelsCleanupForADrainFromOutsideNamesTheDrainAndAParkAsksAgain) {
  server_->set_state({{"state", "draining"}, {"cell", nullptr}});
  const std::string park_says =
      "park refused: a drain from outside (gpucleanup drain, the page's Drain) is running the kernel's own cleanup "
      "(the frameworks' caches, then garbage collection, where objects' finalizers run); it ends by itself: ask "
      "again when the kernel is idle";
  expect_error(client_->ask(park_request("begin")), "gpucleanup.server.421", park_says);
  EXPECT_EQ(begin_refused_in_process(*server_), "gpucleanup.server.510");
  expect_error(client_->ask(request("drain")), "gpucleanup.server.412",
               "drain refused: an earlier drain from outside is still running the kernel's own cleanup (garbage "
               "collection, where objects' finalizers run, or the frameworks' caches); it ends by itself: ask again "
               "when the kernel is idle");
  EXPECT_EQ(server_->park_state(), 0) << "nothing changed";
  EXPECT_EQ(hooks_.drains.load(), 0);

  server_->set_state({{"state", "draining"}, {"cell", 7}});  // a cell's own cleanup
  expect_error(client_->ask(park_request("begin")), "gpucleanup.server.420",
               "park refused: the kernel is draining; a park starts only between cells (state idle): ask again when "
               "the cell has ended");
  EXPECT_EQ(begin_refused_in_process(*server_), "gpucleanup.server.509");

  server_->set_state({{"state", "idle"}});
  EXPECT_EQ(client_->ask(park_request("begin"))["state"]["state"], "parking");
}

TEST_F(SignedServer, NoSnapshotIsTakenWhileParked) {
  server_->set_state({{"state", "idle"}});
  expect_good_status();
  const int before = hooks_.snapshots.load();
  server_->park_step("begin", std::nullopt);
  server_->park_step("parked", 42);
  const json reply = client_->ask(request("status"));
  EXPECT_EQ(reply["ok"], true);
  EXPECT_EQ(reply["snapshot_status"], "stale");
  EXPECT_NE(reply["snapshot_error"].get<std::string>().find("the kernel is parked"), std::string::npos);
  EXPECT_EQ(hooks_.snapshots.load(), before);
}

TEST(StatusServer, ParkAlwaysNeedsASignedRequestUnderAKey) {
  TempDir dir;
  zmq::context_t context;
  Hooks hooks;
  ServerConfig config;
  config.endpoint = "ipc://" + dir.path() + "/k.sock";
  config.key = kKey;
  StatusServer server(config, hooks.make());
  server.start();
  server.set_state({{"state", "idle"}});
  Client client(context, config.endpoint, kKey);
  expect_error(client.ask(park_request("begin"), false), "gpucleanup.server.419",
               "park needs a signed request: sign it with HMAC-SHA256 under the key from the kernel's key file");
  EXPECT_EQ(server.park_state(), 0);

  ServerConfig keyless;
  keyless.endpoint = "inproc://keyless-park";
  keyless.context = &context;
  StatusServer no_key(keyless, hooks.make());
  no_key.start();
  no_key.set_state({{"state", "idle"}});
  Client anyone(context, keyless.endpoint);
  expect_error(anyone.ask(park_request("begin")), "gpucleanup.server.418",
               "park is disabled: this server has no key, and a park step must be signed; start it with a key");
  EXPECT_EQ(no_key.park_state(), 0);
}

TEST(StatusServer, DrainAlwaysNeedsASignature) {
  TempDir dir;
  zmq::context_t context;
  Hooks hooks;
  ServerConfig config;
  config.endpoint = "ipc://" + dir.path() + "/k.sock";
  config.key = kKey;
  StatusServer server(config, hooks.make());
  server.start();
  server.set_state({{"state", "idle"}});
  Client client(context, config.endpoint, kKey);
  expect_error(client.ask(request("drain"), false), "gpucleanup.server.414",
               "drain needs a signed request: sign it with HMAC-SHA256 under the key from the kernel's key file");
  EXPECT_EQ(hooks.drains.load(), 0);
  EXPECT_EQ(client.ask(request("drain"))["ok"], true);
  EXPECT_EQ(hooks.drains.load(), 1);

  ServerConfig keyless;
  keyless.endpoint = "inproc://keyless";
  keyless.context = &context;
  StatusServer no_key(keyless, hooks.make());
  no_key.start();
  no_key.set_state({{"state", "idle"}});
  Client anyone(context, keyless.endpoint);
  expect_error(anyone.ask(request("drain")), "gpucleanup.server.413",
               "drain is disabled: this server has no key, and a drain must be signed; start it with a key");
  EXPECT_EQ(hooks.drains.load(), 1);
}

TEST(StatusServer, HistoryIsBoundedAndRecordsArePublished) {
  zmq::context_t context;
  ServerConfig config;
  config.endpoint = "inproc://history";
  config.context = &context;
  config.history_limit = 5;
  config.kernel = {{"pid", 9}};
  StatusServer server(config, {});
  const json bound = server.start();

  zmq::socket_t subscriber(context, zmq::socket_type::sub);
  subscriber.set(zmq::sockopt::linger, 0);
  subscriber.set(zmq::sockopt::subscribe, "record");
  subscriber.connect(bound["pub_endpoint"].get<std::string>());

  // A subscription takes effect asynchronously: publish until one arrives.
  int cell = 0;
  std::vector<zmq::message_t> frames;
  ASSERT_TRUE(eventually([&] {
    server.publish({{"cell", ++cell}, {"freed_bytes", 1024 * cell}});
    zmq::pollitem_t item{subscriber.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, 10ms) == 0) return false;
    frames.clear();
    return zmq::recv_multipart(subscriber, std::back_inserter(frames)).has_value();
  }));
  ASSERT_EQ(frames.size(), 3u);
  EXPECT_EQ(frames[0].to_string(), "record");
  EXPECT_EQ(frames[1].size(), 0u) << "no key, no signature";
  const json published = json::parse(frames[2].to_string());
  EXPECT_EQ(published["kind"], "record");
  EXPECT_EQ(published["protocol"], 1);
  EXPECT_EQ(published["kernel"], (json{{"pid", 9}}));
  EXPECT_EQ(published["record"]["freed_bytes"], 1024 * published["seq"].get<int>());

  for (int i = 0; i < 7; ++i) server.publish({{"cell", ++cell}});
  Client client(context, bound["endpoint"]);
  const json history = client.ask(request("history"));
  ASSERT_EQ(history["records"].size(), 5u);
  EXPECT_EQ(history["records"][4]["cell"], cell);
  EXPECT_EQ(history["records"][0]["cell"], cell - 4);
  EXPECT_EQ(history["records_total"], cell);
  json two = request("history");
  two["limit"] = 2;
  EXPECT_EQ(client.ask(two)["records"], (json::array({{{"cell", cell - 1}}, {{"cell", cell}}})));
  EXPECT_EQ(client.ask(request("status"))["last_record"], (json{{"cell", cell}}));
}

TEST(StatusServer, RecordsPublishedOnTcpCarryTheMemoryFiguresOnly) {
  // Any local user can subscribe to a tcp PUB socket: names, notes, traced sites and any field not on the
  // allow-list (one added later) stay in the signed history.
  zmq::context_t context;
  ServerConfig config;
  config.endpoint = "tcp://127.0.0.1:0";
  config.key = kKey;
  config.context = &context;
  config.kernel = {{"pid", 9}, {"notebook", "/home/me/secret-project.ipynb"}, {"connection_file", "/run/k.json"}};
  StatusServer server(config, {});
  const json bound = server.start();

  zmq::socket_t subscriber(context, zmq::socket_type::sub);
  subscriber.set(zmq::sockopt::linger, 0);
  subscriber.set(zmq::sockopt::subscribe, "record");
  subscriber.connect(bound["pub_endpoint"].get<std::string>());
  const json record = {{"cell", 3},
                       {"devices", json::array({{{"index", 0}, {"freed_bytes", {{"cupy", 1024}}},
                                                  {"message", "secret driver message"},
                                                  {"added_later", "secret per device"}}})},
                       {"added_later", "a field no allow-list names yet: secret"},
                       {"notes", json::array({"cupy.drain failed: secret_var"})},
                       {"shown_notes", json::array({"cupy.drain failed: secret_var"})},
                       {"hidden", json::array({{{"held_by", "variable"}, {"name", "secret_var"}}})},
                       {"traced", json::array({{{"site", "/home/me/secret.py:12 fit()"}}})},
                       {"unraisable", json::array({{{"message", "secret"}}})}};
  std::vector<zmq::message_t> frames;
  ASSERT_TRUE(eventually([&] {
    server.publish(record);
    zmq::pollitem_t item{subscriber.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, 10ms) == 0) return false;
    frames.clear();
    return zmq::recv_multipart(subscriber, std::back_inserter(frames)).has_value();
  }));
  ASSERT_EQ(frames.size(), 3u);
  const std::string body = frames[2].to_string();
  EXPECT_TRUE(detail::hmac_sha256_verify(kKey, body, frames[1].to_string_view()));
  const json published = json::parse(body);
  EXPECT_EQ(published["kernel"], (json{{"pid", 9}}));
  EXPECT_EQ(published["record"],
            (json{{"cell", 3}, {"devices", json::array({{{"index", 0}, {"freed_bytes", {{"cupy", 1024}}}}})}}));
  EXPECT_EQ(body.find("secret"), std::string::npos) << body;

  Client client(context, bound["endpoint"], kKey);
  const json history = client.ask(request("history"));
  ASSERT_FALSE(history["records"].empty());
  EXPECT_EQ(history["records"].back(), record) << "the owner's signed history keeps the whole record";
}

TEST(StatusServer, StateAndRecordMustBeObjects) {
  StatusServer server(ServerConfig{}, {});
  try {
    server.set_state("idle");
    FAIL();
  } catch (const Error& error) {
    EXPECT_EQ(std::string(error.what()),
              "[gpucleanup.server.507] state must be a JSON object such as {\"state\": \"idle\"}, got \"idle\"");
  }
  EXPECT_THROW(server.publish(json::array()), Error);
}

TEST(StatusServer, ConfigFromJson) {
  const ServerConfig config = server_config_from_json(
      {{"endpoint", "ipc:///tmp/x/s"}, {"key", "k"}, {"kernel", {{"pid", 1}}}, {"history_limit", 7}});
  EXPECT_EQ(config.endpoint, "ipc:///tmp/x/s");
  EXPECT_EQ(config.key, "k");
  EXPECT_EQ(config.history_limit, 7u);
  EXPECT_EQ(config.kernel, (json{{"pid", 1}}));
  EXPECT_EQ(config.max_request_bytes, 64u * 1024);
  try {
    server_config_from_json({{"endpoint", "tcp://127.0.0.1:0"}, {"history_limit", -1}});
    FAIL();
  } catch (const Error& error) {
    EXPECT_EQ(std::string(error.what()),
              "[gpucleanup.server.506] server config \"history_limit\" must be an integer >= 0, got -1");
  }
  EXPECT_THROW(server_config_from_json(json::object()), Error);
}

TEST(StatusServer, StuckSnapshotHookGivesAStaleReplyNotALateOne) {
  zmq::context_t context;
  std::atomic<bool> stuck{false};
  std::atomic<bool> release{false};
  std::atomic<int> calls{0};
  ServerConfig config;
  config.endpoint = "inproc://stuck";
  config.context = &context;
  config.snapshot_timeout_s = 0.05;
  StatusServer server(config, ServerHooks{[&] {
                                            const int n = ++calls;
                                            if (n > 1) {
                                              stuck = true;
                                              while (!release) std::this_thread::sleep_for(1ms);
                                            }
                                            return json{{"n", n}};
                                          },
                                          {}});
  server.start();
  Client client(context, config.endpoint);
  EXPECT_EQ(client.ask(request("status"))["snapshot_status"], "fresh");
  for (int i = 0; i < 3; ++i) {
    const json reply = client.ask(request("status"));
    EXPECT_EQ(reply["snapshot_status"], "stale");
    EXPECT_EQ(reply["snapshot"], (json{{"n", 1}}));
  }
  EXPECT_TRUE(stuck.load());
  EXPECT_EQ(calls.load(), 2) << "one stuck call, not one per request";
  release = true;
  server.stop();
}

// The config takes any number of seconds: converted unbounded, 1e300 s overflowed
// the clock's duration (undefined behaviour; on x86 a deadline in the past, so
// every reply was stale). It is bounded like the other timeouts now.
TEST(StatusServer, ASnapshotTimeoutOfCenturiesWaitsForTheSnapshot) {
  zmq::context_t context;
  ServerConfig config;
  config.endpoint = "inproc://centuries";
  config.context = &context;
  config.snapshot_timeout_s = 1e300;
  StatusServer server(config, ServerHooks{[] { return json{{"n", 1}}; }, {}});
  server.start();
  Client client(context, config.endpoint);
  const json reply = client.ask(request("status"));
  EXPECT_EQ(reply["snapshot_status"], "fresh") << reply.dump();
  EXPECT_EQ(reply["snapshot"], (json{{"n", 1}}));
  server.stop();
}

TEST(StatusServer, StopWhileADrainIsInFlight) {
  zmq::context_t context;
  std::atomic<bool> entered{false};
  std::atomic<bool> done{false};
  ServerConfig config;
  config.endpoint = "inproc://stop-in-flight";
  config.context = &context;
  config.key = kKey;
  StatusServer server(config, ServerHooks{[] { return json::object(); },
                                          [&](double) {
                                            entered = true;
                                            std::this_thread::sleep_for(200ms);
                                            done = true;
                                            return json::object();
                                          }});
  server.start();
  server.set_state({{"state", "idle"}});
  Client client(context, config.endpoint, kKey);
  client.send_signed(request("drain").dump());
  ASSERT_TRUE(eventually([&] { return entered.load(); }));
  server.stop();
  EXPECT_TRUE(done.load()) << "stop waits for the hook it started";
  expect_error(client.receive(), "gpucleanup.server.416", "the server stopped before the drain finished");
  EXPECT_FALSE(server.running());
}

// A drain's hook runs the kernel's cleanup, which can take any time (a finalizer): while it runs, status replies
// carry fresh snapshots (the snapshot worker is not the drain's), ping answers, and a park is told to ask again
// with the drain named as the cause.
TEST(StatusServer, ADrainThatTakesLongHoldsUpNoSnapshotAndAParkIsToldWhy) {
  zmq::context_t context;
  std::atomic<int> snapshots{0};
  std::atomic<bool> entered{false};
  std::atomic<bool> release{false};
  ServerConfig config;
  config.endpoint = "inproc://long-drain";
  config.context = &context;
  config.key = kKey;
  config.snapshot_timeout_s = 5;  // a snapshot queued behind the drain would come late, not stale
  StatusServer server(config, ServerHooks{[&] { return json{{"n", ++snapshots}}; },
                                          [&](double) {
                                            entered = true;
                                            for (int i = 0; i < 30000 && !release.load(); ++i) {
                                              std::this_thread::sleep_for(1ms);
                                            }
                                            return json{{"kind", "drain"}};
                                          }});
  server.start();
  server.set_state({{"state", "idle"}});
  Client drainer(context, config.endpoint, kKey);
  drainer.send_signed(request("drain").dump());
  ASSERT_TRUE(eventually([&] { return entered.load(); }));

  Client client(context, config.endpoint, kKey);
  for (int i = 1; i <= 3; ++i) {
    const json reply = client.ask(request("status"));
    ASSERT_TRUE(reply.is_object()) << "no status reply during the drain";
    EXPECT_EQ(reply["snapshot_status"], "fresh") << reply.dump();
    EXPECT_EQ(reply["snapshot"]["n"], i);
    EXPECT_EQ(reply["server"]["drain_running"], true);
  }
  EXPECT_EQ(client.ask(request("ping"))["ok"], true);
  expect_error(client.ask(park_request("begin")), "gpucleanup.server.421",
               "park refused: a drain from outside (gpucleanup drain, the page's Drain) is waiting for the kernel's "
               "queued GPU work, at most its time limit; it ends by itself: ask again when it has answered");
  EXPECT_FALSE(release.load()) << "all of it answered while the drain's hook still ran";
  release = true;
  const json drained = drainer.receive();
  ASSERT_TRUE(drained.is_object());
  EXPECT_EQ(drained["ok"], true) << drained.dump();
  EXPECT_EQ(client.ask(park_request("begin"))["state"]["state"], "parking");
  server.stop();
}

TEST(StatusServer, StopWhileRequestsArrive) {
  zmq::context_t context;
  ServerConfig config;
  config.endpoint = "inproc://stop-busy";
  config.context = &context;
  Hooks hooks;
  StatusServer server(config, hooks.make());
  server.start();
  Client client(context, config.endpoint);
  for (int i = 0; i < 20; ++i) client.send_frames({"", request("status").dump()});
  server.stop();
  EXPECT_FALSE(server.running());
}

TEST(StatusServer, StartStopManyTimesLeaksNoThreadOrDescriptor) {
  TempDir dir;
  auto cycle = [&](int i) {
    ServerConfig config;
    config.endpoint = i % 2 ? "ipc://" + dir.path() + "/s" : "tcp://127.0.0.1:*";
    config.key = kKey;
    Hooks hooks;
    StatusServer server(config, hooks.make());
    const json bound = server.start();
    server.set_state({{"state", "idle"}});
    server.publish({{"cell", i}});
    zmq::context_t context;
    Client client(context, bound["endpoint"], kKey);
    EXPECT_EQ(client.ask(request("status"))["ok"], true);
    server.stop();
  };
  cycle(0);  // first use sets up whatever the process keeps (libcrypto tables)
  const std::size_t threads = count_entries("/proc/self/task");
  const std::size_t descriptors = count_entries("/proc/self/fd");
  for (int i = 0; i < 50; ++i) cycle(i);
  EXPECT_EQ(count_entries("/proc/self/task"), threads);
  EXPECT_EQ(count_entries("/proc/self/fd"), descriptors);
}

// ---- Connection limits: a hostile neighbour's connections stay bounded ----

// Plain stream connections that never speak ZMTP, as a flood opens them.
class RawPeers {
 public:
  RawPeers() = default;
  RawPeers(const RawPeers&) = delete;
  RawPeers& operator=(const RawPeers&) = delete;
  ~RawPeers() {
    for (const int fd : fds_) ::close(fd);
  }

  // n connections to a "tcp://127.0.0.1:PORT" or "ipc:///path" endpoint.
  void open(const std::string& endpoint, int n) {
    for (int i = 0; i < n; ++i) {
      int fd = -1;
      if (endpoint.rfind("tcp://", 0) == 0) {
        sockaddr_in address{};
        address.sin_family = AF_INET;
        address.sin_port = htons(static_cast<std::uint16_t>(std::stoi(endpoint.substr(endpoint.rfind(':') + 1))));
        address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        ASSERT_GE(fd, 0);
        ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0) << std::strerror(errno);
      } else {
        sockaddr_un address{};
        address.sun_family = AF_UNIX;
        const std::string path = endpoint.substr(6);
        std::strncpy(address.sun_path, path.c_str(), sizeof address.sun_path - 1);
        fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        ASSERT_GE(fd, 0);
        ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0) << std::strerror(errno);
      }
      fds_.push_back(fd);
    }
  }

  // How many the server has closed: their end reads end-of-file (after the
  // greeting libzmq sends first).
  std::size_t closed_by_server() {
    std::size_t closed = 0;
    for (const int fd : fds_) {
      char buffer[256];
      while (true) {
        const ssize_t n = ::recv(fd, buffer, sizeof buffer, MSG_DONTWAIT);
        if (n > 0) continue;
        if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) ++closed;
        break;
      }
    }
    return closed;
  }

  std::size_t size() const { return fds_.size(); }

 private:
  std::vector<int> fds_;
};

// Descriptors of this process that are connections accepted on `endpoint`'s
// tcp port (the server's side of them; clients here have other local ports).
std::size_t accepted_descriptors(const std::string& endpoint) {
  const int port = std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
  std::size_t n = 0;
  // Every descriptor number up to the open-file limit, asked directly: listing /proc/self/fd would open
  // (and close) a descriptor of its own while the server's thread inspects the ones it accepted.
  rlimit limit{};
  ::getrlimit(RLIMIT_NOFILE, &limit);
  const int last = static_cast<int>(std::min<rlim_t>(limit.rlim_cur, 65536));
  for (int fd = 0; fd < last; ++fd) {
    sockaddr_in local{};
    socklen_t length = sizeof local;
    int listening = 0;
    socklen_t size = sizeof listening;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) != 0 || local.sin_family != AF_INET) continue;
    if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &size) != 0 || listening) continue;
    if (ntohs(local.sin_port) == port) ++n;
  }
  return n;
}

ServerConfig limited_tcp_config(std::size_t max_peers) {
  ServerConfig config;
  config.endpoint = "tcp://127.0.0.1:*";
  config.key = kKey;
  config.max_peers = max_peers;
  // Tests that want these set them; by default nothing ends a connection on its own.
  config.handshake_timeout_s = 600;
  config.peer_idle_timeout_s = 0;
  config.peer_grace_s = 600;
  return config;
}

std::uint64_t connection_count(const StatusServer& server, const char* name) {
  return server.connections()[name].get<std::uint64_t>();
}

TEST(StatusServerLimits, OverCapPeersAreRefusedAndCounted) {
  Hooks hooks;
  StatusServer server(limited_tcp_config(4), hooks.make());
  const json bound = server.start();
  const std::string endpoint = bound["endpoint"];
  const std::string pub_endpoint = bound["pub_endpoint"];

  RawPeers requests;
  requests.open(endpoint, 12);
  RawPeers watchers;
  watchers.open(pub_endpoint, 7);
  // The first four of each are kept; every one beyond is closed at once.
  ASSERT_TRUE(eventually([&] { return requests.closed_by_server() == 8 && watchers.closed_by_server() == 3; }))
      << requests.closed_by_server() << " " << watchers.closed_by_server();
  ASSERT_TRUE(eventually([&] { return accepted_descriptors(endpoint) == 4 && accepted_descriptors(pub_endpoint) == 4; }));
  const json connections = server.connections();
  EXPECT_EQ(connections["max_peers"], 4);
  EXPECT_EQ(connections["peers"], 4);
  EXPECT_EQ(connections["pub_peers"], 4);
  EXPECT_EQ(connections["refused_connections"], 11);
  EXPECT_EQ(connections["dropped_idle"], 0);
  EXPECT_EQ(requests.closed_by_server(), 8u);  // the kept ones are still open
  EXPECT_EQ(watchers.closed_by_server(), 3u);
  server.stop();
}

TEST(StatusServerLimits, RefusedCountIsInTheStatusReplyAndSlotsFreeUp) {
  Hooks hooks;
  StatusServer server(limited_tcp_config(3), hooks.make());
  const std::string endpoint = server.start()["endpoint"];
  {
    RawPeers flood;
    flood.open(endpoint, 3);
    ASSERT_TRUE(eventually([&] { return connection_count(server, "peers") == 3; }));
    RawPeers more;
    more.open(endpoint, 5);
    ASSERT_TRUE(eventually([&] { return more.closed_by_server() == 5; }));
    EXPECT_EQ(flood.closed_by_server(), 0u);
    // counted once the transport's round that closed them ends, a moment after a peer sees its close
    EXPECT_TRUE(eventually([&] { return connection_count(server, "refused_connections") == 5u; }))
        << connection_count(server, "refused_connections");
  }
  // The flood went away: its slots are free again, and the reply says what was refused.
  ASSERT_TRUE(eventually([&] { return connection_count(server, "peers") == 0; }));
  zmq::context_t context;
  Client client(context, endpoint, kKey);
  const json reply = client.ask(request("status"));
  ASSERT_TRUE(reply.is_object());
  EXPECT_EQ(reply["ok"], true) << reply.dump();
  EXPECT_EQ(reply["connections"]["refused_connections"], 5);
  EXPECT_EQ(reply["connections"]["max_peers"], 3);
  EXPECT_EQ(reply["connections"]["peers"], 1);
  EXPECT_EQ(reply["connections"]["pub_peers"], 0);
  server.stop();
}

TEST(StatusServerLimits, IdlePeerIsDroppedAndAnActiveOneServed) {
  ServerConfig config = limited_tcp_config(8);
  config.peer_idle_timeout_s = 0.2;
  Hooks hooks;
  StatusServer server(config, hooks.make());
  const std::string endpoint = server.start()["endpoint"];

  RawPeers silent;
  silent.open(endpoint, 2);  // never says anything, not even the ZMTP greeting
  zmq::context_t context;
  zmq::socket_t quiet(context, zmq::socket_type::dealer);  // completes the handshake, then says nothing
  quiet.set(zmq::sockopt::linger, 0);
  quiet.connect(endpoint);
  ASSERT_TRUE(eventually([&] { return silent.closed_by_server() == 2; }));
  ASSERT_TRUE(eventually([&] { return connection_count(server, "dropped_idle") >= 3; }));
  EXPECT_EQ(connection_count(server, "refused_connections"), 0u);

  // A client that asks is served; dropped ones reconnect and are served too.
  Client client(context, endpoint, kKey);
  const json reply = client.ask(request("status"));
  ASSERT_TRUE(reply.is_object());
  EXPECT_EQ(reply["ok"], true) << reply.dump();
  EXPECT_GE(reply["connections"]["dropped_idle"].get<int>(), 3);
  EXPECT_EQ(reply["connections"]["peer_idle_timeout_s"], 0.2);
  server.stop();
}

TEST(StatusServerLimits, HandshakeMustFinishInTime) {
  ServerConfig config = limited_tcp_config(8);
  config.handshake_timeout_s = 0.1;
  StatusServer server(config, {});
  const json bound = server.start();
  RawPeers silent;
  silent.open(bound["endpoint"], 2);
  silent.open(bound["pub_endpoint"], 2);
  ASSERT_TRUE(eventually([&] { return silent.closed_by_server() == 4; }));
  ASSERT_TRUE(eventually([&] { return connection_count(server, "peers") == 0 && connection_count(server, "pub_peers") == 0; }));
  EXPECT_EQ(connection_count(server, "refused_connections"), 0u);
  server.stop();
}

// A peer that finishes the ZMTP 3.1 handshake by hand (NULL mechanism, as a
// DEALER) and then never answers a heartbeat.
int zmtp_peer_that_ignores_heartbeats(const std::string& endpoint) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<std::uint16_t>(std::stoi(endpoint.substr(endpoint.rfind(':') + 1))));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) return -1;
  const timeval patience{30, 0};  // reads end with an error rather than hang the test
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof patience);
  std::string greeting(64, '\0');
  greeting[0] = '\xff';
  greeting[9] = '\x7f';
  greeting[10] = 3;  // version 3.1
  greeting[11] = 1;
  greeting.replace(12, 4, "NULL");
  const std::string ready_body = std::string("\x05READY\x0bSocket-Type", 18) + std::string("\0\0\0\x06", 4) + "DEALER";
  const std::string ready = std::string("\x04", 1) + static_cast<char>(ready_body.size()) + ready_body;
  const std::string hello = greeting + ready;
  if (::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(hello.size())) {
    ::close(fd);
    return -1;
  }
  return fd;
}

TEST(StatusServerLimits, WatchersStayWhileTheyAnswerHeartbeatsAndDeadPeersGo) {
  ServerConfig config = limited_tcp_config(8);
  config.heartbeat_interval_s = 0.1;  // a peer silent for 0.3 s is dropped
  Hooks hooks;
  StatusServer server(config, hooks.make());
  const json bound = server.start();
  zmq::context_t context;
  zmq::socket_t watcher(context, zmq::socket_type::sub);
  watcher.set(zmq::sockopt::linger, 0);
  watcher.set(zmq::sockopt::subscribe, "record");
  watcher.connect(std::string(bound["pub_endpoint"]));
  ASSERT_TRUE(eventually([&] { return connection_count(server, "pub_peers") == 1; }));

  const int dead = zmtp_peer_that_ignores_heartbeats(bound["endpoint"]);
  ASSERT_GE(dead, 0);
  // The server finishes the handshake (its READY comes), sends PINGs, and
  // closes the connection when no PONG comes (idle drops are off here) ...
  std::string received;
  char buffer[256];
  ssize_t n = 0;
  while ((n = ::recv(dead, buffer, sizeof buffer, 0)) > 0) received.append(buffer, static_cast<std::size_t>(n));
  ::close(dead);
  EXPECT_EQ(n, 0) << "the server closed it";
  EXPECT_NE(received.find("\x05READY"), std::string::npos) << "the handshake finished";
  EXPECT_NE(received.find("\x04PING"), std::string::npos) << "the server sent heartbeats";
  ASSERT_TRUE(eventually([&] { return connection_count(server, "peers") == 0; }));
  EXPECT_EQ(connection_count(server, "dropped_idle"), 0u);
  EXPECT_EQ(connection_count(server, "refused_connections"), 0u);
  // ... while the watcher, whose libzmq answers every PING, is still there and gets records.
  EXPECT_EQ(connection_count(server, "pub_peers"), 1u);
  zmq::pollitem_t item{watcher.handle(), 0, ZMQ_POLLIN, 0};
  int cell = 0;
  ASSERT_TRUE(eventually([&] {
    server.publish({{"cell", ++cell}});  // until the subscription has arrived
    return zmq::poll(&item, 1, 10ms) == 1;
  }));
  server.stop();
}

TEST(StatusServerLimits, LegitimateRequestsAreAnsweredDuringAFlood) {
  ServerConfig config = limited_tcp_config(8);
  config.peer_grace_s = 0.3;  // at the cap, a peer idle this long gives its slot to a newcomer
  Hooks hooks;
  StatusServer server(config, hooks.make());
  const json bound = server.start();
  const std::string endpoint = bound["endpoint"];

  // Held open for the whole test: raw connections, and zmq peers that finish
  // the handshake and then say nothing (libzmq reconnects them when dropped).
  RawPeers flood;
  flood.open(endpoint, 40);
  flood.open(bound["pub_endpoint"], 40);
  zmq::context_t flood_context;
  std::vector<zmq::socket_t> quiet;
  for (int i = 0; i < 16; ++i) {
    quiet.emplace_back(flood_context, zmq::socket_type::dealer);
    quiet.back().set(zmq::sockopt::linger, 0);
    quiet.back().connect(endpoint);
  }
  ASSERT_TRUE(eventually([&] { return connection_count(server, "refused_connections") >= 64; }));

  zmq::context_t context;
  for (int i = 0; i < 3; ++i) {
    Client client(context, endpoint, kKey);
    const json reply = client.ask(request("status"), true);
    ASSERT_TRUE(reply.is_object()) << "no answer during the flood";
    EXPECT_EQ(reply["ok"], true) << reply.dump();
    EXPECT_LE(reply["connections"]["peers"].get<int>(), 8);
    EXPECT_LE(reply["connections"]["pub_peers"].get<int>(), 8);
    EXPECT_GE(reply["connections"]["refused_connections"].get<int>(), 64);
  }
  // The server's side holds at most the cap, plus connections it is closing.
  ASSERT_TRUE(eventually([&] { return accepted_descriptors(endpoint) <= 8 + 4; }));
  EXPECT_LE(accepted_descriptors(bound["pub_endpoint"]), 8u);
  server.stop();
}

TEST(StatusServerLimits, CapIsBoundedByTheDescriptorLimit) {
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit lowered = saved;
  lowered.rlim_cur = std::min<rlim_t>(saved.rlim_cur, 256);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);
  StatusServer server(limited_tcp_config(64), {});
  const std::string endpoint = server.start()["endpoint"];
  const json connections = server.connections();
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  // Both sockets together hold at most a quarter of the descriptors.
  EXPECT_EQ(connections["max_peers"], lowered.rlim_cur / 8);
  server.stop();
}

TEST(StatusServerLimits, IpcPeersAreCappedToo) {
  TempDir dir;
  ServerConfig config = limited_tcp_config(2);
  config.endpoint = "ipc://" + dir.path() + "/s";
  Hooks hooks;
  StatusServer server(config, hooks.make());
  const std::string endpoint = server.start()["endpoint"];
  RawPeers flood;
  flood.open(endpoint, 6);
  ASSERT_TRUE(eventually([&] { return flood.closed_by_server() == 4; }));
  EXPECT_EQ(connection_count(server, "peers"), 2u);
  EXPECT_EQ(connection_count(server, "refused_connections"), 4u);
  server.stop();
}

TEST(StatusServerLimits, ConfigFromJson) {
  const ServerConfig config = server_config_from_json(
      {{"endpoint", "tcp://127.0.0.1:0"}, {"max_peers", 5}, {"peer_idle_timeout_s", 2.5}, {"handshake_timeout_s", 1}});
  EXPECT_EQ(config.max_peers, 5u);
  EXPECT_EQ(config.peer_idle_timeout_s, 2.5);
  EXPECT_EQ(config.handshake_timeout_s, 1.0);
  EXPECT_EQ(server_config_from_json({{"endpoint", "ipc:///x"}}).max_peers, 64u);
  for (const json& bad : {json{{"endpoint", "ipc:///x"}, {"max_peers", 0}}, json{{"endpoint", "ipc:///x"}, {"max_peers", "8"}},
                          json{{"endpoint", "ipc:///x"}, {"peer_idle_timeout_s", -1}}}) {
    EXPECT_THROW(server_config_from_json(bad), Error) << bad.dump();
  }
}

TEST(ReplayGuard, ForgetsAfterTheWindowAndStaysBounded) {
  detail::ReplayGuard guard(1000, 3);
  EXPECT_EQ(guard.admit("a", 100, 100), detail::ReplayGuard::Verdict::fresh);
  EXPECT_EQ(guard.admit("a", 100, 200), detail::ReplayGuard::Verdict::duplicate);
  EXPECT_EQ(guard.admit("b", 100, 1500), detail::ReplayGuard::Verdict::stale);
  EXPECT_EQ(guard.admit("c", 5000, 1500), detail::ReplayGuard::Verdict::future);
  for (const char* s : {"d", "e", "f", "g"}) EXPECT_EQ(guard.admit(s, 1500, 1500), detail::ReplayGuard::Verdict::fresh);
  EXPECT_EQ(guard.size(), 3u);
}

TEST(Hmac, MatchesAKnownVector) {
  // RFC 4231 test case 2.
  EXPECT_EQ(detail::hmac_sha256_hex("Jefe", "what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_TRUE(detail::hmac_sha256_verify("Jefe", "what do ya want for nothing?",
                                         "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"));
  EXPECT_FALSE(detail::hmac_sha256_verify("Jefe", "what do ya want for nothing?", "5bdc"));
}

}  // namespace
}  // namespace gpucleanup
