// The cells' records the status server keeps and publishes: the bounded
// history (each record's JSON text as the kernel handed it over), the outbox
// of record messages the server thread sends on PUB, and their count. On tcp,
// where any local user may subscribe, what is published is an allow-list of
// the record's memory figures; the history keeps the whole record. One lock;
// safe from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace gpucleanup {

class RecordLog {
 public:
  // kernel: the kernel's description each message carries (of it only "pid" on tcp); open_to_others: tcp.
  RecordLog(std::size_t history_limit, nlohmann::json kernel, bool open_to_others);

  // One record, one JSON object's text (checked by the caller).
  void publish(std::string record);
  // The messages waiting to be sent, taken.
  std::deque<std::string> take_outbox();

  struct Summary {
    std::optional<std::string> last;  // the last record's text
    std::uint64_t published = 0;
    std::size_t size = 0;
  };
  Summary summary() const;
  // The last `limit` records (at most the history's limit), parsed; and how many were ever published.
  nlohmann::json records(std::size_t limit, std::uint64_t& published) const;

 private:
  const std::size_t history_limit_;
  const nlohmann::json kernel_;
  const bool open_to_others_;
  mutable std::mutex mutex_;
  std::deque<std::string> history_;
  std::deque<std::string> outbox_;
  std::uint64_t published_ = 0;
};

}  // namespace gpucleanup
