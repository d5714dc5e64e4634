// Patch extraction on CUDA (contract: kernels/cuda/patch_kernels_cuda.h).
#include <pulseloco/kernels/cuda/patch_kernels_cuda.h>

#include <cuda_runtime.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/tabulate_output_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <cub/device/device_select.cuh>

#include <algorithm>

#include <pulseloco/kernels/argument_checks.h>
#include <pulseloco/kernels/cuda/cuda_internal.h>
#include <pulseloco/kernels/patch_lane.h>
#include <pulseloco/kernels/cuda/launch.cuh>

namespace pulseloco::kernels::cuda {
namespace detail {
namespace {

// Item of element i: changed in bit 63, i in bits 32..62 (i < 2^31), the snapshot's bits in
// 16..31, the new bf16 bits in 0..15.
// A NaN is recorded (lowest offset wins, whatever the order) and never selected.
template <DType kCurrent>
struct PatchItem {
  const std::uint16_t* snapshot;
  const void* current;
  unsigned long long* nan_min;

  __device__ std::uint64_t operator()(std::uint32_t i) const {
    const ::pulseloco::kernels::detail::PatchLane lane =
        ::pulseloco::kernels::detail::patch_lane<kCurrent>(current, i);
    if (lane.nan) {
      atomicMin(nan_min, static_cast<unsigned long long>(i));
      return 0;
    }
    const std::uint16_t before = snapshot[i];
    return (static_cast<std::uint64_t>(lane.bits != before) << 63) |
           (static_cast<std::uint64_t>(i) << 32) | (static_cast<std::uint64_t>(before) << 16) |
           lane.bits;
  }
};

struct IsChanged {
  __device__ bool operator()(std::uint64_t item) const { return (item >> 63) != 0; }
};

struct WritePatchEntry {
  PatchOutput out;

  __device__ void operator()(std::ptrdiff_t k, std::uint64_t item) const {
    out.offsets[k] = static_cast<std::uint32_t>(item >> 32) & 0x7FFFFFFFu;
    out.values[k] = static_cast<std::uint16_t>(item);
    if (out.previous != nullptr) out.previous[k] = static_cast<std::uint16_t>(item >> 16);
  }
};

template <DType kCurrent>
cudaError_t patch_select(void* temp, std::size_t& temp_bytes, const PatchChunk& chunk,
                         const PatchOutput& patch_out, DeviceCounters* counters,
                         cudaStream_t stream) {
  const auto items = thrust::make_transform_iterator(
      thrust::counting_iterator<std::uint32_t>(0),
      PatchItem<kCurrent>{chunk.snapshot, chunk.current,
                          counters == nullptr ? nullptr : &counters->non_finite_min});
  const auto out = thrust::make_tabulate_output_iterator(WritePatchEntry{patch_out});
  return cub::DeviceSelect::If(temp, temp_bytes, items, out,
                               counters == nullptr ? nullptr : &counters->selected,
                               static_cast<std::int64_t>(chunk.count), IsChanged{}, stream);
}

// Offsets are unique, so no two threads write the same element.
__global__ void scatter_snapshot_kernel(const std::uint32_t* offsets, const std::uint16_t* values,
                                        std::uint64_t entries, std::uint16_t* snapshot) {
  for (std::uint64_t k = first_index(); k < entries; k += grid_stride())
    snapshot[offsets[k]] = values[k];
}

}  // namespace
}  // namespace detail

PatchResult extract_patch(const PatchChunk& chunk, const PatchOutput& out,
                          DeviceWorkspace& workspace, void* stream) {
  constexpr const char* kName = "cuda::extract_patch";
  ::pulseloco::kernels::detail::check_patch_arguments(chunk, out, kName);
  detail::check_current_device(workspace, kName);
  if (chunk.count == 0) return PatchResult{};
  DeviceWorkspace::Impl& impl = workspace.impl();
  const cudaStream_t s = detail::as_stream(stream);
  const auto select = [&](void* temp, std::size_t& bytes, detail::DeviceCounters* counters) {
    return chunk.current_dtype == DType::float32
               ? detail::patch_select<DType::float32>(temp, bytes, chunk, out, counters, s)
               : detail::patch_select<DType::bfloat16>(temp, bytes, chunk, out, counters, s);
  };
  std::size_t needed = 0;
  PULSELOCO_CUDA_CHECK(select(nullptr, needed, nullptr));
  // Never leave the storage null: CUB would take the second call for another size query.
  impl.reserve_temp(std::max<std::size_t>(needed, 256));
  PULSELOCO_CUDA_CHECK(
      cudaMemsetAsync(&impl.device_counters->non_finite_min, 0xFF, sizeof(unsigned long long), s));
  std::size_t available = impl.temp_bytes;
  PULSELOCO_CUDA_CHECK(select(impl.temp, available, impl.device_counters));
  PULSELOCO_CUDA_CHECK(cudaMemcpyAsync(impl.host_counters, impl.device_counters,
                                       sizeof(detail::DeviceCounters), cudaMemcpyDeviceToHost, s));
  PULSELOCO_CUDA_CHECK(cudaStreamSynchronize(s));
  const detail::DeviceCounters& counters = *impl.host_counters;
  if (counters.non_finite_min != detail::kNoOffset)
    return PatchResult{.changed = 0, .nan_offset = counters.non_finite_min};
  const auto changed = static_cast<std::uint64_t>(counters.selected);
  detail::launch("scatter_snapshot_kernel", detail::scatter_snapshot_kernel, changed, s,
                 out.offsets, out.values, changed, chunk.snapshot);
  return PatchResult{.changed = changed, .nan_offset = std::nullopt};
}

}  // namespace pulseloco::kernels::cuda
