// Device-side generation of realistic window inputs for bench_kernels_cuda.cpp (generating 1e9
// elements on the host would take minutes): the same model as tests/kernels/window_test_inputs.h,
// θ_g ~ N(0, 0.02) on the bf16 grid and θ_l = θ_g moved by 8 AdamW-like steps at lr 3e-6.
#pragma once

#include <cstdint>

namespace pulseloco::bench {

// Fills θ_g, θ_l (fp32 and bf16 copies of the same values), m; `seed` varies θ_l only.
// Launches on `stream` (a cudaStream_t) and waits for the work to finish.
void fill_window_inputs(float* global, float* local_f32, std::uint16_t* local_bf16, float* momentum,
                        std::uint64_t count, std::uint64_t seed, void* stream);

}  // namespace pulseloco::bench
