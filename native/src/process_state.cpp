#include "process_state.hpp"

#include <pthread.h>

namespace gpucleanup {
namespace {

std::atomic<bool> exiting{false};
std::atomic<std::uint64_t> generation{0};
std::atomic<bool> driver_initialized_seen{false};
std::atomic<bool> forked_after_init{false};

static_assert(std::atomic<bool>::is_always_lock_free && std::atomic<std::uint64_t>::is_always_lock_free,
              "the fork handler may only touch lock-free atomics");

void on_fork_child() {
  generation.fetch_add(1, std::memory_order_acq_rel);
  if (driver_initialized_seen.load(std::memory_order_acquire)) {
    forked_after_init.store(true, std::memory_order_release);
  }
}

// Installed when the library is loaded, so even a fork before the first
// gpucleanup call is seen.
[[gnu::constructor]] void install_fork_handler() { pthread_atfork(nullptr, nullptr, on_fork_child); }

}  // namespace

bool process_is_exiting() noexcept { return exiting.load(std::memory_order_acquire); }
void mark_process_exiting() noexcept { exiting.store(true, std::memory_order_release); }
std::uint64_t fork_generation() noexcept { return generation.load(std::memory_order_acquire); }
void note_driver_initialized() noexcept { driver_initialized_seen.store(true, std::memory_order_release); }
bool forked_after_driver_init() noexcept { return forked_after_init.load(std::memory_order_acquire); }

}  // namespace gpucleanup
