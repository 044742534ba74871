/*
 * gpucleanup: the C ABI of libgpucleanup.so.
 *
 * This header is the only exported surface of the native library. Everything a
 * caller may rely on is written here; everything else is hidden.
 *
 * Guarantees that hold for every function below:
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

/* Library version, e.g. "0.1.0". Static storage; never free it. */
GPUCLEANUP_API const char* gpucleanup_version(void);

/* GPUCLEANUP_ABI_VERSION of the library that was loaded. */
GPUCLEANUP_API int gpucleanup_abi_version(void);

/* Releases a string returned by this library. NULL is accepted. */
GPUCLEANUP_API void gpucleanup_free(char* json);

/* The last error message of the calling thread, or "" if none. Static per
 * thread storage, valid until the next call on the same thread. */
GPUCLEANUP_API const char* gpucleanup_last_error(void);

/* Cheap probe, meant for every cell: whether a driver is loaded, whether it is
 * initialised in this process, and which devices are in use (primary context
 * active or a context current to the calling thread). No memory queries.
 * JSON shape: share/schema/snapshot.schema.json with "kind": "probe". */
GPUCLEANUP_API gpucleanup_status gpucleanup_probe(char** json_out);

/* Full snapshot: the probe plus, per device, name, UUID and total memory; for
 * devices in use also cuMemGetInfo free/total and the default and current
 * memory pools' reserved/used current and high marks.
 * JSON shape: share/schema/snapshot.schema.json with "kind": "snapshot". */
GPUCLEANUP_API gpucleanup_status gpucleanup_snapshot(char** json_out);

/* Progress callback for a drain. Called on the thread that called
 * gpucleanup_drain, about once a second once a settle has waited more than
 * 2 s, with a JSON object {"device": N, "waited_s": S, "limit_s": L}.
 * Returning non-zero abandons the remaining waits (reported as "interrupted");
 * the trims that do not need a wait still run. */
typedef int (*gpucleanup_progress_fn)(const char* progress_json, void* user);

/* Drain every device in use:
 *   1. settle: wait for queued work (cuCtxSynchronize on a watchdog thread per
 *      device) for at most timeout_s seconds in total. A device still busy at
 *      the limit is reported "busy" with how long it was waited for, and is not
 *      trimmed; its watchdog keeps waiting in the background and the next
 *      drain reports it as still busy rather than starting another wait.
 *   2. trim: cuMemPoolTrimTo(pool, 0) on the default and the current memory
 *      pool of each settled device.
 * Reports per device reserved/free before and after and any error by name.
 * A sticky error (CUDA_ERROR_ILLEGAL_ADDRESS and the like) is reported once
 * with "restart the kernel"; that device is left alone afterwards.
 * timeout_s must be finite and >= 0; 0 skips the settle (the trim then
 * releases only what no queued work still holds). progress may be NULL.
 * JSON shape: share/schema/drain.schema.json. */
GPUCLEANUP_API gpucleanup_status gpucleanup_drain(double timeout_s,
                                                  gpucleanup_progress_fn progress,
                                                  void* user,
                                                  char** json_out);

/* The settle of gpucleanup_drain alone: waits (bounded, same rules and
 * progress) for queued work on every device in use and reports the pools as
 * they are, without trimming them ("trim": false in the result, every pool
 * "trimmed": false). For callers that leave the driver's pools alone.
 * JSON shape: share/schema/drain.schema.json. */
GPUCLEANUP_API gpucleanup_status gpucleanup_settle(double timeout_s,
                                                   gpucleanup_progress_fn progress,
                                                   void* user,
                                                   char** json_out);

/* The whole after-cell pass in one call and one JSON reply, for the cleanup
 * after every notebook cell:
 *   1. probe (as gpucleanup_probe). CUDA not initialised, or no device in use:
 *      the reply is made right here, with no device listed.
 *   2. settle every device in use, as gpucleanup_drain (bounded by timeout_s
 *      in total, progress and interruption alike; 0 skips it). The wait runs
 *      on the device's watchdog, a thread started the first time the device
 *      needs one and reused by every later call.
 *   3. when trim is non-zero, cuMemPoolTrimTo(pool, 0) on the default and the
 *      current pool of every settled device (0: the pools are reported as
 *      they are, like gpucleanup_settle).
 *   4. per device: free_before_bytes (before the trim), released_bytes, the
 *      pools, and total/used/free bytes afterwards (as gpucleanup_snapshot
 *      reports them).
 * Each device in use is retained and entered once per call. A busy device is
 * not trimmed and is reported with the memory read at the start of the call.
 * JSON shape: share/schema/after_cell.schema.json with "kind": "after_cell". */
GPUCLEANUP_API gpucleanup_status gpucleanup_after_cell(double timeout_s,
                                                       int trim,
                                                       gpucleanup_progress_fn progress,
                                                       void* user,
                                                       char** json_out);

/* Whether the after-cell pass would find nothing to do: nothing changed on
 * the devices this process uses since the last gpucleanup_after_cell, as far
 * as the driver tells without waiting. *quiet_out is 1 when
 *   - the same devices are in use, each through its primary context, none
 *     busy from an earlier wait or unusable;
 *   - nothing is queued on any (an event recorded over the whole context and
 *     queried at once: CUDA 12.5+ drivers) and no driver pool reserves memory;
 *   - each has the free memory that pass left (one cuMemGetInfo).
 * 0 when anything differs or cannot be told: no such pass yet, or it did not
 * leave every device drained, settled and error-free with its pools empty.
 * For the idle cell: the probe, one event and one cuMemGetInfo per device, no
 * wait, no trim, no JSON. Never initialises CUDA. */
GPUCLEANUP_API gpucleanup_status gpucleanup_quiet(int* quiet_out);

/* The trim alone, without a wait: cuMemPoolTrimTo(pool, 0) on the default and
 * the current pool of every device in use, on the calling thread (for the
 * second trim after frameworks gave memory back to the driver's pools). A
 * device still busy from an earlier wait is not trimmed. Reports per device
 * the pools, released_bytes, and total/used/free bytes afterwards.
 * JSON shape: share/schema/after_cell.schema.json with "kind": "trim". */
GPUCLEANUP_API gpucleanup_status gpucleanup_trim(char** json_out);

/* One step of parking another process, for the park helper only (a
 * short-lived process of its own, gpucleanup.park_step): unlike every other
 * call, this one calls cuInit, in the calling process, and then one of the
 * driver's checkpoint calls on `pid`. `step` is "state", "lock", "checkpoint",
 * "restore" or "unlock"; lock_timeout_ms bounds the lock (0: none). A step the
 * driver refuses is reported in the JSON ("ok": false, "result": the error's
 * name, "state": the process's state after it), not as an error status.
 * Errors: GPUCLEANUP_ERR_INVALID_ARGUMENT for an unknown step or a pid that is
 * not another process (gpucleanup.park.603); GPUCLEANUP_ERR_DRIVER when the
 * driver is missing or unusable (park.601), has no checkpoint calls (park.602,
 * drivers before CUDA 12.8), or cuInit fails (park.604). */
GPUCLEANUP_API gpucleanup_status gpucleanup_checkpoint_step(int pid, const char* step, unsigned int lock_timeout_ms,
                                                            char** json_out);

/* SIGTERM ends the process as cleanly as a shutdown: paths_json is
 * {"files": [...], "dirs": [...]} (absolute paths, 8 of each at most), which a
 * SIGTERM handler removes (unlink, then rmdir) before the default action ends
 * the process; only in the process that made this call, never in a forked
 * child. The handler is set only where SIGTERM has its default action
 * (GPUCLEANUP_ERR_BUSY otherwise, the other handler left as it is). NULL
 * forgets the paths and restores the default action if the handler is ours. */
GPUCLEANUP_API gpucleanup_status gpucleanup_sigterm_cleanup(const char* paths_json);

/* Marks the process as exiting: stops the status server and makes every later
 * call a no-op returning GPUCLEANUP_ERR_EXITING. Idempotent. Also runs
 * automatically from the library's destructor. */
GPUCLEANUP_API void gpucleanup_shutdown(void);

/* ---- Status server (out-of-band status for a busy kernel) ----------------
 * Runs on a thread of its own with a ZeroMQ socket and answers from native
 * state, never taking the Python interpreter lock. Protocol:
 * share/schema/protocol.schema.json and share/protocol.md.
 */

/* Starts the server. config_json:
 *   {"endpoint": "ipc:///path/sock" | "tcp://127.0.0.1:0",
 *    "key": "<hex key>" (required for tcp, optional for ipc),
 *    "kernel": {...}  (opaque kernel description echoed in replies),
 *    "history_limit": 50,
 *    "max_peers": 64, "peer_idle_timeout_s": 10, "peer_grace_s": 1,
 *    "handshake_timeout_s": 2, "heartbeat_interval_s": 2}  (limits: share/protocol.md)
 * On success *json_out is {"endpoint": "<bound endpoint>",
 * "pub_endpoint": "<bound publish endpoint>"}. Starting a running server
 * returns GPUCLEANUP_ERR_SERVER. */
GPUCLEANUP_API gpucleanup_status gpucleanup_server_start(const char* config_json,
                                                         char** json_out);

/* Stops the server and joins its thread. Idempotent; safe if never started. */
GPUCLEANUP_API gpucleanup_status gpucleanup_server_stop(void);

/* Sets the kernel's state as the server reports it, a JSON object such as
 * {"state": "running", "cell": 12, "since_ns": ...}. */
GPUCLEANUP_API gpucleanup_status gpucleanup_server_set_state(const char* state_json);

/* The kernel's state without JSON, for the calls made on every cell: state is
 * GPUCLEANUP_STATE_*; cell < 0 means no cell number (JSON null), device < 0 no
 * device (only "waiting" names one); since_ns is CLOCK_REALTIME nanoseconds.
 * The same as gpucleanup_server_set_state with the object those fields make. */
#define GPUCLEANUP_STATE_IDLE 0
#define GPUCLEANUP_STATE_RUNNING 1
#define GPUCLEANUP_STATE_DRAINING 2
#define GPUCLEANUP_STATE_WAITING 3
GPUCLEANUP_API gpucleanup_status gpucleanup_server_state(int state, long long cell, long long since_ns,
                                                         int device);

/* One park step, as the status server's signed "park" request makes it, from
 * inside the process: step is "begin" (idle -> parking), "parked" (parking ->
 * parked, bytes moved to host memory; bytes < 0: unknown), "failed" (parking
 * -> idle) or "resumed" (parking or parked -> idle). While parking or parked,
 * the server takes no snapshot and gpucleanup_server_state leaves the park in
 * place. then_json (NULL: idle), with "resumed" only: the state to go to in
 * the same step, e.g. {"state": "running", "cell": 7} for the kernel's own
 * resume before a cell. On success *json_out is the state after the step (a
 * "resumed" one carries the park's state as "was"); a step the state does not
 * allow fails (gpucleanup.server.509) and changes nothing; a begin refused
 * only while a drain or the kernel's own release runs fails with
 * gpucleanup.server.510: ask again. */
GPUCLEANUP_API gpucleanup_status gpucleanup_server_park(const char* step, long long bytes, const char* then_json,
                                                        char** json_out);

/* 0: not parked (or no server), 1: parking, 2: parked. For every cell's start:
 * no JSON, no driver call. */
GPUCLEANUP_API int gpucleanup_server_parked(void);

/* Why no automatic park may begin now (NULL or "": it may): a park request
 * whose begin says "automatic": true (a policy's, such as the Jupyter
 * server's park_idle_after_s) is refused with this sentence
 * (gpucleanup.server.420); a park a person asks for is not. The kernel says
 * it when it changes (a thread a cell started still runs). 0, or -1 when no
 * server runs (gpucleanup_last_error says why). */
GPUCLEANUP_API int gpucleanup_server_park_blocker(const char* why);

/* A cell's own state, said twice per cell: running != 0 as the cell starts
 * ("running", with cell, or no cell number when cell < 0), running == 0 as its
 * hooks end ("idle"), since now (CLOCK_REALTIME); the same as
 * gpucleanup_server_state with those fields. Returns the park state after the
 * call, as gpucleanup_server_parked does (0, 1 or 2: a park in place keeps
 * its state), or -1 when it failed (the server is not running):
 * gpucleanup_last_error says why. */
GPUCLEANUP_API int gpucleanup_server_cell(int running, long long cell);

/* The kernel's own work on a thread of its own (a release once the kernel is
 * idle) begins (begin != 0) or ends (begin == 0). Begin returns 0 when the
 * work may run (counted: a park begun before it ends is refused), or 1 or 2
 * when a park is under way (parking, parked: nothing counted, and the work
 * must wait for the resume, as its driver calls would); end returns 0. -1:
 * no server runs (gpucleanup_last_error says why); nothing is coordinated
 * then, and the caller may run the work. */
GPUCLEANUP_API int gpucleanup_server_background(int begin);

/* Whether anything in this process has initialised CUDA, in one driver call
 * and without JSON: 1 yes, 0 no (the probe would say "not_initialized"), -1
 * anything else (no driver, unusable, exiting, forked: ask the probe, which
 * says why). Never initialises CUDA; takes no lock. */
GPUCLEANUP_API int gpucleanup_cuda_initialized(void);

/* Functions of the running Python interpreter, handed over once by the
 * extension: PyGILState_Check, PyEval_SaveThread, PyEval_RestoreThread (all
 * three, or three NULLs to forget them). With them, a call made while holding
 * the interpreter lock (ctypes.PyDLL) gives the lock up for as long as it has
 * to wait (a device that has not settled, a drain from outside, the status
 * server stopping) and takes it back before returning; calls that do not hold
 * it are unaffected. Without them, such a call holds the lock while it waits. */
typedef int (*gpucleanup_gil_check_fn)(void);
typedef void* (*gpucleanup_gil_save_fn)(void);
typedef void (*gpucleanup_gil_restore_fn)(void*);
GPUCLEANUP_API void gpucleanup_set_gil_hooks(gpucleanup_gil_check_fn check, gpucleanup_gil_save_fn save,
                                             gpucleanup_gil_restore_fn restore);

/* The kernel's own part of a drain asked for through the status server
 * (gpucleanup drain, the page's Drain button). After the library's drain has
 * waited for queued work and trimmed the driver's pools, the server's helper
 * thread calls `hook` with the time it may still wait for queued work (0: the
 * wait is done) and a buffer of `capacity` bytes; the hook empties the
 * frameworks' caches for the kernel (or says why it did not) and writes one
 * JSON object there, without a terminating NUL, returning its length (-1: it
 * failed; more than capacity: it did not fit). The object becomes the drain
 * result's "kernel" (share/schema/drain.schema.json). No lock of the library is
 * held during the call, so the hook may call the library; it runs on a thread
 * that is not Python's (ctypes takes the interpreter lock for it). NULL
 * forgets the hook; a call already under way finishes with the old one, so a
 * hook must stay callable for the life of the process. */
typedef long long (*gpucleanup_drain_hook_fn)(double timeout_s, char* out, size_t capacity, void* user);
GPUCLEANUP_API void gpucleanup_set_drain_hook(gpucleanup_drain_hook_fn hook, void* user);

/* The server's connection counters: {"max_peers", "peers", "pub_peers",
 * "refused_connections", "dropped_idle", "peer_idle_timeout_s"}. */
GPUCLEANUP_API gpucleanup_status gpucleanup_server_connections(char** json_out);

/* Hands one finished cell's record (a JSON object) to the server: kept in its
 * history and published to subscribers. */
GPUCLEANUP_API gpucleanup_status gpucleanup_server_publish(const char* record_json);

/* Raw allocations traced to their caller through CUPTI's callback API (opt-in).
 *
 * gpucleanup_trace_start loads libcupti from the first path of candidates_json
 * (a JSON array of strings) that loads, subscribes, and from then on records
 * every successful cuMemAlloc_v2, cuMemAllocPitch_v2, cuMemAllocManaged,
 * cuMemCreate, cuMemAllocAsync and cuMemAllocFromPoolAsync (and their frees,
 * cuMemPoolCreate and cuMemPoolDestroy) with size, device, calling thread, the
 * cell set by gpucleanup_trace_set_cell, the shared object that called the
 * driver and, on a thread holding the interpreter lock (the hooks of
 * gpucleanup_set_gil_hooks tell), the id that site() returns (site may be
 * NULL). Refused, with the reason in the reply, when CUDA is not initialised,
 * when no libcupti loads, or when another tool holds CUPTI's subscription
 * (CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED). Pools made with
 * cuMemPoolCreate while tracing are trimmed with the default pools and listed
 * with "which": "created". Reply: {"active", "library", "error",
 * "cupti_result", "tried": [{"path", "error"}]}. */
typedef long long (*gpucleanup_trace_site_fn)(void);
GPUCLEANUP_API gpucleanup_status gpucleanup_trace_start(const char* candidates_json, gpucleanup_trace_site_fn site,
                                                        char** json_out);

/* Unsubscribes; what was recorded stays readable. Reply: {"active": false, "stopped"}. */
GPUCLEANUP_API gpucleanup_status gpucleanup_trace_stop(char** json_out);

/* The cell now running, recorded with each traced allocation (-1: none). */
GPUCLEANUP_API void gpucleanup_trace_set_cell(long long cell);

/* The live traced allocations, grouped by site, caller, device, kind and cell,
 * largest first; cell >= 0 keeps those made during that cell only. Reply:
 * {"active", "library", "live_bytes", "live_allocations", "dropped",
 *  "groups": [{"site", "caller", "device", "kind", "cell", "bytes", "count",
 *              "threads", "thread_count"}], "pools": [{"handle", "device"}]}. */
GPUCLEANUP_API gpucleanup_status gpucleanup_trace_report(long long cell, char** json_out);

#ifdef __cplusplus
}
#endif

#endif /* GPUCLEANUP_GPUCLEANUP_H */
