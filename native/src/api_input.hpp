// The C ABI's checks of the JSON the extension hands in (config, state, cell
// records, trace candidates), apart from the entry points so that the fuzz
// targets of tests/fuzz run them as they are.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpucleanup/gpucleanup.h"

namespace gpucleanup {

// An error status and its "[gpucleanup.api.<n>] ..." message: what a C ABI
// call returns and leaves as gpucleanup_last_error.
class Failure {
 public:
  Failure(gpucleanup_status status, std::string message) : status_(status), message_(std::move(message)) {}
  gpucleanup_status status() const { return status_; }
  const std::string& message() const { return message_; }

 private:
  gpucleanup_status status_;
  std::string message_;
};

[[noreturn]] void fail(gpucleanup_status status, std::string message);

// `text` parsed as one JSON object; `what` names the argument in the message.
// Throws Failure (GPUCLEANUP_ERR_INVALID_ARGUMENT, api.104) for NULL, text
// that is not JSON, and JSON that is not an object.
nlohmann::json parse_object(const char* text, const char* what);

// The text of one JSON object, checked without building it (json::accept is a
// parse without the tree), without the whitespace around it: a cell record is
// kept and sent as text. Throws Failure (api.104) as parse_object does; text
// parse_object takes is taken here too, but for a leading byte order mark
// (the text is spliced into the messages the server publishes as it is).
std::string checked_object_text(const char* text, const char* what);

// The paths of libcupti to try, from a JSON array of strings (NULL is not
// one). Throws Failure (GPUCLEANUP_ERR_INVALID_ARGUMENT, api.113) otherwise.
std::vector<std::string> parse_trace_candidates(const char* text);

}  // namespace gpucleanup
