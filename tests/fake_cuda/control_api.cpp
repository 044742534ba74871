// The control API of fake_cuda_control.h. Nothing here throws across the C
// boundary: a failure is -1 (or -1 as a counter) and a message.
#include <string>

#include "driver_exports.hpp"
#include "scenario.hpp"

namespace {

bool is_counter(const std::string& name) {
  static const char* const kPlain[] = {"cuInit",          "contexts_created", "retained",      "pushed",
                                       "syncs_in_flight", "threads",          "primary_resets", "events"};
  for (const char* plain : kPlain) {
    if (name == plain) return true;
  }
  const std::string prefix = "calls.";
  if (name.rfind(prefix, 0) != 0) return false;
  const std::string entry = name.substr(prefix.size());
  // The 5-argument resolver is counted apart from the 4-argument one, so a
  // test can tell which one the library chose.
  return entry == "cuGetProcAddress_v2" || fake_cuda::entry_names().count(entry) != 0;
}

// `load_first`: a patch applies to the scenario the environment gives when
// nothing was loaded yet; a reset replaces it, so it must not load it.
template <typename Change>
int control(const char* json, bool load_first, Change change) {
  auto& s = fake_cuda::state();
  auto lock = load_first ? fake_cuda::lock_state() : std::unique_lock<std::mutex>(s.mutex);
  try {
    change(s, std::string(json == nullptr ? "{}" : json));
    return 0;
  } catch (const std::exception& e) {
    s.last_error = e.what();
    return -1;
  }
}

}  // namespace

extern "C" {

FAKE_CUDA_EXPORT int fake_cuda_reset(const char* scenario_json) {
  return control(scenario_json, /*load_first=*/false, [](fake_cuda::State& s, const std::string& text) {
    fake_cuda::reset(s, text);
    fake_cuda::thread_contexts(s);  // the scenario's current context is this thread's
  });
}

FAKE_CUDA_EXPORT int fake_cuda_update(const char* patch_json) {
  return control(patch_json, /*load_first=*/true, [](fake_cuda::State& s, const std::string& text) { fake_cuda::update(s, text); });
}

FAKE_CUDA_EXPORT long long fake_cuda_counter(const char* name) {
  if (name == nullptr || !is_counter(name)) return -1;
  auto lock = fake_cuda::lock_state();
  const auto& counters = fake_cuda::state().counters;
  auto it = counters.find(name);
  return it == counters.end() ? 0 : it->second;
}

FAKE_CUDA_EXPORT int fake_cuda_reset_primary_context(int device) {
  auto& s = fake_cuda::state();
  auto lock = fake_cuda::lock_state();
  try {
    fake_cuda::reset_primary_context(s, device);
    return 0;
  } catch (const std::exception& e) {
    s.last_error = e.what();
    return -1;
  }
}

FAKE_CUDA_EXPORT void fake_cuda_release_sync(void) {
  auto lock = fake_cuda::lock_state();
  auto& s = fake_cuda::state();
  s.sync_released = true;
  s.sync_cv.notify_all();
}

FAKE_CUDA_EXPORT const char* fake_cuda_state_json(void) {
  auto lock = fake_cuda::lock_state();
  auto& s = fake_cuda::state();
  try {
    s.state_json = fake_cuda::dump(s);
  } catch (const std::exception& e) {
    s.last_error = e.what();
    s.state_json = "{}";
  }
  return s.state_json.c_str();
}

FAKE_CUDA_EXPORT const char* fake_cuda_last_error(void) {
  auto& s = fake_cuda::state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.last_error.c_str();
}

}  // extern "C"
