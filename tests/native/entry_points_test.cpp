// The list of C entry points (include/gpucleanup/entry_points.def), from which gpucleanup.h declares them and
// gpucleanup._native declares them to ctypes: every entry is defined by the library, once.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <type_traits>

#include "gpucleanup/gpucleanup.h"

namespace {

struct Entry {
  const char* name;
  const void* address;
};

// The type of each function is the table's (c_api.cpp's definitions must match the header's declarations).
#define GPUCLEANUP_ENTRY(result, name, parameters) \
  static_assert(std::is_same_v<decltype(&name), result(*) parameters>, #name);
#define GPUCLEANUP_ENTRY_ADDED GPUCLEANUP_ENTRY
#include "gpucleanup/entry_points.def"
#undef GPUCLEANUP_ENTRY
#undef GPUCLEANUP_ENTRY_ADDED

// Taking each address makes the link fail for an entry that the library declares and never defines.
#define GPUCLEANUP_ENTRY(result, name, parameters) Entry{#name, reinterpret_cast<const void*>(&name)},
#define GPUCLEANUP_ENTRY_ADDED GPUCLEANUP_ENTRY
const Entry kEntries[] = {
#include "gpucleanup/entry_points.def"
};
#undef GPUCLEANUP_ENTRY
#undef GPUCLEANUP_ENTRY_ADDED

TEST(EntryPoints, EveryEntryIsDefinedOnceUnderItsOwnName) {
  std::set<std::string> names;
  for (const Entry& entry : kEntries) {
    EXPECT_NE(entry.address, nullptr) << entry.name;
    EXPECT_EQ(std::string(entry.name).rfind("gpucleanup_", 0), 0u) << entry.name;
    EXPECT_TRUE(names.insert(entry.name).second) << entry.name << " is listed twice";
  }
  EXPECT_FALSE(names.empty());
}

}  // namespace
