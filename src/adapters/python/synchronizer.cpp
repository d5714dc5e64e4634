// _Synchronizer: the engine (or an elastic worker) over tensors imported through DLPack or the
// buffer protocol, without a copy. Collective calls run on the synchroniser's own thread with the
// GIL released; the calling thread checks for signals meanwhile and aborts the group on one
// (collective_thread.h).
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nlohmann/json.hpp>

#include <pulseloco/base/digest.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/elastic/elastic_engine.h>
#include <pulseloco/engine/bucket_transport.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/group/make_transport.h>
#include <pulseloco/group/rendezvous.h>

#include "bindings.h"
#include "collective_thread.h"

namespace pulseloco::python {
namespace {

// What the engine sees of one tensor, for tensor_table().
struct TensorInfo {
  std::string name;
  std::uintptr_t data_ptr = 0;
  std::uint64_t numel = 0;
  std::string dtype;
  std::string device;
};

bool is_c_contiguous(const nb::ndarray<>& array) {
  std::int64_t expected = 1;
  for (std::size_t d = array.ndim(); d-- > 0;) {
    if (array.shape(d) != 1 && array.stride(d) != expected) return false;
    expected *= static_cast<std::int64_t>(array.shape(d));
  }
  return true;
}

// Imports one tensor (kept alive by `keep`) as the engine's view of it. `what` names it in
// errors ("parameter" or "gradient").
TensorView import_tensor(const std::string& what, const std::string& name, nb::handle object,
                         std::vector<nb::ndarray<>>& keep, std::vector<std::uint64_t>* shape) {
  nb::ndarray<> array;
  if (!nb::try_cast(object, array, /*convert=*/false)) {
    throw InvalidArgument(
        fmt::format("{} '{}' (a {}) is neither a tensor with __dlpack__ (torch.Tensor) nor a "
                    "writable buffer (a NumPy array that is not read-only)",
                    what, name, nb::inst_name(object).c_str()),
        {.tensor = name});
  }
  TensorView view;
  const nb::dlpack::dtype dtype = array.dtype();
  if (dtype == nb::dtype<float>()) {
    view.dtype = DType::float32;
  } else if (dtype ==
             nb::dlpack::dtype{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1}) {
    view.dtype = DType::bfloat16;
  } else {
    throw InvalidArgument(fmt::format("{} '{}': dtype (DLPack code {}, {} bits) is neither "
                                      "float32 nor bfloat16",
                                      what, name, dtype.code, dtype.bits),
                          {.tensor = name});
  }
  if (!is_c_contiguous(array)) {
    throw InvalidArgument(
        fmt::format("{} '{}' is not contiguous (call .contiguous() on it first)", what, name),
        {.tensor = name});
  }
  if (array.device_type() == nb::device::cpu::value) {
    view.device = Device{};
  } else if (array.device_type() == nb::device::cuda::value) {
    view.device = Device{DeviceKind::cuda, array.device_id()};
  } else {
    throw InvalidArgument(fmt::format("{} '{}' is on a device that is neither the CPU nor CUDA "
                                      "(DLPack device type {})",
                                      what, name, array.device_type()),
                          {.tensor = name});
  }
  view.data = array.data();
  view.numel = array.size();
  if (shape != nullptr) {
    for (std::size_t d = 0; d < array.ndim(); ++d)
      shape->push_back(array.shape(d));
  }
  keep.push_back(std::move(array));
  return view;
}

std::vector<std::byte> to_bytes(nb::handle value, const std::string& name) {
  if (!PyBytes_Check(value.ptr())) {
    throw InvalidArgument(fmt::format("checkpoint file '{}': expected bytes, got a {}", name,
                                      nb::inst_name(value).c_str()));
  }
  const auto* data = reinterpret_cast<const std::byte*>(PyBytes_AsString(value.ptr()));
  return {data, data + PyBytes_Size(value.ptr())};
}

nb::ndarray<nb::numpy, float> to_numpy(std::vector<float> values) {
  auto* owned = new std::vector<float>(std::move(values));
  nb::capsule owner(
      owned, [](void* pointer) noexcept { delete static_cast<std::vector<float>*>(pointer); });
  return nb::ndarray<nb::numpy, float>(owned->data(), {owned->size()}, owner);
}

class Synchronizer {
 public:
  Synchronizer(const nb::list& parameters, const std::string& mode, std::uint32_t inner_steps,
               float outer_lr, float outer_momentum, const nb::dict& options,
               const nb::handle& group, const nb::handle& elastic) {
    EngineOptions engine_options =
        python::engine_options(mode, inner_steps, outer_lr, outer_momentum, options);
    std::vector<NamedTensor> tensors;
    for (nb::handle item : parameters) {
      auto pair = nb::cast<nb::tuple>(item);
      NamedTensor tensor;
      tensor.name = nb::cast<std::string>(pair[0]);
      tensor.view = import_tensor("parameter", tensor.name, pair[1], keep_, &tensor.shape);
      tensors.push_back(tensor);
      table_.push_back(tensor);
    }
    // group={"exchange_bucket": "s3://bucket/prefix", ...}: the group forms and exchanges
    // through the bucket (engine/bucket_transport.h); the other keys are the group's as usual.
    std::string exchange_bucket;
    nb::object group_rest = nb::borrow(group);
    if (PyDict_Check(group.ptr())) {
      const auto given = nb::borrow<nb::dict>(group);
      if (given.contains("exchange_bucket")) {
        const nb::object address = given["exchange_bucket"];
        if (!PyUnicode_Check(address.ptr()) || nb::cast<std::string>(address).empty()) {
          throw InvalidArgument(
              "group option 'exchange_bucket': expected an s3://bucket/prefix "
              "address, got " +
              (PyUnicode_Check(address.ptr())
                   ? std::string("an empty str")
                   : "a " + std::string(nb::inst_name(address).c_str())));
        }
        exchange_bucket = nb::cast<std::string>(address);
        nb::dict rest;
        for (auto [key, value] : given)
          if (!PyUnicode_Check(key.ptr()) || nb::cast<std::string>(key) != "exchange_bucket")
            rest[key] = value;
        group_rest = rest;
      }
    }
    if (!exchange_bucket.empty() && !elastic.is_none()) {
      throw InvalidArgument(
          "group option exchange_bucket: elastic membership is not supported through a bucket "
          "(its group is fixed at WORLD_SIZE; see docs/operations.md, \"A group through a "
          "bucket\")");
    }
    if (!exchange_bucket.empty()) {
      const group::TransportOptions transport = transport_options(group_rest);
      BucketGroupOptions bucket;
      bucket.address = exchange_bucket;
      bucket.job_id = transport.run_id;
      bucket.secret = transport.tcp.secret;
      bucket.rank = transport.rank;
      bucket.world_size = transport.world_size;
      bucket.form_timeout = transport.connect_timeout;
      runner_ = collective_.run(
          [&]() -> std::unique_ptr<WindowRunner> {
            return std::make_unique<Engine>(std::move(tensors), engine_options,
                                            join_bucket_group(std::move(bucket)));
          },
          [] {});
    } else if (!elastic.is_none()) {
      if (!PyDict_Check(elastic.ptr())) {
        throw InvalidArgument("elastic must be a dict (coordinator, worker_id, ...) or None");
      }
      ElasticOptions elastic_options =
          python::elastic_options(nb::borrow<nb::dict>(elastic), group);
      auto elastic_engine = collective_.run(
          [&] {
            return std::make_unique<ElasticEngine>(std::move(tensors), engine_options,
                                                   std::move(elastic_options));
          },
          [] {});
      elastic_ = elastic_engine.get();
      runner_ = std::move(elastic_engine);
    } else {
      group::TransportOptions transport = transport_options(group);
      // Group formation cannot be interrupted: an interrupt takes effect once it has returned
      // (at most transport.connect_timeout, then the engine's start-up within its timeout).
      runner_ = collective_.run(
          [&]() -> std::unique_ptr<WindowRunner> {
            return std::make_unique<Engine>(std::move(tensors), engine_options,
                                            group::make_transport(transport));
          },
          [] {});
    }
  }

  Engine& engine() { return runner_->engine(); }

  std::optional<WindowReport> after_optimizer_step() {
    // The common case runs no window: no thread, no GIL release.
    if (!engine().next_step_runs_window()) return engine().after_optimizer_step();
    return collective([&] { return runner_->after_optimizer_step(); });
  }

  WindowReport run_window() {
    return collective([&] { return runner_->run_window(); });
  }

  std::optional<WindowReport> complete_in_flight() {
    // Nothing in flight (blocking runs, or already completed): no thread, no GIL release.
    if (!engine().window_in_flight()) return std::nullopt;
    return collective([&] { return runner_->complete_in_flight(); });
  }

  void average_gradients(const nb::list& gradients) {
    std::vector<nb::ndarray<>> keep;
    std::vector<TensorView> views;
    std::size_t i = 0;
    for (nb::handle gradient : gradients) {
      const std::string name = i < table_.size() ? table_[i].name : std::to_string(i);
      if (gradient.is_none()) {
        throw InvalidArgument(
            fmt::format("gradient of '{}' is None (call backward() before the step)", name),
            {.tensor = name});
      }
      views.push_back(import_tensor("gradient", name, gradient, keep, nullptr));
      ++i;
    }
    collective([&] { engine().average_gradients(views); });
  }

  std::string save_checkpoint(const std::string& root, std::uint32_t keep, const nb::dict& files) {
    CheckpointSave save;
    save.keep = keep;
    for (auto [name, bytes] : files) {
      if (!PyUnicode_Check(name.ptr())) {
        throw InvalidArgument("checkpoint files: a file name must be a str, got a " +
                              std::string(nb::inst_name(name).c_str()));
      }
      const auto file_name = nb::cast<std::string>(name);
      save.files.push_back({file_name, to_bytes(bytes, file_name)});
    }
    return collective([&] { return engine().save_checkpoint(root, save).string(); });
  }

  nb::tuple load_checkpoint(const std::string& path, const std::vector<std::string>& required) {
    LoadedCheckpoint loaded = collective([&] { return engine().load_checkpoint(path, required); });
    nb::dict files;
    for (const CheckpointFile& file : loaded.files) {
      files[file.name.c_str()] = nb::bytes(file.bytes.data(), file.bytes.size());
    }
    return nb::make_tuple(loaded.dir.string(), loaded.window, loaded.next_window, loaded.next_step,
                          files);
  }

  void close() {
    if (elastic_) {
      const nb::gil_scoped_release release;
      elastic_->leave();
    } else {
      engine().detach();
    }
    collective_.stop();
  }

  std::vector<TensorInfo> tensor_table() const {
    std::vector<TensorInfo> table;
    for (const NamedTensor& tensor : table_) {
      const Device device = tensor.view.device;
      table.push_back({tensor.name, reinterpret_cast<std::uintptr_t>(tensor.view.data),
                       tensor.view.numel,
                       tensor.view.dtype == DType::float32 ? "float32" : "bfloat16",
                       device.is_cpu() ? "cpu" : fmt::format("cuda:{}", device.index)});
    }
    return table;
  }

  nb::ndarray<nb::numpy, float> state(Engine::StateTensor which, std::size_t tensor) {
    if (tensor >= table_.size()) {
      throw InvalidArgument(
          fmt::format("tensor {} does not exist ({} tensors)", tensor, table_.size()),
          {.index = tensor});
    }
    return to_numpy(engine().copy_state(which, tensor));
  }

  nb::list members() {
    nb::list list;
    for (const std::string& member : engine().group().members)
      list.append(member.c_str());
    return list;
  }

 private:
  template <class Work>
  auto collective(Work&& work) -> decltype(work()) {
    return collective_.run(std::forward<Work>(work), [this] { abort_group(); });
  }

  // Ctrl-C: this rank gives up its group; the other ranks see it as lost. An elastic worker's
  // group changes under it (the coordinator re-forms it), so it is left to finish its call.
  void abort_group() {
    if (elastic_) return;
    try {
      engine().transport().abort("interrupted (KeyboardInterrupt)");
    } catch (const Error&) {
      // detached: nothing to abort
    }
  }

  std::vector<nb::ndarray<>> keep_;       // the parameters' owners (DLPack capsules, buffers)
  std::vector<NamedTensor> table_;        // the engine's views, for tensor_table()
  std::unique_ptr<WindowRunner> runner_;  // an Engine (a fixed group) or an ElasticEngine
  ElasticEngine* elastic_ = nullptr;      // runner_, when it is an ElasticEngine
  // Declared last: its thread ends before the engine goes.
  CollectiveThread collective_;
};

}  // namespace

void bind_synchronizer(nb::module_& module) {
  nb::class_<TensorInfo>(module, "TensorInfo",
                         "What the engine sees of one parameter tensor: data_ptr is the address "
                         "it reads and writes (the tensor's own memory).")
      .def_ro("name", &TensorInfo::name)
      .def_ro("data_ptr", &TensorInfo::data_ptr)
      .def_ro("numel", &TensorInfo::numel)
      .def_ro("dtype", &TensorInfo::dtype)
      .def_ro("device", &TensorInfo::device)
      .def("__repr__", [](const TensorInfo& t) {
        return fmt::format(
            "TensorInfo(name='{}', data_ptr=0x{:x}, numel={}, dtype='{}', "
            "device='{}')",
            t.name, t.data_ptr, t.numel, t.dtype, t.device);
      });

  using S = Synchronizer;
  nb::class_<S>(module, "_Synchronizer",
                "The engine behind pulseloco.Synchronizer (use that class: it accepts "
                "named_parameters() and optimizers).")
      .def(nb::init<const nb::list&, const std::string&, std::uint32_t, float, float,
                    const nb::dict&, const nb::handle&, const nb::handle&>(),
           nb::arg("parameters"), nb::arg("mode"), nb::arg("inner_steps"), nb::arg("outer_lr"),
           nb::arg("outer_momentum"), nb::arg("options"), nb::arg("group").none(),
           nb::arg("elastic").none(),
           "parameters: list of (name, tensor). Forms the group (collective).")
      .def("after_optimizer_step", &S::after_optimizer_step,
           "Counts the step; every inner_steps-th call runs a window and returns its report.")
      .def("run_window", &S::run_window, "Runs a window now (collective).")
      .def("complete_in_flight", &S::complete_in_flight,
           "Overlapped windows: applies the window in flight without starting another "
           "(collective); returns that boundary's report, or None when nothing is in flight.")
      .def("average_gradients", &S::average_gradients, nb::arg("gradients"),
           "ddp: replaces every gradient by its average over the ranks (collective).")
      .def("save_checkpoint", &S::save_checkpoint, nb::arg("root"), nb::arg("keep"),
           nb::arg("files"), "Writes a checkpoint under root (collective); returns its directory.")
      .def("load_checkpoint", &S::load_checkpoint, nb::arg("path"), nb::arg("required"),
           "Loads a checkpoint (collective) holding this rank's files `required`; returns "
           "(directory, window, next_window, next_step, files).")
      .def(
          "save_global_weights",
          [](S& s, const std::string& file) { s.engine().save_global_weights(file); },
          nb::arg("file"), "Writes this rank's global weights to a safetensors file.")
      .def(
          "set_cuda_stream",
          [](S& s, std::uintptr_t stream) {
            s.engine().set_cuda_stream(reinterpret_cast<void*>(stream));
          },
          nb::arg("stream"),
          "State on a CUDA device: the engine's device work runs after what this cudaStream_t "
          "(an address; 0: the legacy default stream) holds when it starts, and the stream's "
          "later work after it. Host state ignores it.")
      .def("close", &S::close, "Leaves an elastic run, or releases the group's transport.")
      .def("tensor_table", &S::tensor_table, "The engine's view of every parameter.")
      .def(
          "global_weights",
          [](S& s, std::size_t i) { return s.state(Engine::StateTensor::global_weights, i); },
          nb::arg("tensor"), "A float32 copy of tensor i's global weights.")
      .def(
          "momentum", [](S& s, std::size_t i) { return s.state(Engine::StateTensor::momentum, i); },
          nb::arg("tensor"), "A float32 copy of tensor i's outer momentum.")
      .def(
          "residual", [](S& s, std::size_t i) { return s.state(Engine::StateTensor::residual, i); },
          nb::arg("tensor"), "A float32 copy of tensor i's residual (this rank's).")
      .def_prop_ro("mode", [](S& s) { return std::string(mode_name(s.engine().options().mode)); })
      .def_prop_ro("rank", [](S& s) { return s.engine().rank(); })
      .def_prop_ro("world_size", [](S& s) { return s.engine().world_size(); })
      .def_prop_ro("committed_windows", [](S& s) { return s.engine().committed_windows(); })
      .def_prop_ro("parameter_count", [](S& s) { return s.engine().parameter_count(); })
      .def_prop_ro("state_location", [](S& s) { return s.engine().state_location(); })
      .def_prop_ro("digest", [](S& s) { return digest_hex(s.engine().state_digest()); })
      .def_prop_ro("next_step_runs_window", [](S& s) { return s.engine().next_step_runs_window(); })
      .def_prop_ro("window_in_flight", [](S& s) { return s.engine().window_in_flight(); })
      .def_prop_ro("next_window", [](S& s) { return s.engine().next_window(); })
      .def_prop_ro("options_json", [](S& s) { return to_json(s.engine().options()).dump(); })
      .def_prop_ro("generation", [](S& s) { return s.engine().group().generation; })
      .def_prop_ro("members", &S::members);
}

}  // namespace pulseloco::python
