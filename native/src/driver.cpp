#include "driver.hpp"

#include <dlfcn.h>
#include <sys/stat.h>

#include <atomic>
#include <cstdlib>

#include "detail/cuda_error_names.hpp"

namespace gpucleanup {
namespace detail {

struct LoadedDriver {
  std::string path;
  void* handle = nullptr;
  Resolver resolver = Resolver::none;
  std::optional<int> version;
  std::vector<std::string> missing_required;
  std::vector<std::string> missing_optional;
  std::string message;
  EntryPoints api;
};

}  // namespace detail

namespace {

using ProcAddressV2 = PFN_cuGetProcAddress_v12000;
using ProcAddressV1 = PFN_cuGetProcAddress_v11030;

// Finds one entry point with whichever resolver the driver offers. When the
// driver has a resolver its answer is final: a symbol it reports as absent is
// absent, even if a dlsym of an older symbol would find something.
void* find(const detail::LoadedDriver& d, const char* name, int version, const char* symbol) {
  void* pfn = nullptr;
  switch (d.resolver) {
    case Resolver::proc_address_v2: {
      auto resolve = reinterpret_cast<ProcAddressV2>(dlsym(d.handle, "cuGetProcAddress_v2"));
      CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
      if (resolve(name, &pfn, version, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS) return nullptr;
      return pfn;
    }
    case Resolver::proc_address: {
      auto resolve = reinterpret_cast<ProcAddressV1>(dlsym(d.handle, "cuGetProcAddress"));
      if (resolve(name, &pfn, version, CU_GET_PROC_ADDRESS_DEFAULT) != CUDA_SUCCESS) return nullptr;
      return pfn;
    }
    case Resolver::dlsym:
      return dlsym(d.handle, symbol);
    case Resolver::none:
      break;
  }
  return nullptr;
}

std::shared_ptr<const detail::LoadedDriver> load(const std::string& path) {
  auto d = std::make_shared<detail::LoadedDriver>();
  d->path = path;
  if (const std::string why = not_loadable(path); !why.empty()) {
    d->message = "[gpucleanup.driver.101] no CUDA driver: cannot load " + path + " (" + why +
                 "): point GPUCLEANUP_LIBCUDA at the NVIDIA driver's libcuda.so.1, or unset it";
    return d;
  }
  // RTLD_LOCAL: the driver's symbols must not satisfy anyone else's lookups.
  d->handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (d->handle == nullptr) {
    const char* why = dlerror();
    d->message = "[gpucleanup.driver.101] no CUDA driver: cannot load " + path + " (" +
                 (why != nullptr ? why : "unknown reason") + "): there is no GPU memory to clean on this machine";
    return d;
  }
  // A 12.x+ driver exports both resolvers; the _v2 one is the ABI that
  // cuda.h >= 12.0 declares, so it is preferred.
  if (dlsym(d->handle, "cuGetProcAddress_v2") != nullptr) {
    d->resolver = Resolver::proc_address_v2;
  } else if (dlsym(d->handle, "cuGetProcAddress") != nullptr) {
    d->resolver = Resolver::proc_address;
  } else {
    d->resolver = Resolver::dlsym;
  }

// The name is stringized unexpanded: cuda.h #defines several base names to
// their _v2 symbols, and cuGetProcAddress wants the base name.
  std::size_t required = 0;
#define GPUCLEANUP_REQUIRED(name, version, symbol)                                              \
  ++required;                                                                                   \
  d->api.name = reinterpret_cast<PFN_##name##_v##version>(find(*d, #name, version, #symbol)); \
  if (d->api.name == nullptr) d->missing_required.push_back(#name);
#define GPUCLEANUP_OPTIONAL(name, version, symbol)                                              \
  d->api.name = reinterpret_cast<PFN_##name##_v##version>(find(*d, #name, version, #symbol)); \
  if (d->api.name == nullptr) d->missing_optional.push_back(#name);
#include "detail/entry_points.inc"
#undef GPUCLEANUP_REQUIRED
#undef GPUCLEANUP_OPTIONAL

  if (d->missing_required.size() == required && d->resolver == Resolver::dlsym) {
    // Nothing of the driver API at all: the path names some other library
    // (GPUCLEANUP_LIBCUDA=libc.so.6); telling the user to update the driver would mislead.
    d->message = "[gpucleanup.driver.107] " + path +
                 " is not a CUDA driver: it exports none of the driver's entry points (cuDeviceGetCount, "
                 "cuMemGetInfo, ...): point GPUCLEANUP_LIBCUDA at the NVIDIA driver's libcuda.so.1, or unset it";
  } else if (!d->missing_required.empty()) {
    std::string names;
    for (const auto& name : d->missing_required) names += (names.empty() ? "" : ", ") + name;
    d->message = "[gpucleanup.driver.102] the CUDA driver " + path + " lacks " + names +
                 ", which gpucleanup needs: update the NVIDIA driver";
  }
  if (d->api.cuDriverGetVersion != nullptr) {
    int version = 0;
    if (d->api.cuDriverGetVersion(&version) == CUDA_SUCCESS) d->version = version;
  }
  return d;
}

}  // namespace

const char* to_string(Resolver resolver) noexcept {
  switch (resolver) {
    case Resolver::proc_address_v2: return "cuGetProcAddress_v2";
    case Resolver::proc_address: return "cuGetProcAddress";
    case Resolver::dlsym: return "dlsym";
    case Resolver::none: break;
  }
  return "none";
}

bool is_sticky(CUresult code) noexcept {
  switch (code) {
    case CUDA_ERROR_ILLEGAL_ADDRESS:
    case CUDA_ERROR_LAUNCH_TIMEOUT:
    case CUDA_ERROR_ASSERT:
    case CUDA_ERROR_HARDWARE_STACK_ERROR:
    case CUDA_ERROR_ILLEGAL_INSTRUCTION:
    case CUDA_ERROR_MISALIGNED_ADDRESS:
    case CUDA_ERROR_INVALID_ADDRESS_SPACE:
    case CUDA_ERROR_INVALID_PC:
    case CUDA_ERROR_LAUNCH_FAILED:
    case CUDA_ERROR_CONTAINED:
      return true;
    default:
      return false;
  }
}

std::string not_loadable(const std::string& path) {
  if (path.find('/') == std::string::npos) return "";
  struct stat info {};
  if (stat(path.c_str(), &info) != 0 || S_ISREG(info.st_mode)) return "";  // dlopen says why it cannot
  if (S_ISFIFO(info.st_mode)) return "a FIFO, not a library";
  if (S_ISDIR(info.st_mode)) return "a directory, not a library";
  return "not a regular file";
}

Driver::Driver(const std::string& path) : loaded_(load(path)) {}

std::string Driver::default_path() {
  const char* path = std::getenv("GPUCLEANUP_LIBCUDA");
  return path != nullptr && *path != '\0' ? path : "libcuda.so.1";
}

const Driver& Driver::process() {
  // Leaked on purpose: threads still blocked in the driver at exit keep using
  // it, and no destructor may run driver code while the process exits.
  static std::atomic<const Driver*> instance{nullptr};
  const Driver* current = instance.load(std::memory_order_acquire);
  if (current == nullptr) {
    auto* fresh = new Driver(default_path());
    if (instance.compare_exchange_strong(current, fresh, std::memory_order_acq_rel)) {
      current = fresh;
    } else {
      delete fresh;
    }
  }
  return *current;
}

bool Driver::loaded() const noexcept { return loaded_->handle != nullptr; }
bool Driver::usable() const noexcept { return loaded() && loaded_->missing_required.empty(); }
const std::string& Driver::path() const noexcept { return loaded_->path; }
Resolver Driver::resolver() const noexcept { return loaded_->resolver; }
std::optional<int> Driver::version() const noexcept { return loaded_->version; }
const std::vector<std::string>& Driver::missing_required() const noexcept { return loaded_->missing_required; }
const std::vector<std::string>& Driver::missing_optional() const noexcept { return loaded_->missing_optional; }
const std::string& Driver::message() const noexcept { return loaded_->message; }
const EntryPoints& Driver::api() const noexcept { return loaded_->api; }

void* Driver::resolve(const char* name, int version, const char* symbol) const noexcept {
  if (!loaded()) return nullptr;
  return find(*loaded_, name, version, symbol);
}

std::string Driver::error_name(CUresult code) const {
  if (loaded_->api.cuGetErrorName != nullptr) {
    const char* name = nullptr;
    if (loaded_->api.cuGetErrorName(code, &name) == CUDA_SUCCESS && name != nullptr) return name;
  }
  for (const auto& entry : detail::kCudaErrorNames) {
    if (entry.code == code) return entry.name;
  }
  return "CUresult " + std::to_string(static_cast<int>(code));
}

}  // namespace gpucleanup
