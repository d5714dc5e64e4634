#include "test_groups.h"

#include <stdexcept>

namespace pulseloco::testing {

std::vector<std::string> test_backends() {
  return {"inproc"};
}

std::vector<std::unique_ptr<transport::Transport>> make_test_group(std::string_view backend,
                                                                   int world_size) {
  if (backend == "inproc") return transport::inproc::make_group(world_size);
  throw std::invalid_argument("unknown test backend " + std::string(backend));
}

}  // namespace pulseloco::testing
