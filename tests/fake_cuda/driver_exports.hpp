// The fake driver's exported surface: cuda.h's prototypes and the control API.
//
// Everything in this shared object is hidden (-fvisibility=hidden) except the
// functions a real libcuda.so.1 exports for the entry points gpucleanup uses
// and the control API, so a test that dlsym()s a wrong name fails here exactly
// as it would against a real driver.
#pragma once

#pragma GCC visibility push(default)
#include <cuda.h>

#include "fake_cuda_control.h"
#pragma GCC visibility pop

// cuda.h maps cuGetProcAddress to cuGetProcAddress_v2 (5 arguments). The fake
// also defines the 4-argument CUDA 11.3 symbol of the same base name, so the
// mapping is undone here and each resolver is spelt by its exported name.
#undef cuGetProcAddress

extern "C" CUresult CUDAAPI cuGetProcAddress(const char* symbol, void** pfn, int cudaVersion,
                                             cuuint64_t flags);

#define FAKE_CUDA_EXPORT __attribute__((visibility("default")))
