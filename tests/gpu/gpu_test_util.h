// Helpers for tests that need a CUDA device: skip cleanly when there is none.
#pragma once

#include <gtest/gtest.h>

#include <pulseloco/kernels/gpu_runtime.h>

#define PULSELOCO_SKIP_WITHOUT_GPU()                              \
  do {                                                            \
    if (::pulseloco::kernels::cuda_device_count() == 0) {         \
      GTEST_SKIP() << "no CUDA device visible; GPU test skipped"; \
    }                                                             \
  } while (false)

#define PULSELOCO_CUDA_ASSERT(call)                                \
  do {                                                             \
    const cudaError_t pulseloco_status_ = (call);                  \
    ASSERT_EQ(pulseloco_status_, cudaSuccess)                      \
        << #call << ": " << cudaGetErrorString(pulseloco_status_); \
  } while (false)
