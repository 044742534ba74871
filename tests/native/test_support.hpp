// Helpers shared by the C++ tests: the fake driver's control API, loaded from
// the same path libgpucleanup dlopens, so a test scripts the very instance the
// library talks to.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace gpucleanup::testing {

class FakeCuda {
 public:
  // Loads the fake at `path` (default: the main variant) and sets
  // GPUCLEANUP_LIBCUDA to it.
  explicit FakeCuda(const char* path = FAKE_CUDA_PATH);
  void reset(const nlohmann::json& scenario = nlohmann::json::object());
  void update(const nlohmann::json& patch);
  long long counter(const std::string& name) const;
  void release_sync();
  nlohmann::json state() const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  void* handle_ = nullptr;
};

}  // namespace gpucleanup::testing
