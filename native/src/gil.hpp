// The Python interpreter lock, for calls made without releasing it.
//
// The extension calls the library's microsecond functions through ctypes.PyDLL,
// which keeps the interpreter lock (the GIL) held during the call: releasing it
// for 20 µs is enough for IPython's history thread to take it and commit the
// cell to SQLite before the kernel says it is idle, which costs the cell more
// than the call itself. A call that holds the lock must never block on it
// while it waits: every wait that can last (a device that has not settled, a
// lock held by a drain from outside, the status server stopping) gives the
// lock up for its duration through Released, and takes it back after.
//
// The library does not link against Python. The extension hands over three
// functions of the running interpreter once (gpucleanup_set_gil_hooks):
// PyGILState_Check, PyEval_SaveThread and PyEval_RestoreThread. Without them,
// or on a thread that does not hold the lock (a ctypes.CDLL call, the library's
// own threads), Released does nothing.
#pragma once

namespace gpucleanup::gil {

using CheckFn = int (*)();
using SaveFn = void* (*)();
using RestoreFn = void (*)(void*);

// All three, or none (nullptrs) to forget them.
void set_hooks(CheckFn check, SaveFn save, RestoreFn restore) noexcept;

// 1 when the calling thread holds the interpreter lock, 0 when it does not,
// -1 when the hooks were never set (not called from a Python process).
int held() noexcept;

// While alive, the calling thread does not hold the interpreter lock: released
// on construction if it was held, taken back on destruction.
class Released {
 public:
  Released() noexcept;
  ~Released();
  Released(const Released&) = delete;
  Released& operator=(const Released&) = delete;

 private:
  void* saved_ = nullptr;
  RestoreFn restore_ = nullptr;
};

// Locks `mutex` for the caller; if it is not free at once, waits with the
// interpreter lock released.
template <class Mutex>
void lock(Mutex& mutex) {
  if (mutex.try_lock()) return;
  Released released;
  mutex.lock();
}

}  // namespace gpucleanup::gil
