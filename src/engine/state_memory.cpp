#include <pulseloco/engine/state_memory.h>

#include <fmt/format.h>

#include <atomic>
#include <optional>

#include <pulseloco/base/errors.h>
#include <pulseloco/engine/host_state_memory.h>

namespace pulseloco {
namespace {

std::atomic<engine_detail::DeviceStateMemoryFactory> device_factory{nullptr};

}  // namespace

bool device_state_available() noexcept {
  return device_factory.load() != nullptr;
}

namespace engine_detail {

void register_device_state_memory(DeviceStateMemoryFactory factory) noexcept {
  device_factory.store(factory);
}

Bucket host_bucket(std::uint64_t elements) {
  Bucket bucket;
  bucket.values = {elements > 0 ? new float[elements] : nullptr,
                   [](float* values) { delete[] values; }};
  bucket.capacity = elements;
  bucket.where = BucketMemory::host;
  return bucket;
}

std::span<const float> StateMemory::host_values(StateBuffer /*buffer*/, std::size_t /*tensor*/) {
  throw InvalidArgument(
      fmt::format("the state lives on {}, not in host memory: copy it "
                  "(Engine::copy_state)",
                  location()));
}

std::uint64_t StateMemory::update_bf16_mirror(std::vector<std::vector<std::uint16_t>>& /*mirror*/) {
  throw InvalidArgument(fmt::format(
      "the state lives on {}: publishing reads its θ_g in place (host_values)", location()));
}

std::unique_ptr<StateMemory> make_state_memory(StateTensors tensors) {
  const StateLocation location = tensors.options->state_location;
  const std::vector<TensorInfo>& infos = tensors.layout.tensors();
  // Every θ_l must be on one device: the state lives next to it.
  std::optional<Device> device;
  for (std::size_t t = 0; t < tensors.locals.size(); ++t) {
    const Device here = tensors.locals[t].device;
    if (!device) device = here;
    if (here != *device) {
      throw InvalidArgument(
          fmt::format("parameters are on several devices ({}:{} and {}:{}); a rank keeps all its "
                      "parameters on one device",
                      device_kind_name(device->kind), device->index, device_kind_name(here.kind),
                      here.index),
          {.tensor = infos[t].name});
    }
  }
  const bool cuda = device && device->is_cuda();
  const std::string first = infos.empty() ? std::string() : infos.front().name;
  if (!cuda) {
    if (location == StateLocation::device && !infos.empty()) {
      throw InvalidArgument(
          "state_location=device needs CUDA parameters; these are on the CPU (use automatic or "
          "host)",
          {.tensor = first});
    }
    return std::make_unique<HostStateMemory>(std::move(tensors));
  }
  if (location == StateLocation::host) {
    throw InvalidArgument(
        "state_location=host needs host parameters: stage the CUDA tensors through host memory "
        "(the libtorch adapter does), or keep the state on the device",
        {.tensor = first});
  }
  const DeviceStateMemoryFactory factory = device_factory.load();
  if (factory == nullptr) {
    throw InvalidArgument(
        "parameter is a CUDA tensor, but this program keeps state on the device only when built "
        "with CUDA (PULSELOCO_WITH_CUDA=ON) and linked with pulseloco_engine_cuda (find_package "
        "component cuda); or stage the parameters through host memory (state_location=host)",
        {.tensor = first});
  }
  return factory(std::move(tensors));
}

}  // namespace engine_detail
}  // namespace pulseloco
