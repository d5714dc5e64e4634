// Internal: how the model's tensors are cut into chunks (the unit of gating, encoding, aggregation
// and parallelism; one wire frame each) and grouped into buckets (the unit of dense all-reduce).
// Every rank derives the same layout from the same tensor table and options.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <pulseloco/base/digest.h>
#include <pulseloco/base/tensor_view.h>

namespace pulseloco {

struct ChunkRef {
  std::uint32_t tensor = 0;
  std::uint64_t begin = 0;   // first element within the tensor
  std::uint64_t length = 0;  // elements (>= 1)
};

// Consecutive chunks whose total is at most the bucket size (or one larger chunk).
struct BucketRef {
  std::size_t first_chunk = 0;
  std::size_t chunk_count = 0;
  std::uint64_t elements = 0;
};

struct TensorInfo {
  std::string name;
  std::uint64_t numel = 0;
  DType dtype = DType::float32;
};

class Layout {
 public:
  Layout() = default;
  // Throws InvalidArgument for duplicate or empty names.
  Layout(std::vector<TensorInfo> tensors, std::uint64_t chunk_elements,
         std::uint64_t bucket_elements);

  [[nodiscard]] const std::vector<TensorInfo>& tensors() const noexcept { return tensors_; }
  [[nodiscard]] const std::vector<ChunkRef>& chunks() const noexcept { return chunks_; }
  [[nodiscard]] const std::vector<BucketRef>& buckets() const noexcept { return buckets_; }
  [[nodiscard]] std::uint64_t parameters() const noexcept { return parameters_; }
  [[nodiscard]] std::vector<std::uint64_t> numels() const;
  // Digest of names, element counts and dtypes: equal on every rank of a consistent run.
  [[nodiscard]] Digest table_digest() const;

 private:
  std::vector<TensorInfo> tensors_;
  std::vector<ChunkRef> chunks_;
  std::vector<BucketRef> buckets_;
  std::uint64_t parameters_ = 0;
};

}  // namespace pulseloco
