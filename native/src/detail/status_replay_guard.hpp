// Replay protection for signed status requests: a request is accepted once,
// and only while its timestamp is recent. Signatures are remembered for the
// window; beyond the capacity the oldest are forgotten first, which is safe
// as long as the capacity exceeds the requests one window can carry.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <string>
#include <unordered_set>
#include <utility>

namespace gpucleanup::detail {

class ReplayGuard {
 public:
  enum class Verdict { fresh, duplicate, stale, future };

  ReplayGuard(std::int64_t window_ns, std::size_t capacity)
      : window_ns_(window_ns), capacity_(capacity == 0 ? 1 : capacity) {}

  // Judges a verified signature with the request's own time; remembers it
  // when fresh. The window's ends saturate at the ends of int64: a window of
  // centuries (the config takes any number of seconds) reaches the end of the
  // clock instead of overflowing.
  Verdict admit(const std::string& signature, std::int64_t request_ns, std::int64_t now_ns) {
    const std::int64_t oldest = saturating_sub(now_ns, window_ns_);
    forget_before(oldest);
    if (request_ns < oldest) return Verdict::stale;
    // Clocks of one machine agree; a time far ahead would outlive the window.
    if (request_ns > saturating_add(now_ns, window_ns_)) return Verdict::future;
    if (seen_.count(signature) != 0) return Verdict::duplicate;
    while (order_.size() >= capacity_) {
      seen_.erase(order_.front().second);
      order_.pop_front();
    }
    seen_.insert(signature);
    order_.emplace_back(now_ns, signature);
    return Verdict::fresh;
  }

  std::size_t size() const noexcept { return order_.size(); }

  // A window of `seconds` in ns, for the constructor: saturated at the int64
  // range, and 0 for NaN.
  static std::int64_t window_of(double seconds) noexcept {
    const double ns = seconds * 1e9;
    if (std::isnan(ns)) return 0;
    if (ns >= 9.2e18) return std::numeric_limits<std::int64_t>::max();
    if (ns <= -9.2e18) return std::numeric_limits<std::int64_t>::min();
    return static_cast<std::int64_t>(ns);
  }

 private:
  static std::int64_t saturating_add(std::int64_t a, std::int64_t b) noexcept {
    std::int64_t sum = 0;
    if (!__builtin_add_overflow(a, b, &sum)) return sum;
    return b > 0 ? std::numeric_limits<std::int64_t>::max() : std::numeric_limits<std::int64_t>::min();
  }
  static std::int64_t saturating_sub(std::int64_t a, std::int64_t b) noexcept {
    std::int64_t difference = 0;
    if (!__builtin_sub_overflow(a, b, &difference)) return difference;
    return b > 0 ? std::numeric_limits<std::int64_t>::min() : std::numeric_limits<std::int64_t>::max();
  }

  void forget_before(std::int64_t cutoff_ns) {
    while (!order_.empty() && order_.front().first < cutoff_ns) {
      seen_.erase(order_.front().second);
      order_.pop_front();
    }
  }

  std::int64_t window_ns_;
  std::size_t capacity_;
  std::unordered_set<std::string> seen_;
  std::deque<std::pair<std::int64_t, std::string>> order_;
};

}  // namespace gpucleanup::detail
