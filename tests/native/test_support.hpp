// Helpers shared by the C++ tests: the fake driver's control API, loaded from
// the same path libgpucleanup dlopens, so a test scripts the very instance the
// library talks to.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace gpucleanup::testing {

constexpr std::uint64_t GiB = 1ull << 30;
constexpr std::uint64_t MiB = 1ull << 20;

// Scenario: 8 devices, the primary contexts of GPU1, GPU4 and GPU6 active.
nlohmann::json eight_devices_three_in_use();

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
