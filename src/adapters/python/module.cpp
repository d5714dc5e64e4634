// pulseloco._pulseloco: the Python face of the core engine (python/pulseloco wraps it).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <pulseloco/build_config.h>
#include <pulseloco/engine/options.h>
#include <pulseloco/transport/backend_registry.h>

#include "bindings.h"

#if PULSELOCO_PYTHON_WITH_MPI
#include <dlfcn.h>
#include <mpi.h>
#endif

namespace pulseloco::python {
namespace {

#if PULSELOCO_PYTHON_WITH_MPI
// Python loads extensions with RTLD_LOCAL, so the libmpi this extension pulled in is invisible
// to the plugins OpenMPI dlopens during MPI_Init; in OpenMPI builds whose plugins do not link
// libmpi themselves they then fail to resolve its symbols (Debian's link them and work either
// way). Making the loaded library global before anything calls MPI_Init, as mpi4py does,
// covers those builds.
void make_mpi_global() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&MPI_Init), &info) == 0 || info.dli_fname == nullptr) return;
  // The handle stays open for the life of the process, as the library does anyway.
  (void)dlopen(info.dli_fname, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
}
#endif

nb::dict features() {
  nb::dict result;
  result["version"] = PULSELOCO_VERSION_STRING;
  nb::list transports;
  for (auto backend :
       {transport::Backend::tcp, transport::Backend::mpi, transport::Backend::nccl}) {
    if (transport::backend_available(backend)) {
      transports.append(std::string(transport::backend_name(backend)));
    }
  }
  result["transports"] = transports;
  result["cuda"] = device_state_available();
  result["tls"] = true;
  result["elastic"] = true;
  result["libtorch"] = false;
  return result;
}

}  // namespace
}  // namespace pulseloco::python

NB_MODULE(_pulseloco, module) {
  namespace py = pulseloco::python;
#if PULSELOCO_PYTHON_WITH_MPI
  py::make_mpi_global();
#endif
  module.doc() = "The C++ core of pulseloco (import pulseloco instead).";
  module.attr("__version__") = PULSELOCO_VERSION_STRING;
  module.def("features", &py::features,
             "What this build offers: version, linked transports, whether the state can live on "
             "a CUDA device, TLS, elastic runs; libtorch is never linked.");
  py::bind_errors(module);
  py::bind_report(module);
  py::bind_synchronizer(module);
}
