#include "scenario.hpp"

#include "checkpoint_state.hpp"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

namespace fake_cuda {
namespace {

using nlohmann::json;

constexpr std::uint64_t kMiB = 1ull << 20;
constexpr std::uint64_t kGiB = 1ull << 30;
constexpr std::uint64_t kDefaultTotal = 80 * kGiB;
// What a context costs on the device (523 MiB measured on an H200,
// share/FACTS.md §8): the default free bytes of a device that has one.
constexpr std::uint64_t kContextFootprint = 512 * kMiB;

// A scenario is parsed completely into a patch before anything is applied, so
// a malformed one leaves the state untouched.
struct PoolPatch {
  std::optional<std::uint64_t> reserved, used, pending_free, reserved_high, used_high;
};

struct DevicePatch {
  std::optional<std::string> name;
  std::optional<std::pair<std::string, CUuuid>> uuid;
  std::optional<std::uint64_t> total, free;
  std::optional<bool> primary_active, pools_supported;
  std::optional<PoolPatch> default_pool;
  bool current_pool_given = false;
  std::optional<PoolPatch> current_pool;  // given and empty: null, the default pool is current
  std::optional<double> sync_seconds;
  std::optional<CUresult> sticky_error;
  std::map<std::string, CUresult> errors;
};

struct ContextSpec {
  int device = 0;
  bool primary = false;
};

struct ScenarioPatch {
  std::optional<bool> initialized;
  std::optional<int> driver_version;
  std::optional<std::set<std::string>> missing;
  std::map<std::string, CUresult> errors;
  std::optional<std::vector<DevicePatch>> devices;
  bool current_context_given = false;
  std::optional<ContextSpec> current_context;
};

[[noreturn]] void fail(const std::string& where, const std::string& what) {
  throw ScenarioError(where + ": " + what);
}

void check_keys(const json& object, const std::string& where,
                std::initializer_list<std::string_view> allowed) {
  if (!object.is_object()) fail(where, "expected an object, got " + object.dump());
  for (const auto& item : object.items()) {
    if (std::find(allowed.begin(), allowed.end(), item.key()) == allowed.end()) {
      fail(where, "unknown key \"" + item.key() + "\"");
    }
  }
}

std::uint64_t as_bytes(const json& value, const std::string& where) {
  if (value.is_number_unsigned()) return value.get<std::uint64_t>();
  if (value.is_number_integer() && value.get<std::int64_t>() >= 0) {
    return static_cast<std::uint64_t>(value.get<std::int64_t>());
  }
  fail(where, "expected a non-negative integer, got " + value.dump());
}

bool as_bool(const json& value, const std::string& where) {
  if (!value.is_boolean()) fail(where, "expected true or false, got " + value.dump());
  return value.get<bool>();
}

int as_int(const json& value, const std::string& where) {
  if (!value.is_number_integer()) fail(where, "expected an integer, got " + value.dump());
  return value.get<int>();
}

CUresult as_result(const json& value, const std::string& where) {
  const int code = as_int(value, where);
  if (code < 0) fail(where, "expected a CUresult (>= 0), got " + value.dump());
  return static_cast<CUresult>(code);
}

std::string as_string(const json& value, const std::string& where) {
  if (!value.is_string()) fail(where, "expected a string, got " + value.dump());
  return value.get<std::string>();
}

std::string as_entry_name(const std::string& name, const std::string& where) {
  // A misspelt name would silently inject nothing: refuse it.
  if (entry_names().count(name) == 0) fail(where, "\"" + name + "\" is not an entry point of the fake driver");
  return name;
}

// "GPU-5f0c5a1e-1d3b-4c3e-9a1b-2f6a7c8d9e0f" (or "MIG-...") -> 16 bytes.
std::pair<std::string, CUuuid> parse_uuid(const std::string& text, const std::string& where) {
  const auto dash = text.find('-');
  const std::string prefix = dash == std::string::npos ? "" : text.substr(0, dash);
  if (prefix != "GPU" && prefix != "MIG") fail(where, "expected \"GPU-xxxxxxxx-...\", got \"" + text + "\"");
  std::string hex;
  for (char c : text.substr(dash + 1)) {
    if (c == '-') continue;
    if (!std::isxdigit(static_cast<unsigned char>(c))) fail(where, "not a hex digit in \"" + text + "\"");
    hex.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  if (hex.size() != 32) fail(where, "expected 32 hex digits in \"" + text + "\"");
  CUuuid bytes{};
  for (std::size_t i = 0; i < 16; ++i) {
    bytes.bytes[i] = static_cast<char>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  }
  std::string normalised = prefix + "-";
  for (char c : text.substr(dash + 1)) normalised.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  return {normalised, bytes};
}

std::map<std::string, CUresult> parse_errors(const json& value, const std::string& where) {
  if (!value.is_object()) fail(where, "expected an object of entry point -> CUresult, got " + value.dump());
  std::map<std::string, CUresult> errors;
  for (const auto& item : value.items()) {
    const auto key = where + "." + item.key();
    errors[as_entry_name(item.key(), key)] = as_result(item.value(), key);
  }
  return errors;
}

PoolPatch parse_pool(const json& value, const std::string& where) {
  check_keys(value, where,
             {"reserved_bytes", "used_bytes", "pending_free_bytes", "reserved_high_bytes", "used_high_bytes"});
  PoolPatch pool;
  auto field = [&](const char* key, std::optional<std::uint64_t>& out) {
    if (value.contains(key)) out = as_bytes(value[key], where + "." + key);
  };
  field("reserved_bytes", pool.reserved);
  field("used_bytes", pool.used);
  field("pending_free_bytes", pool.pending_free);
  field("reserved_high_bytes", pool.reserved_high);
  field("used_high_bytes", pool.used_high);
  return pool;
}

DevicePatch parse_device(const json& value, const std::string& where) {
  check_keys(value, where,
             {"name", "uuid", "total_bytes", "free_bytes", "primary_active", "pools_supported", "default_pool",
              "current_pool", "sync_seconds", "sticky_error", "errors"});
  DevicePatch device;
  if (value.contains("name")) device.name = as_string(value["name"], where + ".name");
  if (value.contains("uuid")) device.uuid = parse_uuid(as_string(value["uuid"], where + ".uuid"), where + ".uuid");
  if (value.contains("total_bytes")) device.total = as_bytes(value["total_bytes"], where + ".total_bytes");
  if (value.contains("free_bytes")) device.free = as_bytes(value["free_bytes"], where + ".free_bytes");
  if (value.contains("primary_active")) {
    device.primary_active = as_bool(value["primary_active"], where + ".primary_active");
  }
  if (value.contains("pools_supported")) {
    device.pools_supported = as_bool(value["pools_supported"], where + ".pools_supported");
  }
  if (value.contains("default_pool")) device.default_pool = parse_pool(value["default_pool"], where + ".default_pool");
  if (value.contains("current_pool")) {
    device.current_pool_given = true;
    if (!value["current_pool"].is_null()) {
      device.current_pool = parse_pool(value["current_pool"], where + ".current_pool");
    }
  }
  if (value.contains("sync_seconds")) {
    const auto& seconds = value["sync_seconds"];
    if (!seconds.is_number() || (seconds.get<double>() < 0 && seconds.get<double>() != -1)) {
      fail(where + ".sync_seconds", "expected seconds >= 0, or -1 to hang, got " + seconds.dump());
    }
    device.sync_seconds = seconds.get<double>();
  }
  if (value.contains("sticky_error")) device.sticky_error = as_result(value["sticky_error"], where + ".sticky_error");
  if (value.contains("errors")) device.errors = parse_errors(value["errors"], where + ".errors");
  return device;
}

ScenarioPatch parse(const std::string& text) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::parse_error& e) {
    fail("scenario", std::string("malformed JSON: ") + e.what());
  }
  check_keys(root, "scenario",
             {"initialized", "driver_version", "missing", "errors", "devices", "current_context", "counters"});
  ScenarioPatch patch;
  if (root.contains("initialized")) patch.initialized = as_bool(root["initialized"], "initialized");
  if (root.contains("driver_version")) patch.driver_version = as_int(root["driver_version"], "driver_version");
  if (root.contains("missing")) {
    if (!root["missing"].is_array()) fail("missing", "expected an array of entry point names");
    patch.missing.emplace();
    for (std::size_t i = 0; i < root["missing"].size(); ++i) {
      const auto where = "missing[" + std::to_string(i) + "]";
      patch.missing->insert(as_entry_name(as_string(root["missing"][i], where), where));
    }
  }
  if (root.contains("errors")) patch.errors = parse_errors(root["errors"], "errors");
  if (root.contains("devices")) {
    if (!root["devices"].is_array()) fail("devices", "expected an array");
    patch.devices.emplace();
    for (std::size_t i = 0; i < root["devices"].size(); ++i) {
      patch.devices->push_back(parse_device(root["devices"][i], "devices[" + std::to_string(i) + "]"));
    }
  }
  if (root.contains("current_context")) {
    patch.current_context_given = true;
    const auto& context = root["current_context"];
    if (!context.is_null()) {
      check_keys(context, "current_context", {"device", "primary"});
      if (!context.contains("device")) fail("current_context", "needs \"device\"");
      ContextSpec spec;
      spec.device = as_int(context["device"], "current_context.device");
      if (context.contains("primary")) spec.primary = as_bool(context["primary"], "current_context.primary");
      patch.current_context = spec;
    }
  }
  // "counters" is accepted and ignored so that fake_cuda_state_json() output
  // can be fed back as a scenario.
  return patch;
}

std::string default_uuid(int index) {
  char text[64];
  std::snprintf(text, sizeof text, "GPU-fa4ec0da-0000-4000-8000-%012x", index);
  return text;
}

void apply_pool(Pool& pool, const PoolPatch& patch) {
  if (patch.reserved) pool.reserved = *patch.reserved;
  if (patch.used) pool.used = *patch.used;
  if (patch.pending_free) pool.pending_free = *patch.pending_free;
  if (patch.reserved_high) pool.reserved_high = *patch.reserved_high;
  if (patch.used_high) pool.used_high = *patch.used_high;
  pool.note_high_marks();
}

std::unique_ptr<Device> make_device(int index) {
  auto device = std::make_unique<Device>();
  device->index = index;
  device->name = "Fake GPU " + std::to_string(index);
  std::tie(device->uuid, device->uuid_bytes) = parse_uuid(default_uuid(index), "default uuid");
  device->total = kDefaultTotal;
  device->primary_context = std::make_unique<Context>(Context{index, true, false});
  device->default_pool = std::make_unique<Pool>();
  device->default_pool->device = index;
  return device;
}

void apply_device(State& s, Device& device, const DevicePatch& patch) {
  if (patch.name) device.name = *patch.name;
  if (patch.uuid) std::tie(device.uuid, device.uuid_bytes) = *patch.uuid;
  if (patch.total) device.total = *patch.total;
  if (patch.free) device.free = *patch.free;
  if (patch.primary_active) device.external_primary_ref = *patch.primary_active;
  if (patch.pools_supported) device.pools_supported = *patch.pools_supported;
  if (patch.default_pool) apply_pool(*device.default_pool, *patch.default_pool);
  if (patch.current_pool_given) {
    if (!patch.current_pool) {
      if (device.current_pool) s.retired_pools.push_back(std::move(device.current_pool));
    } else {
      if (!device.current_pool) {
        device.current_pool = std::make_unique<Pool>();
        device.current_pool->device = device.index;
      }
      apply_pool(*device.current_pool, *patch.current_pool);
    }
  }
  if (patch.sync_seconds) device.sync_seconds = *patch.sync_seconds;
  if (patch.sticky_error) device.sticky_error = *patch.sticky_error;
  for (const auto& [name, code] : patch.errors) {
    if (code == CUDA_SUCCESS) {
      device.errors.erase(name);
    } else {
      device.errors[name] = code;
    }
  }
}

// Free bytes of a device the scenario gave none for: total less what a context
// and the pools' reservations take, as cuMemGetInfo would see it.
void default_free(State& s, Device& device) {
  std::uint64_t taken = device.default_pool->reserved + (device.current_pool ? device.current_pool->reserved : 0);
  const bool has_context =
      device.primary_active() || (s.base_context != nullptr && s.base_context->device == device.index);
  if (has_context) taken += kContextFootprint;
  device.free = device.total > taken ? device.total - taken : 0;
}

void apply_globals(State& s, const ScenarioPatch& patch) {
  if (patch.initialized) s.initialized = *patch.initialized;
  if (patch.driver_version) s.driver_version = *patch.driver_version;
  if (patch.missing) s.missing = *patch.missing;
  for (const auto& [name, code] : patch.errors) {
    if (code == CUDA_SUCCESS) {
      s.errors.erase(name);
    } else {
      s.errors[name] = code;
    }
  }
}

json pool_json(const Pool& pool) {
  return {{"reserved_bytes", pool.reserved},
          {"used_bytes", pool.used},
          {"pending_free_bytes", pool.pending_free},
          {"reserved_high_bytes", pool.reserved_high},
          {"used_high_bytes", pool.used_high}};
}

json errors_json(const std::map<std::string, CUresult>& errors) {
  json out = json::object();
  for (const auto& [name, code] : errors) out[name] = static_cast<int>(code);
  return out;
}

void load_from_environment(State& s) {
  const char* value = std::getenv("GPUCLEANUP_FAKE_CUDA_SCENARIO");
  std::string text = value == nullptr ? "{}" : value;
  if (!text.empty() && text.front() != '{') {
    std::ifstream file(text);
    if (!file) {
      std::fprintf(stderr, "fake libcuda: GPUCLEANUP_FAKE_CUDA_SCENARIO: cannot read %s\n", text.c_str());
      std::abort();
    }
    std::ostringstream content;
    content << file.rdbuf();
    text = content.str();
  }
  try {
    reset(s, text);
    if (!checkpoint_dir().empty() && s.initialized) register_process();
  } catch (const ScenarioError& e) {
    // A test that meant to script the driver and silently got the default
    // scenario would pass for the wrong reason: stop it here, loudly.
    std::fprintf(stderr, "fake libcuda: GPUCLEANUP_FAKE_CUDA_SCENARIO: %s\n", e.what());
    std::abort();
  }
}

}  // namespace

void Pool::note_high_marks() {
  reserved_high = std::max(reserved_high, reserved);
  used_high = std::max(used_high, outstanding());
}

Context* State::find_context(CUcontext handle) {
  auto* context = reinterpret_cast<Context*>(handle);
  if (context == nullptr) return nullptr;
  if (context == base_context) return context;
  for (auto& device : devices) {
    if (context == device->primary_context.get()) return context;
  }
  for (Context* destroyed : destroyed_primaries) {
    if (context == destroyed) return context;
  }
  return nullptr;
}

Pool* State::find_pool(CUmemoryPool handle) {
  auto* pool = reinterpret_cast<Pool*>(handle);
  if (pool == nullptr) return nullptr;
  for (auto& device : devices) {
    if (pool == device->default_pool.get() || pool == device->current_pool.get()) return pool;
  }
  return nullptr;
}

State& state() {
  static State* instance = new State;
  return *instance;
}

std::unique_lock<std::mutex> lock_state() {
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mutex);
  if (!s.loaded) load_from_environment(s);
  return lock;
}

std::vector<StackFrame>& thread_contexts(State& s) {
  struct ThreadStack {
    std::uint64_t generation = 0;
    std::vector<StackFrame> frames;
  };
  thread_local ThreadStack stack;
  if (stack.generation != s.generation) {
    // The first call of this thread since the scenario was loaded.
    ++s.counters["threads"];
    stack.frames.clear();
    stack.generation = s.generation;
    if (s.base_context != nullptr && !s.base_context_claimed) {
      stack.frames.push_back({s.base_context, false});
      s.base_context_claimed = true;
    }
  }
  return stack.frames;
}

const std::set<std::string>& entry_names() {
  static const std::set<std::string> names = {
#define GPUCLEANUP_REQUIRED(name, pfn_version, symbol) #name,
#define GPUCLEANUP_OPTIONAL(name, pfn_version, symbol) #name,
#include "detail/entry_points.inc"
#undef GPUCLEANUP_REQUIRED
#undef GPUCLEANUP_OPTIONAL
      "cuInit",
      "cuGetProcAddress",
  };
  return names;
}

void reset(State& s, const std::string& scenario_json) {
  const ScenarioPatch patch = parse(scenario_json);
  const std::size_t device_count = patch.devices ? patch.devices->size() : 1;
  if (patch.current_context && (patch.current_context->device < 0 ||
                                static_cast<std::size_t>(patch.current_context->device) >= device_count)) {
    fail("current_context.device", "no device " + std::to_string(patch.current_context->device));
  }

  for (auto& device : s.devices) s.retired_devices.push_back(std::move(device));
  if (s.base_context_storage) s.retired_contexts.push_back(std::move(s.base_context_storage));
  s.devices.clear();
  s.destroyed_primaries.clear();
  s.base_context = nullptr;
  s.base_context_claimed = false;
  s.initialized = true;
  s.driver_version = 13000;
  s.missing.clear();
  s.errors.clear();
  s.counters.clear();
  s.sync_released = false;
  ++s.generation;
  s.loaded = true;
  s.sync_cv.notify_all();  // synchronizes of the old scenario return now

  apply_globals(s, patch);
  for (std::size_t i = 0; i < device_count; ++i) {
    s.devices.push_back(make_device(static_cast<int>(i)));
    if (patch.devices) apply_device(s, *s.devices.back(), (*patch.devices)[i]);
  }
  if (patch.current_context) {
    Device& device = *s.devices[static_cast<std::size_t>(patch.current_context->device)];
    if (patch.current_context->primary) {
      // A primary context current to a thread was retained by someone.
      device.external_primary_ref = true;
      s.base_context = device.primary_context.get();
    } else {
      s.base_context_storage = std::make_unique<Context>(Context{device.index, false});
      s.base_context = s.base_context_storage.get();
    }
  }
  for (std::size_t i = 0; i < device_count; ++i) {
    if (!patch.devices || !(*patch.devices)[i].free) default_free(s, *s.devices[i]);
  }
}

void update(State& s, const std::string& patch_json) {
  const ScenarioPatch patch = parse(patch_json);
  if (patch.current_context_given) {
    fail("current_context", "belongs to a thread; set it with fake_cuda_reset");
  }
  apply_globals(s, patch);
  if (patch.devices) {
    for (std::size_t i = 0; i < patch.devices->size(); ++i) {
      const bool added = i >= s.devices.size();
      if (added) s.devices.push_back(make_device(static_cast<int>(i)));
      apply_device(s, *s.devices[i], (*patch.devices)[i]);
      if (added && !(*patch.devices)[i].free) default_free(s, *s.devices[i]);
    }
  }
  s.sync_cv.notify_all();  // a changed sync_seconds applies to synchronizes already waiting
}

void reset_primary_context(State& s, int device_index) {
  Device* device = s.device(device_index);
  if (device == nullptr) fail("reset_primary_context", "no device " + std::to_string(device_index));
  std::unique_ptr<Context> old = std::move(device->primary_context);
  old->destroyed = true;
  s.destroyed_primaries.push_back(old.get());
  s.retired_contexts.push_back(std::move(old));  // a thread may still have it current (base_context too)
  device->primary_context = std::make_unique<Context>(Context{device->index, true, false});
  s.counters["retained"] -= device->retained;
  device->retained = 0;
  device->external_primary_ref = false;
  ++s.counters["primary_resets"];
}

std::string dump(const State& s) {
  json devices = json::array();
  for (const auto& device : s.devices) {
    devices.push_back({{"name", device->name},
                       {"uuid", device->uuid},
                       {"total_bytes", device->total},
                       {"free_bytes", device->free},
                       {"primary_active", device->primary_active()},
                       {"pools_supported", device->pools_supported},
                       {"default_pool", pool_json(*device->default_pool)},
                       {"current_pool", device->current_pool ? pool_json(*device->current_pool) : json(nullptr)},
                       {"sync_seconds", device->sync_seconds},
                       {"sticky_error", static_cast<int>(device->sticky_error)},
                       {"errors", errors_json(device->errors)}});
  }
  // The plain counters always appear; "calls.<entry>" once the entry was called.
  json counters = {{"cuInit", 0},  {"contexts_created", 0}, {"retained", 0},      {"pushed", 0},
                   {"syncs_in_flight", 0}, {"threads", 0},     {"primary_resets", 0}, {"events", 0}};
  for (const auto& [name, value] : s.counters) counters[name] = value;
  json root = {{"initialized", s.initialized},
               {"driver_version", s.driver_version},
               {"missing", json(std::vector<std::string>(s.missing.begin(), s.missing.end()))},
               {"errors", errors_json(s.errors)},
               {"devices", devices},
               {"current_context", s.base_context == nullptr
                                       ? json(nullptr)
                                       : json{{"device", s.base_context->device},
                                              {"primary", s.base_context->primary}}},
               {"counters", counters}};
  return root.dump();
}

}  // namespace fake_cuda
