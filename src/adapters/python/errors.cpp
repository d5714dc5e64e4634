// pulseloco.Error and its subclasses, created here (not in Python) so that the extension can raise
// them by ErrorKind. Each subclass also derives from the builtin exception a Python caller
// would catch for it (ValueError, OSError, TimeoutError).
#include <array>
#include <string>

#include <pulseloco/base/errors.h>

#include "bindings.h"

namespace pulseloco::python {
namespace {

constexpr std::size_t kKinds = static_cast<std::size_t>(ErrorKind::aborted) + 1;
// Owned references, kept for the life of the process (the module keeps them too).
std::array<PyObject*, kKinds> g_classes{};
// Error.kind: the C++ enumerator's name, an identifier code can compare with.
constexpr std::array<const char*, kKinds> kKindNames{"invalid_argument", "io",         "timeout",
                                                     "peer_lost",        "protocol",   "divergence",
                                                     "non_finite",       "membership", "aborted"};

PyObject* new_class(nb::module_& module, const char* name, PyObject* bases, const char* doc) {
  const std::string qualified = std::string("pulseloco.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  if (cls == nullptr) throw nb::python_error();
  module.attr(name) = nb::borrow(cls);
  return cls;
}

nb::object optional_int(const auto& value) {
  return value ? nb::object(nb::int_(*value)) : nb::object(nb::none());
}

void raise(const Error& error) {
  PyObject* cls = g_classes[static_cast<std::size_t>(error.kind())];
  nb::object exception = nb::steal(PyObject_CallOneArg(cls, nb::str(error.what()).ptr()));
  if (!exception.is_valid()) return;  // the call failed and set its own Python error
  const ErrorContext& context = error.context();
  exception.attr("kind") = nb::str(kKindNames[static_cast<std::size_t>(error.kind())]);
  exception.attr("rank") = optional_int(context.rank);
  exception.attr("peer") = optional_int(context.peer);
  exception.attr("tensor") =
      context.tensor.empty() ? nb::object(nb::none()) : nb::object(nb::str(context.tensor.c_str()));
  exception.attr("index") = optional_int(context.index);
  exception.attr("byte_offset") = optional_int(context.byte_offset);
  nb::list ranks;
  for (int rank : context.ranks)
    ranks.append(rank);
  exception.attr("ranks") = ranks;
  PyErr_SetObject(cls, exception.ptr());
}

}  // namespace

void bind_errors(nb::module_& module) {
  PyObject* base = new_class(
      module, "Error", PyExc_Exception,
      "Base of every pulseloco error. str(e) is the C++ message with its context; the context is "
      "also in attributes: kind (the C++ ErrorKind's name: 'invalid_argument', 'io', 'timeout', "
      "'peer_lost', ...), rank, peer, tensor, index, byte_offset (None when unset) "
      "and ranks (list).");
  for (const char* attribute : {"kind", "rank", "peer", "tensor", "index", "byte_offset"}) {
    PyObject_SetAttrString(base, attribute, Py_None);
  }
  PyObject_SetAttrString(base, "ranks", nb::tuple().ptr());

  struct Subclass {
    ErrorKind kind;
    const char* name;
    PyObject* builtin;  // also derives from it, or null
    const char* doc;
  };
  const Subclass subclasses[] = {
      {ErrorKind::invalid_argument, "InvalidArgument", PyExc_ValueError,
       "A caller, an option or a file asked for something impossible (also a ValueError)."},
      {ErrorKind::io, "IoError", PyExc_OSError,
       "The operating system or a file failed (also an OSError)."},
      {ErrorKind::timeout, "TimeoutError", PyExc_TimeoutError,
       "A deadline passed (also the builtin TimeoutError)."},
      {ErrorKind::peer_lost, "PeerLostError", nullptr,
       "A peer closed, crashed or became unreachable; `peer` names it when known."},
      {ErrorKind::protocol, "ProtocolError", nullptr,
       "Bytes from a peer or a file violate the wire or file format."},
      {ErrorKind::divergence, "DivergenceError", nullptr,
       "Replicas that must be bit-identical are not; `ranks` names them."},
      {ErrorKind::non_finite, "NonFiniteError", nullptr,
       "NaN or infinity where the algorithm forbids it; `tensor` and `index` name it."},
      {ErrorKind::membership, "MembershipError", nullptr,
       "This worker is not (or no longer) in the run's group, or the run stopped."},
  };
  for (const Subclass& subclass : subclasses) {
    nb::object bases = subclass.builtin != nullptr
                           ? nb::make_tuple(nb::handle(base), nb::handle(subclass.builtin))
                           : nb::make_tuple(nb::handle(base));
    g_classes[static_cast<std::size_t>(subclass.kind)] =
        new_class(module, subclass.name, bases.ptr(), subclass.doc);
  }
  g_classes[static_cast<std::size_t>(ErrorKind::aborted)] = new_class(
      module, "AbortedError", g_classes[static_cast<std::size_t>(ErrorKind::peer_lost)],
      "This rank gave up its group (an interrupt, an earlier failure): also a PeerLostError.");
  // Each class's own kind, so that an error the Python layer raises carries one too.
  for (std::size_t kind = 0; kind < kKinds; ++kind)
    PyObject_SetAttrString(g_classes[kind], "kind", nb::str(kKindNames[kind]).ptr());

  nb::register_exception_translator([](const std::exception_ptr& pointer, void*) {
    try {
      std::rethrow_exception(pointer);
    } catch (const Error& caught) {
      raise(caught);
    }
  });
}

}  // namespace pulseloco::python
