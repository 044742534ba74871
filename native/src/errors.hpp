// Errors with stable ids, raised only through the macros below.
//
// An id names the layer and a number: "gpucleanup.driver.201". The table of
// ids and what each tells the user to do lives in native/README.md; tests
// assert the exact text users see.
#pragma once

#include <stdexcept>
#include <string>

namespace gpucleanup {

class Error : public std::runtime_error {
 public:
  Error(std::string id, const std::string& message)
      : std::runtime_error("[" + id + "] " + message), id_(std::move(id)) {}
  const std::string& id() const noexcept { return id_; }

 private:
  std::string id_;
};

}  // namespace gpucleanup

// Throws gpucleanup::Error("[gpucleanup.<id>] <message>") when cond is false.
#define GPUCLEANUP_EXPECTS(cond, id, message)        \
  do {                                               \
    if (!(cond)) throw ::gpucleanup::Error((id), (message)); \
  } while (0)

#define GPUCLEANUP_FAIL(id, message) throw ::gpucleanup::Error((id), (message))
