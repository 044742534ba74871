// A fake libcupti for the tests: the four entry points gpucleanup resolves
// (cuptiSubscribe, cuptiUnsubscribe, cuptiEnableCallback, cuptiGetResultString)
// and a control API that plays driver calls to the subscriber, as CUPTI would
// at the entry and exit of each enabled driver API call.
//
// Like CUPTI before 13.3 it allows one subscriber: a second cuptiSubscribe
// returns CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED, and
// fake_cupti_reset(39) makes the first one fail that way too (another tool
// holds the subscription).
#include <cupti_callbacks.h>
#include <cupti_driver_cbid.h>
#include <cupti_result.h>

#include <cstddef>
#include <mutex>
#include <set>

#define FAKE_API extern "C" __attribute__((visibility("default")))

namespace {

struct Subscriber {
  int token = 0;
};

std::mutex g_mutex;
Subscriber g_subscriber;
bool g_subscribed = false;
CUpti_CallbackFunc g_callback = nullptr;
void* g_userdata = nullptr;
CUptiResult g_subscribe_result = CUPTI_SUCCESS;
std::set<CUpti_CallbackId> g_enabled;
int g_subscribe_calls = 0;

// Plays one driver call: entry, then exit with `result` as its return value.
int play(CUpti_CallbackId cbid, const char* name, const void* params, CUresult result) {
  CUpti_CallbackFunc callback = nullptr;
  void* userdata = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!g_subscribed || g_enabled.count(cbid) == 0) return 0;
    callback = g_callback;
    userdata = g_userdata;
  }
  CUresult returned = CUDA_SUCCESS;
  CUpti_CallbackData data{};
  data.functionName = name;
  data.functionParams = params;
  data.functionReturnValue = &returned;
  data.context = nullptr;
  data.callbackSite = CUPTI_API_ENTER;
  callback(userdata, CUPTI_CB_DOMAIN_DRIVER_API, cbid, &data);
  returned = result;
  data.callbackSite = CUPTI_API_EXIT;
  callback(userdata, CUPTI_CB_DOMAIN_DRIVER_API, cbid, &data);
  return 1;
}

}  // namespace

FAKE_API CUptiResult cuptiSubscribe(CUpti_SubscriberHandle* subscriber, CUpti_CallbackFunc callback, void* userdata) {
  std::lock_guard<std::mutex> lock(g_mutex);
  ++g_subscribe_calls;
  if (subscriber == nullptr || callback == nullptr) return CUPTI_ERROR_INVALID_PARAMETER;
  if (g_subscribe_result != CUPTI_SUCCESS) return g_subscribe_result;
  if (g_subscribed) return CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
  g_subscribed = true;
  g_callback = callback;
  g_userdata = userdata;
  g_enabled.clear();
  *subscriber = reinterpret_cast<CUpti_SubscriberHandle>(&g_subscriber);
  return CUPTI_SUCCESS;
}

FAKE_API CUptiResult cuptiUnsubscribe(CUpti_SubscriberHandle subscriber) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_subscribed || subscriber != reinterpret_cast<CUpti_SubscriberHandle>(&g_subscriber)) {
    return CUPTI_ERROR_INVALID_PARAMETER;
  }
  g_subscribed = false;
  g_callback = nullptr;
  g_enabled.clear();
  return CUPTI_SUCCESS;
}

FAKE_API CUptiResult cuptiEnableCallback(uint32_t enable, CUpti_SubscriberHandle subscriber,
                                         CUpti_CallbackDomain domain, CUpti_CallbackId cbid) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_subscribed || subscriber != reinterpret_cast<CUpti_SubscriberHandle>(&g_subscriber)) {
    return CUPTI_ERROR_INVALID_PARAMETER;
  }
  if (domain != CUPTI_CB_DOMAIN_DRIVER_API) return CUPTI_ERROR_INVALID_PARAMETER;
  if (enable != 0) {
    g_enabled.insert(cbid);
  } else {
    g_enabled.erase(cbid);
  }
  return CUPTI_SUCCESS;
}

FAKE_API CUptiResult cuptiGetResultString(CUptiResult result, const char** text) {
  if (text == nullptr) return CUPTI_ERROR_INVALID_PARAMETER;
  switch (result) {
    case CUPTI_SUCCESS: *text = "CUPTI_SUCCESS"; break;
    case CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED: *text = "CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED"; break;
    case CUPTI_ERROR_INSUFFICIENT_PRIVILEGES: *text = "CUPTI_ERROR_INSUFFICIENT_PRIVILEGES"; break;
    default: *text = "CUPTI_ERROR_UNKNOWN"; break;
  }
  return CUPTI_SUCCESS;
}

// -- control API -------------------------------------------------------------

// Forgets the subscriber; later cuptiSubscribe calls return `subscribe_result`
// (0: they succeed).
FAKE_API void fake_cupti_reset(int subscribe_result) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_subscribed = false;
  g_callback = nullptr;
  g_enabled.clear();
  g_subscribe_result = static_cast<CUptiResult>(subscribe_result);
  g_subscribe_calls = 0;
}

FAKE_API int fake_cupti_subscribed(void) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_subscribed ? 1 : 0;
}

FAKE_API int fake_cupti_subscribe_calls(void) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_subscribe_calls;
}

FAKE_API int fake_cupti_enabled(unsigned cbid) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_subscribed && g_enabled.count(cbid) != 0 ? 1 : 0;
}

// Each plays one driver call to the subscriber; returns 1 when delivered
// (subscribed and enabled), 0 otherwise. `result` is the call's CUresult.
FAKE_API int fake_cupti_mem_alloc(unsigned long long ptr, unsigned long long bytes, int result) {
  CUdeviceptr out = ptr;
  struct { CUdeviceptr* dptr; size_t bytesize; } params{&out, static_cast<size_t>(bytes)};
  return play(CUPTI_DRIVER_TRACE_CBID_cuMemAlloc_v2, "cuMemAlloc_v2", &params, static_cast<CUresult>(result));
}

FAKE_API int fake_cupti_mem_alloc_pitch(unsigned long long ptr, unsigned long long pitch, unsigned long long height) {
  CUdeviceptr out = ptr;
  size_t pitch_out = static_cast<size_t>(pitch);
  struct { CUdeviceptr* dptr; size_t* pPitch; size_t width; size_t height; unsigned int element; } params{
      &out, &pitch_out, static_cast<size_t>(pitch), static_cast<size_t>(height), 4};
  return play(CUPTI_DRIVER_TRACE_CBID_cuMemAllocPitch_v2, "cuMemAllocPitch_v2", &params, CUDA_SUCCESS);
}

FAKE_API int fake_cupti_mem_free(unsigned long long ptr) {
  struct { CUdeviceptr dptr; } params{ptr};
  return play(CUPTI_DRIVER_TRACE_CBID_cuMemFree_v2, "cuMemFree_v2", &params, CUDA_SUCCESS);
}

FAKE_API int fake_cupti_mem_create(unsigned long long handle, unsigned long long bytes, int device) {
  CUmemGenericAllocationHandle out = handle;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  struct { CUmemGenericAllocationHandle* handle; size_t size; const CUmemAllocationProp* prop; unsigned long long flags; }
      params{&out, static_cast<size_t>(bytes), &prop, 0};
  return play(CUPTI_DRIVER_TRACE_CBID_cuMemCreate, "cuMemCreate", &params, CUDA_SUCCESS);
}

FAKE_API int fake_cupti_mem_release(unsigned long long handle) {
  struct { CUmemGenericAllocationHandle handle; } params{handle};
  return play(CUPTI_DRIVER_TRACE_CBID_cuMemRelease, "cuMemRelease", &params, CUDA_SUCCESS);
}

FAKE_API int fake_cupti_pool_create(unsigned long long pool, int device) {
  CUmemoryPool out = reinterpret_cast<CUmemoryPool>(static_cast<uintptr_t>(pool));
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = device;
  struct { CUmemoryPool* pool; const CUmemPoolProps* props; } params{&out, &props};
  return play(CUPTI_DRIVER_TRACE_CBID_cuMemPoolCreate, "cuMemPoolCreate", &params, CUDA_SUCCESS);
}

FAKE_API int fake_cupti_pool_destroy(unsigned long long pool) {
  struct { CUmemoryPool pool; } params{reinterpret_cast<CUmemoryPool>(static_cast<uintptr_t>(pool))};
  return play(CUPTI_DRIVER_TRACE_CBID_cuMemPoolDestroy, "cuMemPoolDestroy", &params, CUDA_SUCCESS);
}
