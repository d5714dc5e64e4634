// Where an S3-compatible bucket is and how to sign requests to it: `s3://bucket/prefix`
// addresses, and the endpoint, region and credentials from the standard AWS variables and
// profile files (docs/operations.md, "Buckets"). HTTPS unless an explicit endpoint says http.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

namespace pulseloco::io {

// `s3://bucket/prefix`: the prefix is the "directory" inside the bucket (may be empty).
struct S3Address {
  std::string bucket;
  std::string prefix;  // without leading or trailing '/'

  // The object key of `relative` (a path inside the prefix, '/'-separated).
  [[nodiscard]] std::string key(std::string_view relative) const;
  // "s3://bucket/prefix/relative"
  [[nodiscard]] std::string url(std::string_view relative = {}) const;
};

// True when `text` starts with "s3://".
[[nodiscard]] bool is_s3_address(std::string_view text) noexcept;
// InvalidArgument naming `text` when it is not `s3://bucket[/prefix]` with a valid bucket name
// (3 to 63 characters of lower-case letters, digits, '.', '-') and a prefix without empty,
// "." or ".." parts.
[[nodiscard]] S3Address parse_s3_address(std::string_view text);

struct S3Settings {
  // scheme://host[:port] without a path; empty: AWS itself (https://s3.<region>.amazonaws.com).
  std::string endpoint;
  std::string region = "us-east-1";
  std::string access_key;  // empty: unsigned requests
  std::string secret_key;
  std::string session_token;  // temporary credentials; empty when none
  // https://endpoint/bucket/key instead of https://bucket.endpoint/key (local servers, MinIO,
  // Swift). The default for an explicit endpoint.
  bool path_style = false;
  // Attempts of one request on a connection failure, throttling (429, SlowDown) or a 5xx, with
  // a pause that doubles from first_backoff up to max_backoff.
  int max_attempts = 6;
  std::chrono::milliseconds first_backoff{200};
  std::chrono::milliseconds max_backoff{10'000};
  std::chrono::milliseconds connect_timeout{10'000};
  // A transfer slower than 1 KiB/s for this long is abandoned (and retried).
  std::chrono::milliseconds stall_timeout{60'000};
  // Files above this size are uploaded in parts of this size (the memory an upload holds).
  // S3 requires at least 5 MiB per part except the last.
  std::uint64_t part_bytes = std::uint64_t{16} << 20;
  // libcurl prints every request and answer header to stderr (debugging).
  bool verbose = false;

  // The endpoint as requests name it ("https://s3.us-east-1.amazonaws.com" when empty).
  [[nodiscard]] std::string endpoint_url() const;

  // From the environment: PULSELOCO_S3_ENDPOINT, AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL;
  // AWS_REGION or AWS_DEFAULT_REGION; AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and
  // AWS_SESSION_TOKEN, else the profile AWS_PROFILE (default "default") of
  // AWS_SHARED_CREDENTIALS_FILE (~/.aws/credentials) and AWS_CONFIG_FILE (~/.aws/config);
  // PULSELOCO_S3_PATH_STYLE (0/1), PULSELOCO_S3_MAX_ATTEMPTS, PULSELOCO_S3_PART_BYTES,
  // PULSELOCO_S3_VERBOSE (0/1). InvalidArgument naming a bad value or an AWS_PROFILE found in
  // neither file.
  // InvalidArgument naming the variable or file for a value that is not valid. Without
  // credentials, requests are unsigned (a public bucket).
  [[nodiscard]] static S3Settings from_environment();
};

}  // namespace pulseloco::io
