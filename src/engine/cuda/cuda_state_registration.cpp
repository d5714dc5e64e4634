// Registers the device memory (state_memory.h) before main() in every program linked with
// pulseloco_engine_cuda: the library's CMake target asks the linker for the symbol below, so this
// object is always taken from the archive.
#include <memory>

#include <pulseloco/engine/cuda/cuda_state_memory.h>

namespace pulseloco::engine_detail {
namespace {

std::unique_ptr<StateMemory> make_cuda_state_memory(StateTensors tensors) {
  return std::make_unique<CudaStateMemory>(std::move(tensors));
}

}  // namespace
}  // namespace pulseloco::engine_detail

extern "C" {
extern const bool pulseloco_engine_cuda_registered;
const bool pulseloco_engine_cuda_registered =
    (pulseloco::engine_detail::register_device_state_memory(
         &pulseloco::engine_detail::make_cuda_state_memory),
     true);
}
