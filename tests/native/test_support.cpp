#include "test_support.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <stdexcept>

namespace gpucleanup::testing {
namespace {

template <typename Fn>
Fn resolve(void* handle, const char* name) {
  auto* symbol = dlsym(handle, name);
  if (symbol == nullptr) throw std::runtime_error(std::string("fake driver lacks ") + name);
  return reinterpret_cast<Fn>(symbol);
}

}  // namespace

nlohmann::json eight_devices_three_in_use() {
  nlohmann::json devices = nlohmann::json::array();
  for (int i = 0; i < 8; ++i) devices.push_back({{"primary_active", i == 1 || i == 4 || i == 6}});
  return {{"devices", devices}};
}

FakeCuda::FakeCuda(const char* path) : path_(path) {
  setenv("GPUCLEANUP_LIBCUDA", path, 1);
  handle_ = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (handle_ == nullptr) throw std::runtime_error(std::string("cannot load fake driver: ") + dlerror());
}

void FakeCuda::reset(const nlohmann::json& scenario) {
  auto fn = resolve<int (*)(const char*)>(handle_, "fake_cuda_reset");
  if (fn(scenario.dump().c_str()) != 0) {
    throw std::runtime_error(resolve<const char* (*)()>(handle_, "fake_cuda_last_error")());
  }
}

void FakeCuda::update(const nlohmann::json& patch) {
  auto fn = resolve<int (*)(const char*)>(handle_, "fake_cuda_update");
  if (fn(patch.dump().c_str()) != 0) {
    throw std::runtime_error(resolve<const char* (*)()>(handle_, "fake_cuda_last_error")());
  }
}

long long FakeCuda::counter(const std::string& name) const {
  return resolve<long long (*)(const char*)>(handle_, "fake_cuda_counter")(name.c_str());
}

void FakeCuda::release_sync() { resolve<void (*)()>(handle_, "fake_cuda_release_sync")(); }

nlohmann::json FakeCuda::state() const {
  return nlohmann::json::parse(resolve<const char* (*)()>(handle_, "fake_cuda_state_json")());
}

}  // namespace gpucleanup::testing
