// The entry-point resolvers, compiled per variant (FAKE_CUDA_RESOLVER):
//   2: cuGetProcAddress_v2 (CUDA 12.0, 5 arguments) and cuGetProcAddress (11.3, 4)
//   1: cuGetProcAddress only, as an 11.3-11.8 driver
//   0: neither, as a driver older than 11.3: callers must dlsym the _v2 symbols
//
// Both resolvers share one table built from entry_points.inc, so the fake
// cannot lack an entry point that gpucleanup uses: it would not link.
#include <cstring>
#include <string>

#include "driver_exports.hpp"
#include "scenario.hpp"

#ifndef FAKE_CUDA_RESOLVER
#error "FAKE_CUDA_RESOLVER must be 0, 1 or 2 (set by tests/fake_cuda/CMakeLists.txt)"
#endif

#if FAKE_CUDA_RESOLVER > 0
namespace {

struct Entry {
  const char* name;  // base name, as passed to cuGetProcAddress
  void* function;    // the exported symbol of that ABI version
  int since;         // the cudaVersion that ABI version needs
};

const Entry kEntries[] = {
#define GPUCLEANUP_REQUIRED(name, pfn_version, symbol) {#name, reinterpret_cast<void*>(&symbol), pfn_version},
#define GPUCLEANUP_OPTIONAL(name, pfn_version, symbol) {#name, reinterpret_cast<void*>(&symbol), pfn_version},
#include "detail/entry_points.inc"
#undef GPUCLEANUP_REQUIRED
#undef GPUCLEANUP_OPTIONAL
    {"cuInit", reinterpret_cast<void*>(&cuInit), 2000},
#if FAKE_CUDA_RESOLVER >= 2
    // A 12.x caller asking for the resolver itself gets the 5-argument one.
    {"cuGetProcAddress", reinterpret_cast<void*>(&cuGetProcAddress_v2), 12000},
#endif
    {"cuGetProcAddress", reinterpret_cast<void*>(&cuGetProcAddress), 11030},
};

// Looks `symbol` up for `cudaVersion` as the driver documents it: a version
// above the driver's is CUDA_ERROR_INVALID_VALUE; an unknown, missing or
// too-new symbol is CUDA_SUCCESS with *pfn = NULL and the reason in
// *symbolStatus.
CUresult resolve(const char* entry, const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags,
                 CUdriverProcAddressQueryResult* symbolStatus) {
  auto lock = fake_cuda::lock_state();
  auto& s = fake_cuda::state();
  ++s.counters[std::string("calls.") + entry];
  if (auto it = s.errors.find("cuGetProcAddress"); it != s.errors.end()) return it->second;

  constexpr cuuint64_t kKnownFlags = CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
  if (symbol == nullptr || pfn == nullptr || (flags & ~kKnownFlags) != 0) return CUDA_ERROR_INVALID_VALUE;
  *pfn = nullptr;
  if (cudaVersion > s.driver_version) return CUDA_ERROR_INVALID_VALUE;

  auto status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  if (s.missing.count(symbol) == 0) {
    // Entries of one name are listed newest first.
    for (const auto& e : kEntries) {
      if (std::strcmp(e.name, symbol) != 0) continue;
      if (cudaVersion >= e.since) {
        *pfn = e.function;
        status = CU_GET_PROC_ADDRESS_SUCCESS;
        break;
      }
      // The fake has no older ABI of the entry points (cuMemGetInfo with
      // unsigned int sizes and so on): a request for one finds nothing.
      status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
    }
  }
  if (symbolStatus != nullptr) *symbolStatus = status;
  return CUDA_SUCCESS;
}

}  // namespace

extern "C" {

FAKE_CUDA_EXPORT CUresult CUDAAPI cuGetProcAddress(const char* symbol, void** pfn, int cudaVersion,
                                                   cuuint64_t flags) {
  return resolve("cuGetProcAddress", symbol, pfn, cudaVersion, flags, nullptr);
}

#if FAKE_CUDA_RESOLVER >= 2
FAKE_CUDA_EXPORT CUresult CUDAAPI cuGetProcAddress_v2(const char* symbol, void** pfn, int cudaVersion,
                                                      cuuint64_t flags,
                                                      CUdriverProcAddressQueryResult* symbolStatus) {
  return resolve("cuGetProcAddress_v2", symbol, pfn, cudaVersion, flags, symbolStatus);
}
#endif

}  // extern "C"
#endif  // FAKE_CUDA_RESOLVER > 0
