#include <pulseloco/engine/layout.h>

#include <set>

#include <pulseloco/base/errors.h>

namespace pulseloco {

Layout::Layout(std::vector<TensorInfo> tensors, std::uint64_t chunk_elements,
               std::uint64_t bucket_elements)
    : tensors_(std::move(tensors)) {
  if (chunk_elements == 0 || bucket_elements == 0) {
    throw InvalidArgument("chunk and bucket sizes must be positive");
  }
  std::set<std::string> seen;
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    const TensorInfo& info = tensors_[t];
    if (info.name.empty()) {
      throw InvalidArgument("parameter " + std::to_string(t) + " has an empty name");
    }
    if (!seen.insert(info.name).second) {
      throw InvalidArgument("parameter name appears twice", {.tensor = info.name});
    }
    parameters_ += info.numel;
    for (std::uint64_t begin = 0; begin < info.numel; begin += chunk_elements) {
      chunks_.push_back(
          {static_cast<std::uint32_t>(t), begin, std::min(chunk_elements, info.numel - begin)});
    }
  }
  for (std::size_t c = 0; c < chunks_.size();) {
    BucketRef bucket{c, 0, 0};
    while (c < chunks_.size() &&
           (bucket.chunk_count == 0 || bucket.elements + chunks_[c].length <= bucket_elements)) {
      bucket.elements += chunks_[c].length;
      ++bucket.chunk_count;
      ++c;
    }
    buckets_.push_back(bucket);
  }
}

std::vector<std::uint64_t> Layout::numels() const {
  std::vector<std::uint64_t> result;
  result.reserve(tensors_.size());
  for (const auto& info : tensors_)
    result.push_back(info.numel);
  return result;
}

Digest Layout::table_digest() const {
  DigestStream stream;
  for (const auto& info : tensors_) {
    const std::uint64_t header[2] = {info.numel, static_cast<std::uint64_t>(info.dtype)};
    stream.update(std::as_bytes(std::span(header)));
    stream.update(std::as_bytes(std::span(info.name.data(), info.name.size() + 1)));
  }
  return stream.finish();
}

}  // namespace pulseloco
