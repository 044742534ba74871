// The files a kernel's status endpoint made, removed by a SIGTERM handler before the process ends
// (sigterm_cleanup.cpp says why in C and not in Python).
#pragma once

namespace gpucleanup {

// paths_json: {"files": [absolute paths], "dirs": [absolute paths]} (8 of each at most), removed in that order by
// the handler in the process that called this (not in a forked child), each only if it is still the file (device
// and inode) that lstat found at that path during this call: call it again after replacing one of them (a file
// rewritten by rename is a new inode); a path absent now is never removed. nullptr forgets them and puts the default
// action back if the handler is ours. Sets the handler only where SIGTERM has its default action; fails (BUSY)
// where another handler is set, leaving it. Throws through fail() on bad input.
void set_sigterm_cleanup(const char* paths_json);

}  // namespace gpucleanup
