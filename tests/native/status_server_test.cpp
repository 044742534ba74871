// The status server against plain lambda hooks: no driver anywhere.
#include "status_server.hpp"

#include <dirent.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

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
  double last_timeout = -1;

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
               "request is malformed: \"kind\" must be a string (status, history, drain or ping)");
  json version = request("status");
  version["protocol"] = 2;
  expect_error(client_->ask(version), "gpucleanup.server.409",
               "protocol version 2 is not supported: this server speaks protocol 1");
  expect_error(client_->ask(request("reboot")), "gpucleanup.server.410",
               "unknown request kind \"reboot\": use status, history, drain or ping");
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
  EXPECT_EQ(hooks_.last_timeout, 2.5);

  json too_long = request("drain");
  too_long["timeout_s"] = 1e9;
  expect_error(client_->ask(too_long), "gpucleanup.server.408",
               "request is malformed: \"timeout_s\" must be a number of seconds from 0 to 60");
  EXPECT_EQ(hooks_.drains.load(), 1);
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
