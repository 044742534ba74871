#include "watchdog.hpp"

#include <pthread.h>
#include <dlfcn.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "process_state.hpp"

namespace gpucleanup {
namespace {

std::atomic<std::uint64_t> threads_started{0};

// Keeps this library mapped until the process ends: a watchdog may still be
// blocked in the driver, or waiting for its next job, when someone dlcloses it.
void pin_library() noexcept {
  static std::once_flag once;
  std::call_once(once, [] {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&pin_library), &info) != 0 && info.dli_fname != nullptr) {
      dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD | RTLD_NODELETE);  // the handle is kept on purpose
    }
  });
}

}  // namespace

struct Watchdog::Queue {
  std::mutex mutex;
  std::condition_variable ready;
  std::deque<std::function<void()>> jobs;
  bool quit = false;  // the handle was dropped: end once the queue is empty
};

Watchdog::Watchdog() : queue_(std::make_shared<Queue>()), generation_(fork_generation()) {
  pin_library();
  std::thread(
      [](std::shared_ptr<Queue> queue) {
        pthread_setname_np(pthread_self(), "gpucleanup-dog");  // named: see status_server.cpp
        for (;;) {
          std::function<void()> job;
          {
            std::unique_lock lock(queue->mutex);
            queue->ready.wait(lock, [&] { return queue->quit || !queue->jobs.empty(); });
            if (queue->jobs.empty()) return;
            job = std::move(queue->jobs.front());
            queue->jobs.pop_front();
          }
          try {
            job();
          } catch (...) {
          }
        }
      },
      queue_)
      .detach();
  threads_started.fetch_add(1, std::memory_order_relaxed);
}

Watchdog::~Watchdog() {
  if (!alive()) return;  // a forked child: the thread and its lock are the parent's
  {
    std::lock_guard lock(queue_->mutex);
    queue_->quit = true;
  }
  queue_->ready.notify_all();
}

void Watchdog::submit(std::function<void()> job) {
  {
    std::lock_guard lock(queue_->mutex);
    queue_->jobs.push_back(std::move(job));
  }
  queue_->ready.notify_one();
}

bool Watchdog::alive() const noexcept { return generation_ == fork_generation(); }

std::uint64_t watchdog_threads_started() noexcept { return threads_started.load(std::memory_order_relaxed); }

}  // namespace gpucleanup
