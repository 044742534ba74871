#include "trace.hpp"

#include <cupti_callbacks.h>
#include <cupti_driver_cbid.h>
#include <cupti_result.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <unordered_map>

#include "accounting.hpp"
#include "devices.hpp"
#include "driver.hpp"
#include "gil.hpp"
#include "process_state.hpp"

namespace gpucleanup::trace {
namespace {

// The parameter blocks CUPTI hands to a driver-API callback: the same layout as
// the toolkit's generated_cuda_meta.h (cuMemAlloc_v2_params and so on), written
// out here because that header also needs cuda.h's legacy _v1 types.
struct cuMemAlloc_v2_params { CUdeviceptr* dptr; size_t bytesize; };
struct cuMemAllocPitch_v2_params {
  CUdeviceptr* dptr; size_t* pPitch; size_t WidthInBytes; size_t Height; unsigned int ElementSizeBytes;
};
struct cuMemAllocManaged_params { CUdeviceptr* dptr; size_t bytesize; unsigned int flags; };
struct cuMemCreate_params {
  CUmemGenericAllocationHandle* handle; size_t size; const CUmemAllocationProp* prop; unsigned long long flags;
};
struct cuMemAllocAsync_params { CUdeviceptr* dptr; size_t bytesize; CUstream hStream; };
struct cuMemAllocFromPoolAsync_params { CUdeviceptr* dptr; size_t bytesize; CUmemoryPool pool; CUstream hStream; };
struct cuMemPoolCreate_params { CUmemoryPool* pool; const CUmemPoolProps* poolProps; };
struct cuMemPoolDestroy_params { CUmemoryPool pool; };
struct cuMemFree_v2_params { CUdeviceptr dptr; };
struct cuMemFreeAsync_params { CUdeviceptr dptr; CUstream hStream; };
struct cuMemRelease_params { CUmemGenericAllocationHandle handle; };

// CUPTI's entry points, resolved from the library loaded at start().
using SubscribeFn = CUptiResult (*)(CUpti_SubscriberHandle*, CUpti_CallbackFunc, void*);
using UnsubscribeFn = CUptiResult (*)(CUpti_SubscriberHandle);
using EnableCallbackFn = CUptiResult (*)(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain, CUpti_CallbackId);
using ResultStringFn = CUptiResult (*)(CUptiResult, const char**);

// At most this many live allocations are kept; beyond, allocations are counted
// as dropped (a program making millions of raw allocations is not what this is for).
constexpr std::size_t kMaxLive = 1u << 20;
constexpr std::size_t kMaxThreadsListed = 16;
constexpr int kUnknownCaller = -2;
// The caller is within the first frames: the callback, CUPTI's and the driver's own.
constexpr int kMaxNativeFrames = 16;

enum class Kind : std::uint8_t { alloc, pitch, managed, create, async, from_pool };

const char* to_string(Kind kind) {
  switch (kind) {
    case Kind::alloc: return "cuMemAlloc";
    case Kind::pitch: return "cuMemAllocPitch";
    case Kind::managed: return "cuMemAllocManaged";
    case Kind::create: return "cuMemCreate";
    case Kind::async: return "cuMemAllocAsync";
    case Kind::from_pool: return "cuMemAllocFromPoolAsync";
  }
  return "?";
}

struct Allocation {
  std::uint64_t bytes;
  int device;
  Kind kind;
  std::int64_t tid;
  std::int64_t site;
  std::int64_t cell;
  int caller;  // index into State::callers
};

// Keys: device pointers and cuMemCreate handles live in different spaces.
struct Key {
  bool handle;
  std::uint64_t value;
  bool operator==(const Key& other) const { return handle == other.handle && value == other.value; }
};
struct KeyHash {
  std::size_t operator()(const Key& key) const { return std::hash<std::uint64_t>{}(key.value) ^ (key.handle ? 1 : 0); }
};

struct Cupti {
  void* handle = nullptr;
  std::string path;
  SubscribeFn subscribe = nullptr;
  UnsubscribeFn unsubscribe = nullptr;
  EnableCallbackFn enable = nullptr;
  ResultStringFn result_string = nullptr;
};

struct State {
  std::mutex mutex;
  Cupti cupti;  // libcupti stays loaded once loaded (a late callback may still run in it)
  CUpti_SubscriberHandle subscriber = nullptr;
  bool active = false;
  std::unordered_map<Key, Allocation, KeyHash> live;
  std::uint64_t dropped = 0;
  std::vector<std::string> callers;             // shared objects that called the driver
  std::unordered_map<const void*, int> caller_of_base;
  std::unordered_map<CUcontext, int> device_of_context;
  std::unordered_map<std::int64_t, int> caller_of_site;  // a Python line's caller, walked once
  std::map<CUmemoryPool, int> pools;            // cuMemPoolCreate'd pool -> device
  // shared objects whose frames are not "the caller": the driver, CUPTI, this library
  std::set<const void*> skipped_bases;
};

State& state() {
  static State* s = new State();  // never destroyed: a callback may run during exit
  return *s;
}

std::atomic<bool> g_active{false};
std::atomic<std::int64_t> g_cell{-1};
std::atomic<SiteFn> g_site{nullptr};
// GPUCLEANUP_TRACE_CALLER=0 at start: no native stack walk, so no caller library (to
// measure what the walk costs; the frameworks' pools then read as raw).
std::atomic<bool> g_callers{true};

std::int64_t thread_id() { return static_cast<std::int64_t>(::syscall(SYS_gettid)); }

const void* base_of(const void* address, const char** name) {
  Dl_info info{};
  if (address == nullptr || ::dladdr(address, &info) == 0) return nullptr;
  if (name != nullptr) *name = info.dli_fname;
  return info.dli_fbase;
}

bool runtime_library(const char* name) {
  if (name == nullptr) return false;
  const std::string text(name);
  const auto slash = text.rfind('/');
  const std::string base = slash == std::string::npos ? text : text.substr(slash + 1);
  return base.rfind("libcudart", 0) == 0;
}

// The shared object that called into the driver: the first frame of the native
// stack outside libcuda, libcupti, libcudart and this library. Under the lock.
int caller_index(State& s, void* const* frames, int count) {
  for (int i = 0; i < count; ++i) {
    const char* name = nullptr;
    const void* base = base_of(frames[i], &name);
    if (base == nullptr || s.skipped_bases.count(base) != 0) continue;
    if (runtime_library(name)) continue;
    if (auto found = s.caller_of_base.find(base); found != s.caller_of_base.end()) return found->second;
    if (s.callers.size() >= 4096) return -1;
    s.callers.emplace_back(name != nullptr ? name : "");
    const int index = static_cast<int>(s.callers.size() - 1);
    s.caller_of_base.emplace(base, index);
    return index;
  }
  return -1;
}

int device_of_current_context(State& s, CUcontext context) {
  if (context != nullptr) {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (auto found = s.device_of_context.find(context); found != s.device_of_context.end()) return found->second;
  }
  const Driver& driver = Driver::process();
  if (!driver.usable()) return -1;
  CUdevice device = -1;
  if (driver.api().cuCtxGetDevice(&device) != CUDA_SUCCESS) return -1;
  if (context != nullptr) {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.device_of_context.size() < 1024) s.device_of_context.emplace(context, static_cast<int>(device));
  }
  return static_cast<int>(device);
}

struct Made {
  Key key;
  std::uint64_t bytes;
  int device;  // -1: from the calling thread's current context
  Kind kind;
};

// What an allocation call made, read from its parameters after it succeeded.
bool made_by(std::uint32_t cbid, const void* params, Made& made) {
  switch (cbid) {
    case CUPTI_DRIVER_TRACE_CBID_cuMemAlloc_v2: {
      const auto* p = static_cast<const cuMemAlloc_v2_params*>(params);
      made = {{false, p->dptr ? *p->dptr : 0}, p->bytesize, -1, Kind::alloc};
      return p->dptr != nullptr;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemAllocPitch_v2: {
      const auto* p = static_cast<const cuMemAllocPitch_v2_params*>(params);
      if (p->dptr == nullptr || p->pPitch == nullptr) return false;
      made = {{false, *p->dptr}, static_cast<std::uint64_t>(*p->pPitch) * p->Height, -1, Kind::pitch};
      return true;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemAllocManaged: {
      const auto* p = static_cast<const cuMemAllocManaged_params*>(params);
      made = {{false, p->dptr ? *p->dptr : 0}, p->bytesize, -1, Kind::managed};
      return p->dptr != nullptr;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemCreate: {
      const auto* p = static_cast<const cuMemCreate_params*>(params);
      if (p->handle == nullptr) return false;
      const int device = p->prop != nullptr && p->prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE
                             ? p->prop->location.id : -2;
      made = {{true, static_cast<std::uint64_t>(*p->handle)}, p->size, device, Kind::create};
      return true;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync:
    case CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync_ptsz: {
      const auto* p = static_cast<const cuMemAllocAsync_params*>(params);
      made = {{false, p->dptr ? *p->dptr : 0}, p->bytesize, -1, Kind::async};
      return p->dptr != nullptr;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemAllocFromPoolAsync:
    case CUPTI_DRIVER_TRACE_CBID_cuMemAllocFromPoolAsync_ptsz: {
      const auto* p = static_cast<const cuMemAllocFromPoolAsync_params*>(params);
      made = {{false, p->dptr ? *p->dptr : 0}, p->bytesize, -1, Kind::from_pool};
      return p->dptr != nullptr;
    }
    default:
      return false;
  }
}

// What a free call gave back.
bool freed_by(std::uint32_t cbid, const void* params, Key& key) {
  switch (cbid) {
    case CUPTI_DRIVER_TRACE_CBID_cuMemFree_v2:
      key = {false, static_cast<const cuMemFree_v2_params*>(params)->dptr};
      return true;
    case CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync:
    case CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync_ptsz:
      key = {false, static_cast<const cuMemFreeAsync_params*>(params)->dptr};
      return true;
    case CUPTI_DRIVER_TRACE_CBID_cuMemRelease:
      key = {true, static_cast<std::uint64_t>(static_cast<const cuMemRelease_params*>(params)->handle)};
      return true;
    default:
      return false;
  }
}

constexpr std::uint32_t kCallbacks[] = {
    CUPTI_DRIVER_TRACE_CBID_cuMemAlloc_v2,          CUPTI_DRIVER_TRACE_CBID_cuMemAllocPitch_v2,
    CUPTI_DRIVER_TRACE_CBID_cuMemAllocManaged,      CUPTI_DRIVER_TRACE_CBID_cuMemCreate,
    CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync,        CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuMemAllocFromPoolAsync, CUPTI_DRIVER_TRACE_CBID_cuMemAllocFromPoolAsync_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuMemPoolCreate,        CUPTI_DRIVER_TRACE_CBID_cuMemFree_v2,
    CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync,         CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuMemRelease,           CUPTI_DRIVER_TRACE_CBID_cuMemPoolDestroy,
};

void CUPTIAPI callback(void* userdata, CUpti_CallbackDomain domain, CUpti_CallbackId cbid, const void* data) {
  on_callback(userdata, static_cast<int>(domain), static_cast<std::uint32_t>(cbid), data);
}

std::string result_text(const Cupti& cupti, CUptiResult result) {
  const char* text = nullptr;
  if (cupti.result_string != nullptr && cupti.result_string(result, &text) == CUPTI_SUCCESS && text != nullptr) {
    return text;
  }
  return "CUPTI result " + std::to_string(static_cast<int>(result));
}

std::string load_cupti(Cupti& cupti, const std::vector<std::string>& candidates, nlohmann::json& tried) {
  std::string last;
  for (const std::string& path : candidates) {
    if (const std::string why = not_loadable(path); !why.empty()) {
      tried.push_back({{"path", path}, {"error", why}});
      continue;
    }
    void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* why = ::dlerror();
      tried.push_back({{"path", path}, {"error", why != nullptr ? why : "not loadable"}});
      continue;
    }
    Cupti loaded;
    loaded.handle = handle;
    loaded.path = path;
    loaded.subscribe = reinterpret_cast<SubscribeFn>(::dlsym(handle, "cuptiSubscribe"));
    loaded.unsubscribe = reinterpret_cast<UnsubscribeFn>(::dlsym(handle, "cuptiUnsubscribe"));
    loaded.enable = reinterpret_cast<EnableCallbackFn>(::dlsym(handle, "cuptiEnableCallback"));
    loaded.result_string = reinterpret_cast<ResultStringFn>(::dlsym(handle, "cuptiGetResultString"));
    if (loaded.subscribe == nullptr || loaded.unsubscribe == nullptr || loaded.enable == nullptr) {
      tried.push_back({{"path", path}, {"error", "has no cuptiSubscribe, cuptiUnsubscribe or cuptiEnableCallback"}});
      ::dlclose(handle);
      continue;
    }
    tried.push_back({{"path", path}, {"error", nullptr}});
    cupti = loaded;
    return "";
  }
  return candidates.empty() ? "no path to libcupti was given" : "libcupti could not be loaded from any path tried";
}

nlohmann::json refused(const std::string& error, int cupti_result, const nlohmann::json& tried) {
  return {{"active", false}, {"library", nullptr}, {"error", error},
          {"cupti_result", cupti_result}, {"tried", tried}};
}

}  // namespace

void on_callback(void*, int domain, std::uint32_t cbid, const void* data) noexcept {
  if (!g_active.load(std::memory_order_relaxed) || data == nullptr || process_is_exiting()) return;
  if (domain != CUPTI_CB_DOMAIN_DRIVER_API) return;
  const auto* call = static_cast<const CUpti_CallbackData*>(data);
  if (call->callbackSite != CUPTI_API_EXIT || call->functionParams == nullptr) return;
  if (call->functionReturnValue != nullptr &&
      *static_cast<const CUresult*>(call->functionReturnValue) != CUDA_SUCCESS) {
    return;
  }
  try {
    State& s = state();
    if (cbid == CUPTI_DRIVER_TRACE_CBID_cuMemPoolCreate) {
      const auto* p = static_cast<const cuMemPoolCreate_params*>(call->functionParams);
      if (p->pool == nullptr || *p->pool == nullptr || p->poolProps == nullptr) return;
      if (p->poolProps->location.type != CU_MEM_LOCATION_TYPE_DEVICE) return;
      std::lock_guard<std::mutex> lock(s.mutex);
      s.pools[*p->pool] = p->poolProps->location.id;
      return;
    }
    if (cbid == CUPTI_DRIVER_TRACE_CBID_cuMemPoolDestroy) {
      const auto* p = static_cast<const cuMemPoolDestroy_params*>(call->functionParams);
      std::lock_guard<std::mutex> lock(s.mutex);
      s.pools.erase(p->pool);
      return;
    }
    Key freed{};
    if (freed_by(cbid, call->functionParams, freed)) {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.live.erase(freed);
      return;
    }
    Made made{};
    if (!made_by(cbid, call->functionParams, made)) return;
    // Before any lock: the site hook runs Python, which may free GPU memory
    // (a collection) and so come back here on this thread.
    std::int64_t site = 0;
    if (const SiteFn hook = g_site.load(); hook != nullptr && gil::held() == 1) site = hook();
    // The stack walk is the dear part (about 90 µs on a GPU machine with PyTorch loaded, against
    // a few µs for the rest): a Python line calls the same library each time, so its caller is
    // walked for once. Calls without a line (the interpreter lock released) are walked each time.
    int caller = kUnknownCaller;
    if (site > 0) {
      std::lock_guard<std::mutex> lock(s.mutex);
      if (auto found = s.caller_of_site.find(site); found != s.caller_of_site.end()) caller = found->second;
    }
    void* frames[kMaxNativeFrames];
    int count = 0;
    if (caller == kUnknownCaller && g_callers.load(std::memory_order_relaxed)) count = ::backtrace(frames, kMaxNativeFrames);
    const int device = made.device >= 0 ? made.device : made.device == -1 ? device_of_current_context(s, call->context) : -1;
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.live.size() >= kMaxLive && s.live.find(made.key) == s.live.end()) {
      ++s.dropped;
      return;
    }
    if (caller == kUnknownCaller) {
      caller = caller_index(s, frames, count);
      if (site > 0 && count > 0 && s.caller_of_site.size() < 65536) s.caller_of_site.emplace(site, caller);
    }
    s.live[made.key] = Allocation{made.bytes, device, made.kind, thread_id(), site,
                                  g_cell.load(std::memory_order_relaxed), caller};
  } catch (...) {
    // A callback must never throw into the driver: the allocation is not traced.
  }
}

nlohmann::json start(const std::vector<std::string>& candidates, SiteFn site) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  g_site.store(site);
  nlohmann::json tried = nlohmann::json::array();
  if (s.active) {
    return {{"active", true}, {"library", s.cupti.path}, {"error", nullptr}, {"cupti_result", 0}, {"tried", tried}};
  }
  const Driver& driver = Driver::process();
  if (!driver.usable() || cuda_initialized(driver) != 1) {
    return refused("CUDA is not initialised in this kernel yet: tracing starts only once something uses the GPU "
                   "(gpucleanup never initialises CUDA itself); run a cell that uses the GPU, then try again",
                   0, tried);
  }
  if (s.cupti.handle == nullptr) {
    const std::string error = load_cupti(s.cupti, candidates, tried);
    if (!error.empty()) {
      return refused(error + ": install the CUDA Toolkit's CUPTI or the nvidia-cuda-cupti wheel, or set "
                             "GPUCLEANUP_CUPTI to the path of libcupti.so",
                     0, tried);
    }
  } else {
    tried.push_back({{"path", s.cupti.path}, {"error", nullptr}});
  }
  const char* callers = std::getenv("GPUCLEANUP_TRACE_CALLER");
  g_callers.store(callers == nullptr || std::string(callers) != "0");
  // The first backtrace() loads the unwinder: do it here, not inside a driver call.
  void* frames[4];
  (void)::backtrace(frames, 4);
  s.skipped_bases.clear();
  s.skipped_bases.insert(base_of(reinterpret_cast<const void*>(driver.api().cuMemGetInfo), nullptr));
  s.skipped_bases.insert(base_of(reinterpret_cast<const void*>(s.cupti.subscribe), nullptr));
  s.skipped_bases.insert(base_of(reinterpret_cast<const void*>(&callback), nullptr));

  CUpti_SubscriberHandle subscriber = nullptr;
  const CUptiResult subscribed = s.cupti.subscribe(&subscriber, &callback, nullptr);
  if (subscribed != CUPTI_SUCCESS) {
    std::string error = "cuptiSubscribe failed: " + result_text(s.cupti, subscribed);
    if (subscribed == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED) {
      error = "another tool holds CUPTI's only subscription in this process (torch.profiler keeps it once it "
              "ran; Nsight Systems, Nsight Compute and compute-sanitizer take it too): CUPTI before 13.3 allows "
              "one; restart the kernel without that profiler to trace allocations";
    }
    return {{"active", false}, {"library", s.cupti.path}, {"error", error},
            {"cupti_result", static_cast<int>(subscribed)}, {"tried", tried}};
  }
  for (const std::uint32_t cbid : kCallbacks) {
    const CUptiResult enabled = s.cupti.enable(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API, cbid);
    if (enabled != CUPTI_SUCCESS) {
      s.cupti.unsubscribe(subscriber);
      return {{"active", false}, {"library", s.cupti.path},
              {"error", "cuptiEnableCallback failed: " + result_text(s.cupti, enabled)},
              {"cupti_result", static_cast<int>(enabled)}, {"tried", tried}};
    }
  }
  s.subscriber = subscriber;
  s.active = true;
  s.live.clear();
  s.pools.clear();
  s.caller_of_site.clear();  // site ids are the hook's own: another hook may number them anew
  s.dropped = 0;
  g_active.store(true);
  return {{"active", true}, {"library", s.cupti.path}, {"error", nullptr}, {"cupti_result", 0}, {"tried", tried}};
}

nlohmann::json stop() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  g_active.store(false);
  g_site.store(nullptr);
  if (!s.active) return {{"active", false}, {"stopped", false}};
  s.cupti.unsubscribe(s.subscriber);
  s.subscriber = nullptr;
  s.active = false;
  return {{"active", false}, {"stopped", true}};
}

bool active() noexcept { return g_active.load(); }

void set_cell(std::int64_t cell) noexcept { g_cell.store(cell < 0 ? -1 : cell); }

nlohmann::json report(std::int64_t cell) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  struct Group {
    std::uint64_t bytes = 0;
    std::uint64_t count = 0;
    std::set<std::int64_t> threads;
  };
  using GroupKey = std::tuple<std::int64_t, int, int, int, std::int64_t>;  // site, caller, device, kind, cell
  std::map<GroupKey, Group> groups;
  std::uint64_t live_bytes = 0;
  for (const auto& [key, a] : s.live) {
    live_bytes += a.bytes;
    if (cell >= 0 && a.cell != cell) continue;
    Group& g = groups[{a.site, a.caller, a.device, static_cast<int>(a.kind), a.cell}];
    g.bytes += a.bytes;
    ++g.count;
    g.threads.insert(a.tid);
  }
  nlohmann::json out = {{"active", s.active},
                        {"library", s.cupti.handle != nullptr ? nlohmann::json(s.cupti.path) : nlohmann::json()},
                        {"live_bytes", live_bytes},
                        {"live_allocations", s.live.size()},
                        {"dropped", s.dropped},
                        {"groups", nlohmann::json::array()},
                        {"pools", nlohmann::json::array()}};
  std::vector<std::pair<GroupKey, Group>> sorted(groups.begin(), groups.end());
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const auto& a, const auto& b) { return a.second.bytes > b.second.bytes; });
  for (const auto& [key, g] : sorted) {
    const auto& [site, caller, device, kind, made_in] = key;
    nlohmann::json threads = nlohmann::json::array();
    for (const std::int64_t tid : g.threads) {
      if (threads.size() >= kMaxThreadsListed) break;
      threads.push_back(tid);
    }
    out["groups"].push_back({{"site", site},
                             {"caller", caller >= 0 ? nlohmann::json(s.callers[caller]) : nlohmann::json()},
                             {"device", device},
                             {"kind", to_string(static_cast<Kind>(kind))},
                             {"cell", made_in},
                             {"bytes", g.bytes},
                             {"count", g.count},
                             {"threads", threads},
                             {"thread_count", g.threads.size()}});
  }
  for (const auto& [pool, device] : s.pools) {
    out["pools"].push_back({{"handle", pool_handle_text(pool)}, {"device", device}});
  }
  return out;
}

std::vector<CUmemoryPool> pools_of(CUdevice device) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<CUmemoryPool> found;
  for (const auto& [pool, on] : s.pools) {
    if (on == static_cast<int>(device)) found.push_back(pool);
  }
  return found;
}

void reset_for_tests() noexcept {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.live.clear();
  s.pools.clear();
  s.dropped = 0;
  s.device_of_context.clear();
  s.caller_of_site.clear();
  g_cell.store(-1);
}

}  // namespace gpucleanup::trace
