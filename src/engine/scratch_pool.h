// Internal: reusable per-task scratch buffers: a task borrows one for the duration of a chunk and
// gives it back, so the engine allocates a handful of chunk-sized buffers once instead of per
// chunk.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

namespace pulseloco {

template <typename Scratch>
class ScratchPool {
 public:
  class Lease {
   public:
    Lease(ScratchPool& pool, std::unique_ptr<Scratch> scratch)
        : pool_(&pool), scratch_(std::move(scratch)) {}
    ~Lease() {
      if (scratch_) pool_->give_back(std::move(scratch_));
    }
    Lease(Lease&&) noexcept = default;
    Lease& operator=(Lease&&) = delete;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;

    Scratch& operator*() const noexcept { return *scratch_; }
    Scratch* operator->() const noexcept { return scratch_.get(); }

   private:
    ScratchPool* pool_;
    std::unique_ptr<Scratch> scratch_;
  };

  [[nodiscard]] Lease acquire() {
    std::lock_guard lock(mutex_);
    if (free_.empty()) return Lease(*this, std::make_unique<Scratch>());
    auto scratch = std::move(free_.back());
    free_.pop_back();
    return Lease(*this, std::move(scratch));
  }

  // Frees every idle buffer (e.g. after a window, to return memory between windows).
  void clear() {
    std::lock_guard lock(mutex_);
    free_.clear();
  }

 private:
  void give_back(std::unique_ptr<Scratch> scratch) {
    std::lock_guard lock(mutex_);
    free_.push_back(std::move(scratch));
  }

  std::mutex mutex_;
  std::vector<std::unique_ptr<Scratch>> free_;
};

}  // namespace pulseloco
