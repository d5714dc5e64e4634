// A client of the S3 API for the few calls a publishing bucket needs: put (one request, or a
// multipart upload that holds one part in memory), get (streamed), list and delete. libcurl
// sends the requests and signs them (AWS SigV4, CURLOPT_AWS_SIGV4); expat parses the XML
// answers (docs/design.md says why these two).
//
// Failures: a connection failure, a stalled transfer, throttling (429, SlowDown) and 5xx are
// retried with a doubling pause (S3Settings), then an IoError naming the request, the bucket,
// the endpoint, the attempts and the last problem. Under a deadline (set_deadline) no retry
// starts past it: the request fails with a TimeoutError instead. Refused credentials, denied access
// and a missing bucket are an InvalidArgument naming the bucket and the endpoint at once (retrying
// does not change them); any other error answer is an IoError with S3's code and message.
//
// One client is used by one thread at a time (it keeps one connection open).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/io/atomic_file.h>
#include <pulseloco/io/s3_settings.h>

namespace pulseloco::io {

// Receives an object's bytes as they arrive. reset() starts over (a retried transfer).
class ObjectSink {
 public:
  virtual ~ObjectSink() = default;
  virtual void reset() = 0;
  virtual void write(std::span<const std::byte> bytes) = 0;
};

class S3Client {
 public:
  explicit S3Client(S3Settings settings);
  ~S3Client();
  S3Client(const S3Client&) = delete;
  S3Client& operator=(const S3Client&) = delete;

  [[nodiscard]] const S3Settings& settings() const noexcept;
  // "bucket 'NAME' at endpoint 'URL'", for errors.
  [[nodiscard]] std::string where(std::string_view bucket) const;

  void put_object(std::string_view bucket, std::string_view key, std::span<const std::byte> bytes);
  // Uploads a local file, in one request up to settings().part_bytes, else as a multipart
  // upload (aborted when it fails). Returns the size and xxh3-64 of the bytes sent.
  FileChecksum put_file(std::string_view bucket, std::string_view key,
                        const std::filesystem::path& path);
  // Streams an object into `sink`; false when there is no such key. IoError when the object is
  // larger than `max_bytes` (nothing beyond is received).
  [[nodiscard]] bool get_object(std::string_view bucket, std::string_view key, ObjectSink& sink,
                                std::uint64_t max_bytes);
  // An object's bytes; nullopt when there is no such key.
  [[nodiscard]] std::optional<std::vector<std::byte>> get_bytes(std::string_view bucket,
                                                                std::string_view key,
                                                                std::uint64_t max_bytes);
  // The keys under `prefix` (every page of ListObjectsV2), in S3's (byte) order.
  [[nodiscard]] std::vector<std::string> list_keys(std::string_view bucket,
                                                   std::string_view prefix);
  // Removes an object (no error when it is absent).
  void delete_object(std::string_view bucket, std::string_view key);

  // Bounds the retries of the requests that follow by `deadline` (a collective's): a retry whose
  // pause would end past it is not made, and the request fails with a TimeoutError naming it,
  // its attempts and the last problem. Each request's first attempt is always made, and an
  // attempt runs to its end (bounded by the connect and stall timeouts). nullopt: no bound
  // beyond S3Settings.
  void set_deadline(std::optional<std::chrono::steady_clock::time_point> deadline) noexcept;

  // Called after each part of a multipart upload is accepted, with its number (tests stop the
  // server there); empty in production.
  std::function<void(int part)> part_hook;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pulseloco::io
