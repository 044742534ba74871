/*
 * gpucleanup: the C ABI of libgpucleanup.so.
 *
 * This header, with the list of functions it includes (entry_points.def), is
 * the only exported surface of the native library. Everything a caller may
 * rely on is written in the two; everything else is hidden.
 *
 * Guarantees that hold for every function of entry_points.def:
 *   - No C++ exception ever crosses this boundary. Every call returns a
 *     gpucleanup_status; GPUCLEANUP_OK means the JSON out-parameter (when there
 *     is one) is set.
 *   - JSON strings handed out are allocated by the library, UTF-8, NUL
 *     terminated, and must be released with gpucleanup_free(). Their shapes are
 *     defined once, in the JSON schemas of share/schema/.
 *   - The library never calls cuInit and never creates a CUDA context. It acts
 *     only on devices whose primary context is already active, or on the
 *     context current to the calling thread.
 *   - "No CUDA driver", "driver not initialised", "no device in use" and
 *     "device busy" are states reported in the JSON, not errors.
 *   - After the process has begun to exit no driver call is made; calls return
 *     GPUCLEANUP_ERR_EXITING. A child created by fork() starts with clean state.
 *   - On any status other than GPUCLEANUP_OK, gpucleanup_last_error() returns a
 *     message for the calling thread that starts with a stable id, for example
 *     "[gpucleanup.api.101] json_out is NULL: pass the address of a char*".
 *
 * Environment:
 *   GPUCLEANUP_LIBCUDA  path of the CUDA driver library to load instead of
 *                       "libcuda.so.1" (used by the tests' fake driver).
 *
 * Thread safety: every function may be called from any thread. Snapshot,
 * drain, after_cell and trim calls are serialised inside the library.
 */
#ifndef GPUCLEANUP_GPUCLEANUP_H
#define GPUCLEANUP_GPUCLEANUP_H
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(GPUCLEANUP_BUILDING_LIBRARY)
#define GPUCLEANUP_API __attribute__((visibility("default")))
#else
#define GPUCLEANUP_API
#endif

/* Bumped whenever a function's signature or meaning changes. */
#define GPUCLEANUP_ABI_VERSION 2

typedef enum gpucleanup_status {
  GPUCLEANUP_OK = 0,
  /* A NULL pointer, a negative or non-finite timeout, malformed JSON in. */
  GPUCLEANUP_ERR_INVALID_ARGUMENT = 1,
  /* The driver library is present but unusable: a required entry point is
   * missing (the message names it) or the driver returned a fault. */
  GPUCLEANUP_ERR_DRIVER = 2,
  /* A fault inside the library (out of memory, a bug). */
  GPUCLEANUP_ERR_INTERNAL = 3,
  /* The process is exiting: nothing was done. */
  GPUCLEANUP_ERR_EXITING = 4,
  /* The status server could not be started or is not running. */
  GPUCLEANUP_ERR_SERVER = 5,
  /* A drain requested through the status server (gpucleanup drain) held the
   * library and did not give way within half a second: nothing was done. The
   * kernel's own calls never wait longer; that drain is asked to stop. */
  GPUCLEANUP_ERR_BUSY = 6
} gpucleanup_status;

/* Progress callback for a drain. Called on the thread that called
 * gpucleanup_drain, about once a second once a settle has waited more than
 * 2 s, with a JSON object {"device": N, "waited_s": S, "limit_s": L}.
 * Returning non-zero abandons the remaining waits (reported as "interrupted");
 * the trims that do not need a wait still run. */
typedef int (*gpucleanup_progress_fn)(const char* progress_json, void* user);

/* gpucleanup_server_state's state codes. */
#define GPUCLEANUP_STATE_IDLE 0
#define GPUCLEANUP_STATE_RUNNING 1
#define GPUCLEANUP_STATE_DRAINING 2
#define GPUCLEANUP_STATE_WAITING 3

/* The running Python interpreter's PyGILState_Check, PyEval_SaveThread and
 * PyEval_RestoreThread, for gpucleanup_set_gil_hooks. */
typedef int (*gpucleanup_gil_check_fn)(void);
typedef void* (*gpucleanup_gil_save_fn)(void);
typedef void (*gpucleanup_gil_restore_fn)(void*);

/* The kernel's part of a drain asked for through the status server: see
 * gpucleanup_set_drain_hook. */
typedef long long (*gpucleanup_drain_hook_fn)(double timeout_s, char* out, size_t capacity, void* user);

/* The id of the Python call site of a traced allocation: see
 * gpucleanup_trace_start. */
typedef long long (*gpucleanup_trace_site_fn)(void);

/* The functions, each with what it does: entry_points.def, the one list that
 * the Python package reads too. */
#define GPUCLEANUP_ENTRY(result, name, parameters) GPUCLEANUP_API result name parameters;
#define GPUCLEANUP_ENTRY_ADDED(result, name, parameters) GPUCLEANUP_API result name parameters;
#include "entry_points.def"
#undef GPUCLEANUP_ENTRY
#undef GPUCLEANUP_ENTRY_ADDED

#ifdef __cplusplus
}
#endif

#endif /* GPUCLEANUP_GPUCLEANUP_H */
