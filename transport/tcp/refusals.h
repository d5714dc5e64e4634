// Internal: what a server refused while it waited for its members, so that the error it ends with
// on a timeout can name them ("rank 1 did not register; refused in the meantime: 127.0.0.1:5555
// failed authentication"). Connections that fail authentication must not end a server (anyone
// could then end it), so they are only logged and kept here.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstddef>
#include <string>
#include <vector>

namespace pulseloco::transport::tcp {

class RefusalRecord {
 public:
  // Keeps the first kKept descriptions; the rest are only counted.
  static constexpr std::size_t kKept = 8;

  void add(std::string description) {
    ++count_;
    if (kept_.size() < kKept) kept_.push_back(std::move(description));
  }

  // "; refused in the meantime: a; b (and 3 more)", or "" when nothing was refused.
  [[nodiscard]] std::string summary() const {
    if (count_ == 0) return {};
    std::string text = fmt::format("; refused in the meantime: {}", fmt::join(kept_, "; "));
    if (count_ > kept_.size()) text += fmt::format(" (and {} more)", count_ - kept_.size());
    return text;
  }

 private:
  std::vector<std::string> kept_;
  std::size_t count_ = 0;
};

}  // namespace pulseloco::transport::tcp
