#include "record_log.hpp"

#include <algorithm>
#include <utility>

#include "kernel_state.hpp"
#include "status_protocol.hpp"

namespace gpucleanup {
namespace {

using json = nlohmann::json;

// What a record published on tcp keeps. Any local user can subscribe to a tcp PUB socket (ZeroMQ has no access
// control there), so what goes out is built from an allow-list of the memory figures (share/schema/
// cell_record.schema.json): a field added to the record later stays private until it is named here. Left out:
// the notes, the variables and output entries that hold memory, the traced allocation sites (file names, lines,
// functions), what frameworks printed; the kernel's description goes as its pid only. The full record stays in
// the history, which answers signed requests only on tcp.
const char* const kPublicRecordFields[] = {"cell",    "time_ns",  "elapsed_s", "driver_state", "interrupted",
                                           "devices", "pinned",   "gc",        "touched",      "shown",
                                           "release", "deferred", "idle",      "totals"};
// Of each entry of "devices": its figures. "message" (a driver or framework message) is left out.
const char* const kPublicDeviceFields[] = {"index",         "name",           "state",
                                           "settle",        "total_bytes",    "used_at_start_bytes",
                                           "used_before_bytes", "used_after_bytes", "freed_bytes",
                                           "live_bytes",    "cached_bytes",   "quiet",
                                           "outside_bytes", "outside_growth_bytes"};

template <std::size_t N>
json allowed_fields(const json& from, const char* const (&names)[N]) {
  json out = json::object();
  for (const char* name : names) {
    if (const auto it = from.find(name); it != from.end()) out[name] = *it;
  }
  return out;
}

std::string public_record_text(const std::string& record) {
  const json value = json::parse(record, nullptr, false);
  if (!value.is_object()) return "{}";
  json out = allowed_fields(value, kPublicRecordFields);
  if (const auto devices = out.find("devices"); devices != out.end()) {
    json kept = json::array();
    if (devices->is_array()) {
      for (const json& device : *devices) {
        if (device.is_object()) kept.push_back(allowed_fields(device, kPublicDeviceFields));
      }
    }
    *devices = std::move(kept);
  }
  return dump_json(out);
}

json public_kernel(const json& kernel) {
  json out = json::object();
  if (const auto it = kernel.find("pid"); kernel.is_object() && it != kernel.end()) out["pid"] = *it;
  return out;
}

}  // namespace

RecordLog::RecordLog(std::size_t history_limit, json kernel, bool open_to_others)
    : history_limit_(history_limit),
      kernel_(open_to_others ? public_kernel(kernel) : std::move(kernel)),
      open_to_others_(open_to_others) {}

void RecordLog::publish(std::string record) {
  const std::string public_text = open_to_others_ ? public_record_text(record) : std::string();
  std::lock_guard<std::mutex> lock(mutex_);
  ++published_;
  // The message as dump() writes it (keys in order), with the record's text inside; on tcp the public copy.
  outbox_.push_back(record_message(kernel_, open_to_others_ ? public_text : record, published_, realtime_ns()));
  // Nobody reads a stopped server's outbox; the history is what survives.
  while (outbox_.size() > std::max<std::size_t>(history_limit_, 1)) outbox_.pop_front();
  history_.push_back(std::move(record));
  while (history_.size() > history_limit_) history_.pop_front();
}

std::deque<std::string> RecordLog::take_outbox() {
  std::deque<std::string> out;
  std::lock_guard<std::mutex> lock(mutex_);
  out.swap(outbox_);
  return out;
}

RecordLog::Summary RecordLog::summary() const {
  std::lock_guard<std::mutex> lock(mutex_);
  Summary out;
  if (!history_.empty()) out.last = history_.back();
  out.published = published_;
  out.size = history_.size();
  return out;
}

json RecordLog::records(std::size_t limit, std::uint64_t& published) const {
  std::lock_guard<std::mutex> lock(mutex_);
  json out = json::array();
  const std::size_t skip = history_.size() > limit ? history_.size() - limit : 0;
  for (std::size_t i = skip; i < history_.size(); ++i) out.push_back(json::parse(history_[i]));
  published = published_;
  return out;
}

}  // namespace gpucleanup
