/*
 * Control API of the fake CUDA driver (tests/fake_cuda, built as libcuda.so.1
 * in <build>/tests/fake_cuda/).
 *
 * The fake implements every entry point of native/src/detail/entry_points.inc
 * (plus cuInit and cuGetProcAddress / cuGetProcAddress_v2) with the real
 * prototypes of cuda.h, over scripted state. Tests drive it through the
 * functions below, which the same shared object exports. A test that loads the
 * fake with dlopen()/ctypes by the same path as libgpucleanup does (through
 * GPUCLEANUP_LIBCUDA) gets the same instance.
 *
 * Scenario JSON (every key optional):
 * {
 *   "initialized": true,          // false: every call but cuDriverGetVersion,
 *                                 // cuGetProcAddress* and cuInit returns
 *                                 // CUDA_ERROR_NOT_INITIALIZED (3)
 *   "driver_version": 13000,
 *   "missing": ["cuMemPoolTrimTo"],  // entry points cuGetProcAddress*
 *                                    // reports as not found (pfn NULL)
 *   "errors": {"cuMemGetInfo": 201}, // inject: that entry point returns this
 *                                    // CUresult on every call (for a device
 *                                    // scoped error use the device's
 *                                    // "errors" key)
 *   "devices": [
 *     {
 *       "name": "Fake H100",            // default "Fake GPU <i>"
 *       "uuid": "GPU-00000000-0000-0000-0000-000000000000" (default derived
 *                                        from the index),
 *       "total_bytes": 85899345920,     // default 80 GiB
 *       "free_bytes": 85000000000,      // cuMemGetInfo free before pool
 *                                       // effects; default total - 512 MiB
 *                                       // when active, else total
 *       "primary_active": false,        // primary context already active
 *       "pools_supported": true,        // false: pool entry points return
 *                                       // CUDA_ERROR_NOT_SUPPORTED (801)
 *       "default_pool": {"reserved_bytes": 0, "used_bytes": 0,
 *                        "pending_free_bytes": 0},
 *          // pending_free_bytes: freed asynchronously but not yet observed;
 *          // they count as used until a cuCtxSynchronize on the device.
 *       "current_pool": null,           // same shape: a distinct current pool
 *                                       // (cuDeviceSetMemPool); null = default
 *       "sync_seconds": 0,              // cuCtxSynchronize takes this long;
 *                                       // -1 hangs until
 *                                       // fake_cuda_release_sync()
 *       "sticky_error": 0,              // e.g. 700: cuMemGetInfo and
 *                                       // cuCtxSynchronize return it in any
 *                                       // context of this device (as measured
 *                                       // on a real GPU, share/FACTS.md §7.7);
 *                                       // GetState/Retain/Push/Pop/Release
 *                                       // and the pool calls still succeed
 *       "errors": {"cuCtxSynchronize": 999}  // per device injection
 *     }
 *   ],
 *   "current_context": {"device": 1, "primary": false}
 *      // a context current to the thread that called fake_cuda_reset (or,
 *      // with GPUCLEANUP_FAKE_CUDA_SCENARIO, to the first thread that calls
 *      // the fake). primary=false models PyCUDA's autoinit context.
 * }
 *
 * Memory model: free_bytes is what cuMemGetInfo reports, pools' reserved
 * memory already taken out. cuMemPoolTrimTo(pool, keep) lowers the pool's
 * reserved bytes to max(used + pending_free, keep) and adds the difference to
 * free_bytes. cuCtxSynchronize (when it completes) moves pending_free bytes of
 * the device's pools out of "used".
 *
 * Variants, one shared object each, same control API:
 *   <build>/tests/fake_cuda/libcuda.so.1        exports cuGetProcAddress_v2
 *                                               and cuGetProcAddress (12.x+)
 *   <build>/tests/fake_cuda/v1/libcuda.so.1     only the 4-argument
 *                                               cuGetProcAddress (11.3-11.8)
 *   <build>/tests/fake_cuda/plain/libcuda.so.1  no resolver: the _v2 symbols
 *                                               must be found with dlsym
 *
 * Environment: GPUCLEANUP_FAKE_CUDA_SCENARIO, a scenario JSON string or the
 * path of a file holding one, is loaded when the fake is first used.
 */
#ifndef GPUCLEANUP_FAKE_CUDA_CONTROL_H
#define GPUCLEANUP_FAKE_CUDA_CONTROL_H

#ifdef __cplusplus
extern "C" {
#endif

/* Replaces the whole state with the scenario (NULL or "{}" = one default
 * device, not active, driver initialised), zeroes every counter and releases
 * any hanging synchronize. Returns 0, or -1 for malformed JSON (message in
 * fake_cuda_last_error()). */
int fake_cuda_reset(const char* scenario_json);

/* Merges a patch of the same shape into the current state without touching
 * counters, e.g. {"devices": [{"primary_active": true}]} (arrays merge by
 * index) or {"errors": {"cuMemGetInfo": 0}} (0 removes an injection). */
int fake_cuda_update(const char* patch_json);

/* Counters since the last reset:
 *   "cuInit"            calls of cuInit
 *   "contexts_created"  contexts created (a Retain of an inactive primary
 *                       context, or any context creation)
 *   "calls.<entry>"     calls of one entry point, e.g. "calls.cuMemPoolTrimTo"
 *   "retained"          primary-context retains not yet released
 *   "pushed"            contexts pushed and not yet popped, all threads
 *   "syncs_in_flight"   cuCtxSynchronize calls currently blocked
 *   "threads"           distinct threads that called the fake (the thread
 *                       that called fake_cuda_reset included): a library that
 *                       starts a thread per call shows one more per call
 *   "primary_resets"    calls of fake_cuda_reset_primary_context
 *   "events"            events made (cuEventCreate) and not yet destroyed
 * Unknown names return -1. */
long long fake_cuda_counter(const char* name);

/* What cuDevicePrimaryCtxReset does when a framework calls it (cudaDeviceReset
 * is one), as measured on a real driver (580.159.04): the device's primary
 * context is destroyed and the device is inactive afterwards
 * (cuDevicePrimaryCtxGetState answers 0, even while a framework had it
 * retained) until someone retains it again, which makes a new context (here
 * with another handle). Every reference is void: "retained" drops by the
 * device's retains, a later release answers CUDA_ERROR_INVALID_CONTEXT. A
 * thread that had the context current keeps the stale handle current:
 * cuCtxGetCurrent and cuCtxGetDevice answer for it, cuMemGetInfo and
 * cuCtxSynchronize in it fail with CUDA_ERROR_CONTEXT_IS_DESTROYED (709), and
 * the stale handle can still be pushed (calls in it then fail the same way).
 * To model the framework using the device again, patch primary_active: true.
 * Returns 0, or -1 for a device that does not exist. */
int fake_cuda_reset_primary_context(int device);

/* Unblocks every cuCtxSynchronize that hangs or sleeps, now and until the next
 * reset. */
void fake_cuda_release_sync(void);

/* The current state as JSON (scenario shape plus "counters"). The string is
 * owned by the fake and valid until the next call of this function. */
const char* fake_cuda_state_json(void);

/* The checkpoint calls (cuCheckpointProcess*) act on another process, so
 * their state machine lives in files that every process sees: with
 * GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR set, a process that loads the fake with
 * the driver initialised (or later calls cuInit) registers in <dir>/<pid>.json
 * as "running". Lock (running -> locked), Checkpoint (locked -> checkpointed),
 * Restore (checkpointed -> locked) and Unlock (locked -> running) move it;
 * a call in the wrong state answers CUDA_ERROR_ILLEGAL_STATE, a pid without
 * a record (or dead) CUDA_ERROR_INVALID_VALUE, as does the caller's own pid.
 * While a process is not running, each of its own driver calls is counted in
 * "calls_while_parked" and waits until it runs again. Record keys a test may
 * patch: "state" (running, locked, checkpointed, failed, or checkpointing and
 * restoring: newer drivers' states 4 and 5, in which every call but GetState
 * answers CUDA_ERROR_ILLEGAL_STATE), "restore_needs_full_map" (a restore
 * whose GPU map does not name every device, each onto itself, fails with
 * CUDA_ERROR_INVALID_VALUE and leaves it checkpointed; each restore writes its
 * map's size to "restore_map"), "errors" ({entry: CUresult}: that call fails, state
 * unchanged), "error_state" ({entry: state}: the state after that injected
 * failure), "hang" ([entry]: that call blocks while listed), "busy" (a lock
 * waits for it, up to timeoutMs, then CUDA_ERROR_NOT_READY; with timeoutMs 0
 * for ever), "device_bytes". Returns 0, or -1 (fake_cuda_last_error()). */
int fake_cuda_checkpoint_update(int pid, const char* patch_json);

/* <dir>/<pid>.json as JSON text ("null" without one), with "calls" and
 * "calls_while_parked"; valid until this thread's next call of it. */
const char* fake_cuda_checkpoint_record(int pid);

/* Message of the last failed control call. */
const char* fake_cuda_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* GPUCLEANUP_FAKE_CUDA_CONTROL_H */
