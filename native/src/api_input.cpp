#include "api_input.hpp"

#include <algorithm>
#include <string_view>

namespace gpucleanup {

void fail(gpucleanup_status status, std::string message) { throw Failure(status, std::move(message)); }

nlohmann::json parse_object(const char* text, const char* what) {
  if (text == nullptr) {
    fail(GPUCLEANUP_ERR_INVALID_ARGUMENT,
         std::string("[gpucleanup.api.104] ") + what + " is NULL: pass a JSON object as a UTF-8 string");
  }
  nlohmann::json value = nlohmann::json::parse(text, nullptr, false);
  if (value.is_discarded() || !value.is_object()) {
    fail(GPUCLEANUP_ERR_INVALID_ARGUMENT,
         std::string("[gpucleanup.api.104] ") + what + " is not a JSON object: pass a JSON object such as {}");
  }
  return value;
}

std::string checked_object_text(const char* text, const char* what) {
  if (text == nullptr) {
    fail(GPUCLEANUP_ERR_INVALID_ARGUMENT,
         std::string("[gpucleanup.api.104] ") + what + " is NULL: pass a JSON object as a UTF-8 string");
  }
  std::string_view view(text);
  const auto first = view.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos || view[first] != '{' || !nlohmann::json::accept(view)) {
    fail(GPUCLEANUP_ERR_INVALID_ARGUMENT,
         std::string("[gpucleanup.api.104] ") + what + " is not a JSON object: pass a JSON object such as {}");
  }
  const auto last = view.find_last_not_of(" \t\r\n");
  return std::string(view.substr(first, last - first + 1));
}

std::vector<std::string> parse_trace_candidates(const char* text) {
  const nlohmann::json candidates = text == nullptr ? nlohmann::json() : nlohmann::json::parse(text, nullptr, false);
  if (!candidates.is_array() ||
      !std::all_of(candidates.begin(), candidates.end(), [](const nlohmann::json& c) { return c.is_string(); })) {
    fail(GPUCLEANUP_ERR_INVALID_ARGUMENT,
         "[gpucleanup.api.113] candidates_json is not a JSON array of strings: pass the paths of libcupti to try, "
         "such as [\"libcupti.so.13\"]");
  }
  return candidates.get<std::vector<std::string>>();
}

}  // namespace gpucleanup
