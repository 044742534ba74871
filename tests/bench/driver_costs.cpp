// What one after-cell pass costs in the driver, call by call, on a real GPU.
//
// Times (median and p90 over N rounds, microseconds) each driver call the
// native pass makes for one idle device, and the hand-off to a long-lived
// thread and back (what a settle on the device's watchdog costs on top of
// cuCtxSynchronize), with a quiet gap before each round as between two cells.
// Build: tests/bench/build_driver_costs.sh (the CUDA headers only: the driver
// is opened with dlopen where it runs). Run: driver_costs [rounds] [gap_us]
#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

void* g_driver = nullptr;

template <class Fn>
Fn entry(const char* name) {  // the versioned symbol cuda.h maps each name to
  void* found = dlsym(g_driver, name);
  if (found == nullptr) {
    std::fprintf(stderr, "driver_costs: libcuda.so.1 has no %s\n", name);
    std::exit(1);
  }
  return reinterpret_cast<Fn>(found);
}

#define DRIVER(fn, symbol) const auto p_##fn = entry<decltype(&::fn)>(symbol)

void (*check)(CUresult, const char*) = nullptr;

struct Handoff {  // a watchdog-like thread: one job at a time, woken by a condition variable
  std::mutex m;
  std::condition_variable cv;
  std::function<void()> job;
  bool done = false, quit = false;
  std::thread t{[this] {
    std::unique_lock l(m);
    while (true) {
      cv.wait(l, [&] { return quit || job; });
      if (quit) return;
      auto j = std::move(job);
      job = nullptr;
      l.unlock();
      j();
      l.lock();
      done = true;
      cv.notify_all();
    }
  }};
  void run(std::function<void()> j) {
    std::unique_lock l(m);
    done = false;
    job = std::move(j);
    cv.notify_all();
    cv.wait(l, [&] { return done; });
  }
  ~Handoff() {
    {
      std::lock_guard l(m);
      quit = true;
    }
    cv.notify_all();
    t.join();
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 2000;
  const int gap_us = argc > 2 ? std::atoi(argv[2]) : 1000;
  g_driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (g_driver == nullptr) {
    std::fprintf(stderr, "driver_costs: cannot open libcuda.so.1: %s\n", dlerror());
    return 1;
  }
  DRIVER(cuInit, "cuInit");
  DRIVER(cuDeviceGet, "cuDeviceGet");
  DRIVER(cuDeviceGetCount, "cuDeviceGetCount");
  DRIVER(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  DRIVER(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
  DRIVER(cuDevicePrimaryCtxGetState, "cuDevicePrimaryCtxGetState");
  DRIVER(cuCtxSetCurrent, "cuCtxSetCurrent");
  DRIVER(cuCtxGetCurrent, "cuCtxGetCurrent");
  DRIVER(cuCtxPushCurrent, "cuCtxPushCurrent_v2");
  DRIVER(cuCtxPopCurrent, "cuCtxPopCurrent_v2");
  DRIVER(cuCtxSynchronize, "cuCtxSynchronize");
  DRIVER(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool");
  DRIVER(cuMemAllocAsync, "cuMemAllocAsync");
  DRIVER(cuMemFreeAsync, "cuMemFreeAsync");
  DRIVER(cuMemGetInfo, "cuMemGetInfo_v2");
  DRIVER(cuMemPoolGetAttribute, "cuMemPoolGetAttribute");
  DRIVER(cuMemPoolTrimTo, "cuMemPoolTrimTo");
  check = [](CUresult r, const char* what) {
    if (r != CUDA_SUCCESS) {
      std::fprintf(stderr, "driver_costs: %s failed: CUresult %d\n", what, static_cast<int>(r));
      std::exit(1);
    }
  };
  check(p_cuInit(0), "cuInit");
  CUdevice dev;
  check(p_cuDeviceGet(&dev, 0), "cuDeviceGet");
  CUcontext ctx;
  check(p_cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(p_cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  CUmemoryPool pool;
  check(p_cuDeviceGetDefaultMemPool(&pool, dev), "cuDeviceGetDefaultMemPool");
  CUdeviceptr p;  // the pool has been used once, as after a framework's async free
  check(p_cuMemAllocAsync(&p, 64 << 20, nullptr), "cuMemAllocAsync");
  check(p_cuMemFreeAsync(p, nullptr), "cuMemFreeAsync");
  check(p_cuCtxSynchronize(), "cuCtxSynchronize");
  Handoff handoff;

  std::vector<std::pair<std::string, std::function<void()>>> calls = {
      {"cuDeviceGetCount", [&] { int n; p_cuDeviceGetCount(&n); }},
      {"cuCtxGetCurrent", [&] { CUcontext c; p_cuCtxGetCurrent(&c); }},
      {"cuDevicePrimaryCtxGetState", [&] { unsigned f; int a; p_cuDevicePrimaryCtxGetState(dev, &f, &a); }},
      {"cuDevicePrimaryCtxRetain+Release", [&] { CUcontext c; p_cuDevicePrimaryCtxRetain(&c, dev); p_cuDevicePrimaryCtxRelease(dev); }},
      {"cuCtxPushCurrent+PopCurrent", [&] { CUcontext c; p_cuCtxPushCurrent(ctx); p_cuCtxPopCurrent(&c); }},
      {"cuMemGetInfo", [&] { size_t f, t; p_cuMemGetInfo(&f, &t); }},
      {"cuMemPoolGetAttribute (reserved)", [&] { cuuint64_t v; p_cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &v); }},
      {"cuMemPoolTrimTo (nothing to trim)", [&] { p_cuMemPoolTrimTo(pool, 0); }},
      {"cuCtxSynchronize (idle)", [&] { p_cuCtxSynchronize(); }},
      {"hand-off to a thread and back (empty job)", [&] { handoff.run([] {}); }},
      {"hand-off + cuCtxSynchronize (idle)", [&] { handoff.run([&] { p_cuCtxSetCurrent(ctx); p_cuCtxSynchronize(); }); }},
  };
  std::printf("driver_costs: %d rounds, %d us quiet before each call; microseconds per call\n", rounds, gap_us);
  std::printf("  %-45s %9s %9s\n", "call", "median", "p90");
  for (auto& [name, fn] : calls) {
    std::vector<double> us;
    us.reserve(rounds);
    for (int i = 0; i < rounds; ++i) {
      if (gap_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
      const auto t0 = Clock::now();
      fn();
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    std::sort(us.begin(), us.end());
    std::printf("  %-45s %9.1f %9.1f\n", name.c_str(), us[us.size() / 2], us[us.size() * 9 / 10]);
  }
  p_cuDevicePrimaryCtxRelease(dev);
  return 0;
}
