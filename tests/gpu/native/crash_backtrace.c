/* A diagnostic for the GPU tests only: preloaded (LD_PRELOAD) into a test kernel, it writes the native stack of a
 * thread that dies of SIGSEGV, SIGBUS, SIGILL, SIGFPE or SIGABRT to stderr, then lets the signal end the process as
 * before. Python's faulthandler shows Python frames only; a crash in a thread with no Python frame (a driver or
 * XLA thread) shows nothing there. faulthandler, enabled later, restores this handler and raises the signal again
 * once it has written its own report, so both reports come out.
 *
 * Each frame is "module(symbol+offset) [address]", or "module(+offset)" where the symbol is not exported: the
 * module and its offset are enough to say whose code it was (the CUDA driver, XLA, gpucleanup, Python).
 * Built with: cc -shared -fPIC -O1 -o crash_backtrace.so crash_backtrace.c  (glibc's execinfo.h, no other library)
 */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static void say(const char *text) { ssize_t ignored = write(2, text, strlen(text)); (void)ignored; }

static void say_number(long value) {
  char digits[24];
  int at = sizeof digits;
  int negative = value < 0;
  unsigned long rest = negative ? 0UL - (unsigned long)value : (unsigned long)value;
  digits[--at] = '\0';
  do { digits[--at] = (char)('0' + rest % 10); rest /= 10; } while (rest > 0 && at > 1);
  if (negative) digits[--at] = '-';
  say(digits + at);
}

static void say_hex(unsigned long value) {
  char digits[24];
  int at = sizeof digits;
  digits[--at] = '\0';
  do { digits[--at] = "0123456789abcdef"[value % 16]; value /= 16; } while (value > 0 && at > 2);
  digits[--at] = 'x';
  digits[--at] = '0';
  say(digits + at);
}

static void on_fatal(int signum, siginfo_t *info, void *context) {
  (void)context;
  void *frames[64];
  say("\n== native stack of the thread that received signal ");
  say_number(signum);
  say(" (thread ");
  say_number((long)syscall(SYS_gettid));
  say(", si_code ");
  say_number(info != NULL ? info->si_code : 0);  /* SEGV_MAPERR 1, SEGV_ACCERR 2; SI_TKILL -6: raised again */
  say(", address ");
  say_hex(info != NULL ? (unsigned long)info->si_addr : 0);
  say(")\n");
  int depth = backtrace(frames, 64);
  backtrace_symbols_fd(frames, depth, 2);
  say("== end of native stack\n");
  signal(signum, SIG_DFL);  /* the signal, raised again, ends the process as it would have */
  raise(signum);
}

__attribute__((constructor)) static void install(void) {
  void *warm[2];
  backtrace(warm, 2);  /* the first call loads the unwinder: done here, not in a signal handler */
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_sigaction = on_fatal;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  const int fatal[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
  for (unsigned i = 0; i < sizeof fatal / sizeof fatal[0]; ++i) sigaction(fatal[i], &action, NULL);
}
