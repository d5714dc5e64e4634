// Internal: the pieces of the extension pulseloco._pulseloco (module.cpp assembles them).
#pragma once

#include <nanobind/nanobind.h>

#include <string>

#include <pulseloco/elastic/elastic_engine.h>
#include <pulseloco/engine/options.h>
#include <pulseloco/group/options.h>

namespace pulseloco::python {

namespace nb = nanobind;

// pulseloco.Error and its subclasses, and the translation of pulseloco::Error into them by
// ErrorKind (errors.cpp).
void bind_errors(nb::module_& module);

// WindowReport, PhaseSeconds (report.cpp).
void bind_report(nb::module_& module);

// _Synchronizer, TensorInfo (synchronizer.cpp).
void bind_synchronizer(nb::module_& module);

// Options from Python values (options.cpp). Every key names a C++ field; an unknown key or a
// value of the wrong type is InvalidArgument naming it.
[[nodiscard]] EngineOptions engine_options(const std::string& mode, std::uint32_t inner_steps,
                                           float outer_lr, float outer_momentum,
                                           const nb::dict& options);
// group::from_environment() with the overrides of `group` (None or a dict).
[[nodiscard]] group::TransportOptions transport_options(const nb::handle& group);
// elastic_options_from_environment() with `elastic` (a dict) and `group` applied.
[[nodiscard]] ElasticOptions elastic_options(const nb::dict& elastic, const nb::handle& group);

}  // namespace pulseloco::python
