// What the whole process is doing, as far as driver calls are concerned: is it
// exiting, and is it a child forked from a parent that had CUDA initialised.
//
// Both answers are read before every driver call, so they are plain atomics,
// and the fork handler only touches lock-free atomics.
#pragma once

#include <atomic>
#include <cstdint>

namespace gpucleanup {

// Set by gpucleanup_shutdown and by the library's destructor: once set, no
// driver call is made again (the driver may already be tearing itself down).
bool process_is_exiting() noexcept;
void mark_process_exiting() noexcept;

// Bumped in every child created by fork(); state kept per generation starts
// afresh in the child (the parent's threads and locks do not exist there).
std::uint64_t fork_generation() noexcept;

// Recorded when a probe finds the driver initialised. A child forked after
// that must make no driver call at all: CUDA cannot be used in it.
void note_driver_initialized() noexcept;
bool forked_after_driver_init() noexcept;

// State that belongs to one process: a forked child gets a fresh, default
// constructed T on first use. The parent's T is leaked in the child, never
// destroyed, because its mutexes may be held by threads that did not survive
// the fork. Objects are also leaked at exit, so no destructor runs driver code.
template <typename T>
class PerProcess {
 public:
  T& get() {
    const std::uint64_t generation = fork_generation();
    Node* node = node_.load(std::memory_order_acquire);
    while (node == nullptr || node->generation != generation) {
      auto* fresh = new Node(generation);
      if (node_.compare_exchange_strong(node, fresh, std::memory_order_acq_rel)) return fresh->value;
      delete fresh;
    }
    return node->value;
  }

 private:
  struct Node {
    explicit Node(std::uint64_t g) : generation(g) {}
    std::uint64_t generation;
    T value{};
  };
  std::atomic<Node*> node_{nullptr};
};

}  // namespace gpucleanup
