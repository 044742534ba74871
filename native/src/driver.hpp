// The CUDA driver, loaded with dlopen at first use and never unloaded.
//
// Loading has no side effects on the driver: nothing here calls cuInit or
// touches a context. A machine without libcuda is a state (loaded() is false,
// message() says why), not an error.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace gpucleanup {

// How the entry points were found, newest first.
enum class Resolver { none, proc_address_v2, proc_address, dlsym };
const char* to_string(Resolver resolver) noexcept;

// One member per line of detail/entry_points.inc, typed with the PFN of the
// version requested; null when the driver does not provide it.
struct EntryPoints {
#define GPUCLEANUP_REQUIRED(name, version, symbol) PFN_##name##_v##version name = nullptr;
#define GPUCLEANUP_OPTIONAL(name, version, symbol) PFN_##name##_v##version name = nullptr;
#include "detail/entry_points.inc"
#undef GPUCLEANUP_REQUIRED
#undef GPUCLEANUP_OPTIONAL
};

// Errors after which the context (and so the device, for this process) cannot
// be used again: CUDA_ERROR_ILLEGAL_ADDRESS and the like.
bool is_sticky(CUresult code) noexcept;

// dlopen() of a FIFO blocks until something writes to it, and a directory or a device is no
// library: why a path (a name with a slash; dlopen looks a bare name up itself) that is not a
// regular file, through links, must not be given to dlopen; empty when it may be.
std::string not_loadable(const std::string& path);

namespace detail {
struct LoadedDriver;
}

// A loaded driver library and its entry-point table. Copies share the same
// table, which is never destroyed, so a watchdog thread that outlives the call
// that started it can still use it.
class Driver {
 public:
  // Loads `path` (a file name or path for dlopen). Never throws for a missing
  // or incomplete driver: see loaded() and missing_required().
  explicit Driver(const std::string& path);

  // The process-wide driver: $GPUCLEANUP_LIBCUDA, else "libcuda.so.1", loaded
  // on the first call and kept for the life of the process (a forked child
  // inherits it).
  static const Driver& process();
  static std::string default_path();

  bool loaded() const noexcept;
  // Loaded and every required entry point present.
  bool usable() const noexcept;
  const std::string& path() const noexcept;
  Resolver resolver() const noexcept;
  // cuDriverGetVersion (callable before cuInit), read once at load.
  std::optional<int> version() const noexcept;
  const std::vector<std::string>& missing_required() const noexcept;
  const std::vector<std::string>& missing_optional() const noexcept;
  // Why the driver is not loaded or not usable; "" when usable.
  const std::string& message() const noexcept;

  // Valid while loaded(); members of missing entry points are null.
  const EntryPoints& api() const noexcept;

  // One entry point outside the table, found the same way (null when absent):
  // cuInit, which only the park helper process may call (checkpoint.cpp).
  void* resolve(const char* name, int version, const char* symbol) const noexcept;

  // "CUDA_ERROR_ILLEGAL_ADDRESS": from cuGetErrorName when the driver has it,
  // else from the table of cuda.h, else "CUresult <code>".
  std::string error_name(CUresult code) const;

 private:
  std::shared_ptr<const detail::LoadedDriver> loaded_;
};

}  // namespace gpucleanup
