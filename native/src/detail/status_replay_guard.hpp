// Replay protection for signed status requests: a request is accepted once,
// and only while its timestamp is recent. Signatures are remembered for the
// window; beyond the capacity the oldest are forgotten first, which is safe
// as long as the capacity exceeds the requests one window can carry.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
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
  // when fresh.
  Verdict admit(const std::string& signature, std::int64_t request_ns, std::int64_t now_ns) {
    forget_before(now_ns - window_ns_);
    if (request_ns < now_ns - window_ns_) return Verdict::stale;
    // Clocks of one machine agree; a time far ahead would outlive the window.
    if (request_ns > now_ns + window_ns_) return Verdict::future;
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

 private:
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
