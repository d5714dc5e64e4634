// Options from Python: keyword arguments and dicts whose keys are the C++ fields' names.
// Durations are seconds (float), as Python's own timeouts are.
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nanobind/stl/string.h>

#include <pulseloco/base/errors.h>
#include <pulseloco/transport/backend_registry.h>

#include "bindings.h"

namespace pulseloco::python {
namespace {

[[noreturn]] void wrong_type(const std::string& key, nb::handle value, const char* expected) {
  throw InvalidArgument(fmt::format("option '{}': expected {}, got a {}", key, expected,
                                    nb::inst_name(value).c_str()));
}

long long integer(const std::string& key, nb::handle value, long long min, long long max) {
  if (!PyLong_Check(value.ptr()) || PyBool_Check(value.ptr())) wrong_type(key, value, "an int");
  int overflow = 0;
  const long long result = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  if (overflow != 0 || result < min || result > max) {
    throw InvalidArgument(fmt::format("option '{}': {} is not in [{}, {}]", key,
                                      nb::cast<std::string>(nb::str(value)), min, max));
  }
  return result;
}

double real(const std::string& key, nb::handle value) {
  if (!PyFloat_Check(value.ptr()) && (!PyLong_Check(value.ptr()) || PyBool_Check(value.ptr()))) {
    wrong_type(key, value, "a float");
  }
  const double result = PyFloat_AsDouble(value.ptr());
  if (result == -1.0 && PyErr_Occurred() != nullptr) {  // an int beyond a double's range
    PyErr_Clear();
    throw InvalidArgument(fmt::format("option '{}': an int too large for a float", key));
  }
  return result;
}

bool boolean(const std::string& key, nb::handle value) {
  if (!PyBool_Check(value.ptr())) wrong_type(key, value, "a bool");
  return value.ptr() == Py_True;
}

std::string text(const std::string& key, nb::handle value) {
  if (!PyUnicode_Check(value.ptr())) wrong_type(key, value, "a str");
  return nb::cast<std::string>(value);
}

template <class Duration>
Duration seconds(const std::string& key, nb::handle value) {
  const double s = real(key, value);
  const double ticks =
      s * static_cast<double>(Duration::period::den) / static_cast<double>(Duration::period::num);
  if (!std::isfinite(ticks) || ticks < 0 || ticks > 1e15) {
    throw InvalidArgument(fmt::format("option '{}': {} s is not a duration", key, s));
  }
  return Duration(static_cast<typename Duration::rep>(std::llround(ticks)));
}

// One of `names` (the enum's values in order) for a key.
template <class Enum>
Enum choice(const std::string& key, nb::handle value, const std::vector<std::string>& names) {
  const std::string name = text(key, value);
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return static_cast<Enum>(i);
  }
  throw InvalidArgument(
      fmt::format("option '{}': '{}' is not one of {}", key, name, fmt::join(names, ", ")));
}

template <class Options>
using Setters = std::map<std::string, std::function<void(Options&, const std::string&, nb::handle)>,
                         std::less<>>;

template <class Options>
void apply(Options& options, const Setters<Options>& setters, const nb::dict& values,
           const char* what) {
  for (auto [key_object, value] : values) {
    if (!PyUnicode_Check(key_object.ptr())) wrong_type("<key>", key_object, "a str key");
    const std::string key = nb::cast<std::string>(key_object);
    const auto setter = setters.find(key);
    if (setter == setters.end()) {
      std::vector<std::string> known;
      for (const auto& [name, unused] : setters)
        known.push_back(name);
      throw InvalidArgument(
          fmt::format("unknown {} '{}' (known: {})", what, key, fmt::join(known, ", ")));
    }
    setter->second(options, key, value);
  }
}

// A setter of the key `name` for the field `field` (`key` and `v` are the key and the value).
#define PULSELOCO_SET_AS(name, field, expression)                                     \
  {                                                                                   \
    name, [](auto& o, const std::string& key, nb::handle v) { o.field = expression; } \
  }
#define PULSELOCO_SET(field, expression) PULSELOCO_SET_AS(#field, field, expression)

const Setters<EngineOptions>& engine_setters() {
  static const Setters<EngineOptions> setters{
      PULSELOCO_SET(chunk_elements, integer(key, v, 1, std::numeric_limits<long long>::max())),
      PULSELOCO_SET(bucket_elements, integer(key, v, 1, std::numeric_limits<long long>::max())),
      PULSELOCO_SET(threads, integer(key, v, 0, 4096)),
      PULSELOCO_SET(timeout, seconds<std::chrono::milliseconds>(key, v)),
      PULSELOCO_SET(allgather, parse_allgather(text(key, v))),
      PULSELOCO_SET(pipeline_chunk_bytes,
                    integer(key, v, 1, std::numeric_limits<long long>::max())),
      PULSELOCO_SET(bf16_delta, kernels::parse_bf16_delta(text(key, v))),
      PULSELOCO_SET(overlap, parse_overlap(text(key, v))),
      PULSELOCO_SET(exchange, parse_exchange(text(key, v))),
      PULSELOCO_SET(node_aware, boolean(key, v)),
      PULSELOCO_SET(verify_digests, boolean(key, v)),
      PULSELOCO_SET(trace_dir, text(key, v)),
      PULSELOCO_SET(state_location, parse_state_location(text(key, v))),
      PULSELOCO_SET(publish_dir, text(key, v)),
      PULSELOCO_SET(publish_every, integer(key, v, 1, std::numeric_limits<long long>::max())),
      PULSELOCO_SET(publish_continue, boolean(key, v)),
      PULSELOCO_SET(anchor_every, integer(key, v, 1, std::numeric_limits<long long>::max())),
      {"encoding", [](auto& o, const std::string& key,
                      nb::handle v) { o.codec.encoding = parse_encoding(text(key, v)); }},
      {"zstd_level", [](auto& o, const std::string& key,
                        nb::handle v) { o.codec.zstd_level = int(integer(key, v, 0, 19)); }},
      {"index_coding",
       [](auto& o, const std::string& key, nb::handle v) {
         if (v.is_none() || (PyUnicode_Check(v.ptr()) && text(key, v) == "auto")) {
           o.codec.index_coding.reset();
           return;
         }
         o.codec.index_coding =
             choice<codec::IndexCoding>(key, v, {"varint", "bitpack", "elias_fano"});
       }},
  };
  return setters;
}

const Setters<group::TransportOptions>& transport_setters() {
  static const Setters<group::TransportOptions> setters{
      {"backend",
       [](auto& o, const std::string& key, nb::handle v) {
         o.backend = choice<transport::Backend>(key, v, {"tcp", "mpi", "nccl"});
       }},
      {"rendezvous",
       [](auto& o, const std::string& key, nb::handle v) {
         o.rendezvous = choice<group::RendezvousMethod>(key, v, {"auto", "mpi", "env", "peers"});
       }},
      PULSELOCO_SET(rank, int(integer(key, v, -1, 1 << 20))),
      PULSELOCO_SET(world_size, int(integer(key, v, -1, 1 << 20))),
      PULSELOCO_SET(master_addr, text(key, v)),
      PULSELOCO_SET(master_port, std::uint16_t(integer(key, v, 0, 65535))),
      PULSELOCO_SET(external_rendezvous_server, boolean(key, v)),
      {"peers",
       [](auto& o, const std::string& key, nb::handle v) {
         if (!PyList_Check(v.ptr()) && !PyTuple_Check(v.ptr())) {
           wrong_type(key, v, "a list of \"host:port\" strings");
         }
         o.peers.clear();
         for (nb::handle peer : v)
           o.peers.push_back(text(key, peer));
       }},
      PULSELOCO_SET(group_key, text(key, v)),
      PULSELOCO_SET(run_id, text(key, v)),
      PULSELOCO_SET(advertise_addr, text(key, v)),
      PULSELOCO_SET(socket_ifname, text(key, v)),
      PULSELOCO_SET(connect_timeout, seconds<std::chrono::milliseconds>(key, v)),
      {"nccl_bootstrap",
       [](auto& o, const std::string& key, nb::handle v) {
         o.nccl_bootstrap = choice<group::NcclBootstrap>(key, v, {"auto", "mpi", "tcp"});
       }},
      // TcpOptions
      PULSELOCO_SET_AS("listen_addr", tcp.listen_addr, text(key, v)),
      PULSELOCO_SET_AS("listen_port", tcp.listen_port, std::uint16_t(integer(key, v, 0, 65535))),
      PULSELOCO_SET_AS("connections_per_peer", tcp.connections_per_peer,
                       int(integer(key, v, 1, 64))),
      PULSELOCO_SET_AS("stripe_threshold_bytes", tcp.stripe_threshold_bytes,
                       integer(key, v, 0, std::numeric_limits<long long>::max())),
      PULSELOCO_SET_AS("stripe_chunk_bytes", tcp.stripe_chunk_bytes,
                       integer(key, v, 1, std::numeric_limits<long long>::max())),
      PULSELOCO_SET_AS("tcp_nodelay", tcp.tcp_nodelay, boolean(key, v)),
      PULSELOCO_SET_AS("socket_send_buffer_bytes", tcp.socket_send_buffer_bytes,
                       int(integer(key, v, 0, std::numeric_limits<int>::max()))),
      PULSELOCO_SET_AS("socket_receive_buffer_bytes", tcp.socket_receive_buffer_bytes,
                       int(integer(key, v, 0, std::numeric_limits<int>::max()))),
      PULSELOCO_SET_AS("keepalive", tcp.keepalive, boolean(key, v)),
      PULSELOCO_SET_AS("keepalive_idle_s", tcp.keepalive_idle_s, int(integer(key, v, 1, 86400))),
      PULSELOCO_SET_AS("keepalive_interval_s", tcp.keepalive_interval_s,
                       int(integer(key, v, 1, 86400))),
      PULSELOCO_SET_AS("keepalive_count", tcp.keepalive_count, int(integer(key, v, 1, 1000))),
      PULSELOCO_SET_AS("io_timeout", tcp.io_timeout, seconds<std::chrono::milliseconds>(key, v)),
      PULSELOCO_SET_AS("max_unexpected_bytes", tcp.max_unexpected_bytes,
                       integer(key, v, 0, std::numeric_limits<long long>::max())),
      PULSELOCO_SET_AS("payload_checksums", tcp.payload_checksums, boolean(key, v)),
      PULSELOCO_SET_AS("io_threads", tcp.io_threads, int(integer(key, v, 1, 64))),
      PULSELOCO_SET_AS("busy_poll", tcp.busy_poll, seconds<std::chrono::microseconds>(key, v)),
      PULSELOCO_SET_AS("secret", tcp.secret, text(key, v)),
      PULSELOCO_SET_AS("allow_insecure", tcp.allow_insecure, boolean(key, v)),
      {"link_security",
       [](auto& o, const std::string& key, nb::handle v) {
         o.tcp.link_security =
             choice<transport::LinkSecurity>(key, v, {"auto", "none", "hmac", "tls"});
       }},
      PULSELOCO_SET_AS("same_host_plaintext", tcp.same_host_plaintext, boolean(key, v)),
      PULSELOCO_SET_AS("tls_cert", tcp.tls_files.cert, text(key, v)),
      PULSELOCO_SET_AS("tls_key", tcp.tls_files.key, text(key, v)),
      PULSELOCO_SET_AS("tls_ca", tcp.tls_files.ca, text(key, v)),
      // MpiOptions, NcclOptions
      PULSELOCO_SET_AS("mpi_part_bytes", mpi.part_bytes,
                       integer(key, v, 1, std::numeric_limits<int>::max())),
      PULSELOCO_SET_AS("cuda_device", nccl.cuda_device, int(integer(key, v, -1, 1024))),
      PULSELOCO_SET_AS("local_rank", nccl.local_rank, int(integer(key, v, -1, 1 << 20))),
  };
  return setters;
}

const Setters<ElasticOptions>& elastic_setters() {
  static const Setters<ElasticOptions> setters{
      PULSELOCO_SET(coordinator, text(key, v)),
      PULSELOCO_SET(worker_id, text(key, v)),
      PULSELOCO_SET(admission_timeout, seconds<std::chrono::milliseconds>(key, v)),
      PULSELOCO_SET(max_attempts_per_window, int(integer(key, v, 1, 1 << 20))),
      // A worker of several ranks (the Python package sets these from `worker=`).
      PULSELOCO_SET(local_rank, int(integer(key, v, 0, 1 << 20))),
      PULSELOCO_SET(ranks_per_worker, int(integer(key, v, 1, 1 << 20))),
      PULSELOCO_SET(worker_link, text(key, v)),
      PULSELOCO_SET(worker_link_timeout, seconds<std::chrono::milliseconds>(key, v)),
  };
  return setters;
}

#undef PULSELOCO_SET
#undef PULSELOCO_SET_AS

void apply_group(group::TransportOptions& options, const nb::handle& group) {
  if (group.is_none()) return;
  if (!PyDict_Check(group.ptr())) wrong_type("group", group, "a dict or None");
  apply(options, transport_setters(), nb::borrow<nb::dict>(group), "group option");
  group::validate(options);
}

}  // namespace

EngineOptions engine_options(const std::string& mode, std::uint32_t inner_steps, float outer_lr,
                             float outer_momentum, const nb::dict& options) {
  EngineOptions result;
  result.mode = parse_mode(mode);
  result.steps_per_window = inner_steps;
  result.outer_lr = outer_lr;
  result.outer_momentum = outer_momentum;
  apply(result, engine_setters(), options, "option");
  result.validate();
  return result;
}

group::TransportOptions transport_options(const nb::handle& group) {
  group::TransportOptions options = group::from_environment();
  apply_group(options, group);
  return options;
}

ElasticOptions elastic_options(const nb::dict& elastic, const nb::handle& group) {
  ElasticOptions options = elastic_options_from_environment();
  apply(options, elastic_setters(), elastic, "elastic option");
  apply_group(options.transport, group);
  return options;
}

}  // namespace pulseloco::python
