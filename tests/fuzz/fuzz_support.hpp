// What the fuzz targets share: invariant checks that abort (libFuzzer keeps
// the input that broke one), and the targets' own framing of their input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

// Aborts with the condition and a description of the case when `cond` is false.
#define FUZZ_CHECK(cond, detail)                                                                        \
  do {                                                                                                  \
    if (!(cond)) {                                                                                      \
      const std::string fuzz_detail_ = (detail);                                                        \
      std::fprintf(stderr, "invariant broken at %s:%d: %s\n  %s\n", __FILE__, __LINE__, #cond,          \
                   fuzz_detail_.c_str());                                                               \
      std::abort();                                                                                     \
    }                                                                                                   \
  } while (0)

namespace gpucleanup::fuzz {

// Separates the pieces of one input (frames, key/data/signature): two bytes
// that never occur in UTF-8, so JSON text never holds them.
inline constexpr std::string_view kSeparator{"\xff\xfe", 2};

// `text` cut at the first max_pieces - 1 separators: at most max_pieces
// pieces, the last one holding the rest (separators included).
inline std::vector<std::string_view> split(std::string_view text, std::size_t max_pieces) {
  std::vector<std::string_view> pieces;
  while (pieces.size() + 1 < max_pieces) {
    const auto at = text.find(kSeparator);
    if (at == std::string_view::npos) break;
    pieces.push_back(text.substr(0, at));
    text.remove_prefix(at + kSeparator.size());
  }
  pieces.push_back(text);
  return pieces;
}

// Whether `id` is "gpucleanup.server.<digits>".
inline bool is_server_error_id(const std::string& id) {
  constexpr std::string_view prefix = "gpucleanup.server.";
  if (id.size() <= prefix.size() || id.compare(0, prefix.size(), prefix) != 0) return false;
  for (std::size_t i = prefix.size(); i < id.size(); ++i) {
    if (id[i] < '0' || id[i] > '9') return false;
  }
  return true;
}

inline std::string printable(std::string_view bytes, std::size_t limit = 200) {
  std::string out;
  for (const char c : bytes.substr(0, limit)) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f && c != '\\') {
      out += c;
    } else {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", u);
      out += escaped;
    }
  }
  if (bytes.size() > limit) out += "...";
  return out;
}

}  // namespace gpucleanup::fuzz
