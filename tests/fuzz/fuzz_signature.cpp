// Fuzz target: what admits a signed status request, apart from its JSON: the
// HMAC-SHA256 check (native/src/detail/hmac.hpp) and the replay guard
// (native/src/detail/status_replay_guard.hpp).
//
// Input: one mode byte, then
//   mode even: key, data and signature separated by "\xff\xfe" (kSeparator):
//     hmac_sha256_verify(key, data, signature) holds exactly when signature
//     is the lowercase hex HMAC that hmac_sha256_hex gives; that one holds,
//     and so does no other of its length (one hex digit changed, upper case).
//   mode odd: a replay guard's window (8 bytes, 0 to 2^63-1 ns) and capacity
//     (1 byte, 0 to 16), then admissions of 17 bytes each: signature (1 byte,
//     one of 8), the request's time (8 bytes, any), the clock (8 bytes, 0 to
//     2^63-1: CLOCK_REALTIME, which may step back). Each verdict is the one
//     the window gives, computed here without overflow (stale below
//     now - window, future above now + window); a signature just admitted is
//     a duplicate at once; a duplicate was admitted before; the guard never
//     holds more than its capacity.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <string_view>

#include "detail/hmac.hpp"
#include "detail/status_replay_guard.hpp"
#include "fuzz_support.hpp"

namespace {

using gpucleanup::detail::ReplayGuard;
using gpucleanup::fuzz::printable;

void signature(std::uint8_t mode, std::string_view input) {
  const auto pieces = gpucleanup::fuzz::split(input, 3);
  const std::string_view key = pieces[0];
  const std::string_view data = pieces.size() > 1 ? pieces[1] : std::string_view();
  const std::string_view given = pieces.size() > 2 ? pieces[2] : std::string_view();
  const std::string what = "key [" + printable(key) + "] data [" + printable(data) + "] signature [" +
                           printable(given) + "]";

  const std::string expected = gpucleanup::detail::hmac_sha256_hex(key, data);
  FUZZ_CHECK(expected.size() == 64, what);
  FUZZ_CHECK(expected.find_first_not_of("0123456789abcdef") == std::string::npos, what + " -> " + expected);
  FUZZ_CHECK(gpucleanup::detail::hmac_sha256_hex(key, data) == expected, what);
  FUZZ_CHECK(gpucleanup::detail::hmac_sha256_verify(key, data, given) == (given == expected),
             what + " expected " + expected);
  FUZZ_CHECK(gpucleanup::detail::hmac_sha256_verify(key, data, expected), what);

  std::string changed = expected;
  const std::size_t at = (mode >> 1) % changed.size();
  changed[at] = changed[at] == '0' ? '1' : '0';
  FUZZ_CHECK(!gpucleanup::detail::hmac_sha256_verify(key, data, changed), what + " with " + changed);
  std::string upper = expected;
  for (char& c : upper) c = (c >= 'a' && c <= 'f') ? static_cast<char>(c - 'a' + 'A') : c;
  if (upper != expected) FUZZ_CHECK(!gpucleanup::detail::hmac_sha256_verify(key, data, upper), what + " in upper case");
  FUZZ_CHECK(!gpucleanup::detail::hmac_sha256_verify(key, data, expected + "0"), what + " one digit longer");
  FUZZ_CHECK(!gpucleanup::detail::hmac_sha256_verify(key, data, expected.substr(0, 63)), what + " one digit shorter");
}

std::uint64_t read_u64(std::string_view& input) {
  std::uint64_t value = 0;
  const std::size_t n = std::min<std::size_t>(8, input.size());
  std::memcpy(&value, input.data(), n);
  input.remove_prefix(n);
  return value;
}

const char* verdict_name(ReplayGuard::Verdict verdict) {
  switch (verdict) {
    case ReplayGuard::Verdict::fresh:
      return "fresh";
    case ReplayGuard::Verdict::duplicate:
      return "duplicate";
    case ReplayGuard::Verdict::stale:
      return "stale";
    case ReplayGuard::Verdict::future:
      return "future";
  }
  return "?";
}

void replay(std::string_view input) {
  constexpr std::uint64_t kNonNegative = ~(std::uint64_t{1} << 63);
  const auto window = static_cast<std::int64_t>(read_u64(input) & kNonNegative);
  const std::size_t capacity = input.empty() ? 0 : static_cast<unsigned char>(input[0]) % 17;
  if (!input.empty()) input.remove_prefix(1);
  ReplayGuard guard(window, capacity);
  std::set<std::string> admitted;
  while (input.size() >= 17) {
    const std::string signature = "signature-" + std::to_string(static_cast<unsigned char>(input[0]) % 8);
    input.remove_prefix(1);
    const auto request = static_cast<std::int64_t>(read_u64(input));
    const auto now = static_cast<std::int64_t>(read_u64(input) & kNonNegative);
    const std::string what = signature + " at " + std::to_string(request) + ", now " + std::to_string(now) +
                             ", window " + std::to_string(window) + ", capacity " + std::to_string(capacity);

    const ReplayGuard::Verdict verdict = guard.admit(signature, request, now);
    const __int128 low = static_cast<__int128>(now) - window;
    const __int128 high = static_cast<__int128>(now) + window;
    const ReplayGuard::Verdict by_time = request < low    ? ReplayGuard::Verdict::stale
                                         : request > high ? ReplayGuard::Verdict::future
                                                          : ReplayGuard::Verdict::fresh;
    if (by_time == ReplayGuard::Verdict::fresh) {
      FUZZ_CHECK(verdict == ReplayGuard::Verdict::fresh || verdict == ReplayGuard::Verdict::duplicate,
                 what + " -> " + verdict_name(verdict));
    } else {
      FUZZ_CHECK(verdict == by_time, what + " -> " + verdict_name(verdict) + ", not " + verdict_name(by_time));
    }
    if (verdict == ReplayGuard::Verdict::duplicate) {
      FUZZ_CHECK(admitted.count(signature) == 1, what + " -> duplicate of nothing");
    }
    if (verdict == ReplayGuard::Verdict::fresh) {
      admitted.insert(signature);
      FUZZ_CHECK(guard.admit(signature, request, now) == ReplayGuard::Verdict::duplicate, what + " admitted twice");
    }
    FUZZ_CHECK(guard.size() <= std::max<std::size_t>(capacity, 1), what + " holds " + std::to_string(guard.size()));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 1) {
    replay(input);
  } else {
    signature(data[0], input);
  }
  return 0;
}
