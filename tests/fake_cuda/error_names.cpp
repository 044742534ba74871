// cuGetErrorName / cuGetErrorString: static text for the codes the fake and
// its scenarios use.
//
// They answer before cuInit: the real driver documents only CUDA_SUCCESS and
// CUDA_ERROR_INVALID_VALUE for them (a table lookup), and gpucleanup names
// CUDA_ERROR_NOT_INITIALIZED with them in exactly that state.
#include <string>

#include "driver_exports.hpp"
#include "scenario.hpp"

namespace {

struct ErrorText {
  CUresult code;
  const char* name;
  const char* text;  // after the driver's wording
};

constexpr ErrorText kErrors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_CONTEXT_ALREADY_IN_USE, "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
     "context already in use"},
    {CUDA_ERROR_CONTAINED, "CUDA_ERROR_CONTAINED",
     "an error was contained and the device must be reset"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_TIMEOUT, "CUDA_ERROR_LAUNCH_TIMEOUT", "the launch timed out and was terminated"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {CUDA_ERROR_ASSERT, "CUDA_ERROR_ASSERT", "device-side assert triggered"},
    {CUDA_ERROR_HARDWARE_STACK_ERROR, "CUDA_ERROR_HARDWARE_STACK_ERROR", "hardware stack error"},
    {CUDA_ERROR_ILLEGAL_INSTRUCTION, "CUDA_ERROR_ILLEGAL_INSTRUCTION", "an illegal instruction was encountered"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

const ErrorText* find(CUresult code) {
  for (const auto& error : kErrors) {
    if (error.code == code) return &error;
  }
  return nullptr;
}

// Shared by both entry points: unknown codes are CUDA_ERROR_INVALID_VALUE with
// *pStr set to NULL, as the driver does.
CUresult describe(const char* entry, CUresult code, const char** pStr, bool want_name) {
  auto lock = fake_cuda::lock_state();
  auto& s = fake_cuda::state();
  ++s.counters[std::string("calls.") + entry];
  if (auto it = s.errors.find(entry); it != s.errors.end()) return it->second;
  if (pStr == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const ErrorText* error = find(code);
  *pStr = error == nullptr ? nullptr : (want_name ? error->name : error->text);
  return error == nullptr ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

}  // namespace

extern "C" {

FAKE_CUDA_EXPORT CUresult CUDAAPI cuGetErrorName(CUresult error, const char** pStr) {
  return describe("cuGetErrorName", error, pStr, /*want_name=*/true);
}

FAKE_CUDA_EXPORT CUresult CUDAAPI cuGetErrorString(CUresult error, const char** pStr) {
  return describe("cuGetErrorString", error, pStr, /*want_name=*/false);
}

}  // extern "C"
