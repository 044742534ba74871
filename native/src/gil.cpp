#include "gil.hpp"

#include <atomic>
#include <new>

namespace gpucleanup::gil {
namespace {

struct Hooks {
  CheckFn check;
  SaveFn save;
  RestoreFn restore;
};

// Set once by the extension at load; read by every waiting call. A set of hooks
// is never freed (there are at most a few per process), so a reader never sees
// one half replaced.
std::atomic<const Hooks*> g_hooks{nullptr};

}  // namespace

void set_hooks(CheckFn check, SaveFn save, RestoreFn restore) noexcept {
  if (check == nullptr || save == nullptr || restore == nullptr) {
    g_hooks.store(nullptr);
    return;
  }
  const Hooks* current = g_hooks.load();
  if (current != nullptr && current->check == check && current->save == save && current->restore == restore) return;
  g_hooks.store(new (std::nothrow) Hooks{check, save, restore});
}

int held() noexcept {
  const Hooks* hooks = g_hooks.load();
  if (hooks == nullptr) return -1;
  return hooks->check() != 0 ? 1 : 0;
}

Released::Released() noexcept {
  const Hooks* hooks = g_hooks.load();
  if (hooks == nullptr || hooks->check() == 0) return;
  restore_ = hooks->restore;
  saved_ = hooks->save();
}

Released::~Released() {
  if (restore_ != nullptr) restore_(saved_);
}

}  // namespace gpucleanup::gil
