#include "test_groups.h"

#include <pulseloco/transport/inproc/ordered.h>

#include <stdexcept>

#include "transport/loopback_group.h"  // tests/transport: TCP groups on loopback

namespace pulseloco::testing {

std::vector<std::string> test_backends() {
  return {"inproc", "tcp", "tcp_tls"};
}

std::vector<std::string> test_backends_with_ordered() {
  std::vector<std::string> backends = test_backends();
  backends.emplace_back("ordered");
  return backends;
}

std::vector<std::unique_ptr<transport::Transport>> make_test_group(std::string_view backend,
                                                                   int world_size) {
  if (backend == "inproc") return transport::inproc::make_group(world_size);
  if (backend == "ordered") return transport::inproc::make_ordered_group(world_size);
  if (backend == "tcp" || backend == "tcp_tls") {
    const auto security =
        backend == "tcp" ? transport::LinkSecurity::none : transport::LinkSecurity::tls;
    auto tcp =
        transport::testing::make_loopback_group(world_size, transport::testing::secured(security));
    std::vector<std::unique_ptr<transport::Transport>> group;
    for (auto& t : tcp)
      group.push_back(std::move(t));
    return group;
  }
  throw std::invalid_argument("unknown test backend " + std::string(backend));
}

}  // namespace pulseloco::testing
