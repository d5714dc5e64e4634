#include <pulseloco/io/s3_client.h>

#include <curl/curl.h>
#include <expat.h>
#include <fmt/format.h>
#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/io/input_file.h>

namespace pulseloco::io {
namespace {

// Error answers and listings are small; an answer beyond this is not S3's.
constexpr std::size_t kMaxAnswerBytes = std::size_t{16} << 20;

void global_init() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

std::string sha256_hex(std::span<const std::byte> bytes) {
  std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
  unsigned int size = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), digest.data(), &size, EVP_sha256(), nullptr) != 1)
    throw IoError("SHA-256 of a request body failed (OpenSSL)");
  std::string hex;
  for (unsigned int i = 0; i < size; ++i)
    hex += fmt::format("{:02x}", digest[i]);
  return hex;
}

// The leaf elements of an XML document, each with its path ("Error/Code") and text. S3's answers
// are flat enough that this is all that is read of them.
struct XmlLeaves {
  std::vector<std::pair<std::string, std::string>> leaves;
  std::vector<std::string> path;
  std::string text;
  bool leaf = false;

  [[nodiscard]] std::string find(std::string_view wanted) const {
    for (const auto& [name, value] : leaves)
      if (name == wanted) return value;
    return {};
  }
  [[nodiscard]] std::string root() const {
    return leaves.empty() ? std::string()
                          : leaves.front().first.substr(0, leaves.front().first.find('/'));
  }
};

std::string joined(const std::vector<std::string>& path) {
  std::string text;
  for (const std::string& part : path) {
    if (!text.empty()) text.push_back('/');
    text.append(part);
  }
  return text;
}

// nullopt when `body` is not well-formed XML.
std::optional<XmlLeaves> parse_xml(std::string_view body) {
  XmlLeaves document;
  const std::unique_ptr<std::remove_pointer_t<XML_Parser>, decltype(&XML_ParserFree)> parser(
      XML_ParserCreate("UTF-8"), &XML_ParserFree);
  if (!parser) throw IoError("cannot create an XML parser (expat)");
  XML_SetUserData(parser.get(), &document);
  XML_SetElementHandler(
      parser.get(),
      [](void* data, const XML_Char* name, const XML_Char**) {
        auto& doc = *static_cast<XmlLeaves*>(data);
        doc.path.emplace_back(name);
        doc.text.clear();
        doc.leaf = true;
      },
      [](void* data, const XML_Char*) {
        auto& doc = *static_cast<XmlLeaves*>(data);
        if (doc.leaf) doc.leaves.emplace_back(joined(doc.path), doc.text);
        doc.path.pop_back();
        doc.leaf = false;
        doc.text.clear();
      });
  XML_SetCharacterDataHandler(parser.get(), [](void* data, const XML_Char* text, int length) {
    static_cast<XmlLeaves*>(data)->text.append(text, static_cast<std::size_t>(length));
  });
  if (XML_Parse(parser.get(), body.data(), static_cast<int>(body.size()), XML_TRUE) !=
      XML_STATUS_OK) {
    return std::nullopt;
  }
  return document;
}

std::string escaped(CURL* curl, std::string_view text) {
  char* out = curl_easy_escape(curl, text.data(), static_cast<int>(text.size()));
  if (out == nullptr) throw IoError("curl_easy_escape failed");
  std::string result(out);
  curl_free(out);
  return result;
}

struct Request {
  const char* method = "GET";
  std::string bucket;
  std::string key;    // empty: the bucket itself
  std::string query;  // already encoded, parameters in sorted order (SigV4's canonical query)
  std::span<const std::byte> body;
  ObjectSink* sink = nullptr;  // the body of a 2xx answer goes here, else into Response::body
  std::uint64_t max_bytes = 0;
};

struct Response {
  long status = 0;
  std::string body;
  std::string etag;
  std::string code;  // S3's error code, for an error answer
};

// State of one transfer, shared with libcurl's callbacks.
struct Transfer {
  CURL* curl = nullptr;
  const Request* request = nullptr;
  Response response;
  std::uint64_t received = 0;
  std::string bound;           // the size bound that stopped the transfer; not retried
  std::exception_ptr failure;  // thrown by the sink; not retried
};

std::size_t on_body(char* data, std::size_t, std::size_t size, void* user) {
  auto& transfer = *static_cast<Transfer*>(user);
  long status = 0;
  curl_easy_getinfo(transfer.curl, CURLINFO_RESPONSE_CODE, &status);
  const bool to_sink = transfer.request->sink != nullptr && status >= 200 && status < 300;
  if (to_sink) {
    transfer.received += size;
    if (transfer.received > transfer.request->max_bytes) {
      transfer.bound =
          fmt::format("the object is larger than {} bytes", transfer.request->max_bytes);
      return 0;  // aborts the transfer
    }
    try {
      transfer.request->sink->write(std::as_bytes(std::span(data, size)));
    } catch (...) {
      transfer.failure = std::current_exception();
      return 0;
    }
  } else {
    if (transfer.response.body.size() + size > kMaxAnswerBytes) {
      transfer.bound = fmt::format("an answer larger than {} bytes", kMaxAnswerBytes);
      return 0;
    }
    transfer.response.body.append(data, size);
  }
  return size;
}

std::size_t on_header(char* data, std::size_t, std::size_t size, void* user) {
  auto& transfer = *static_cast<Transfer*>(user);
  std::string_view line(data, size);
  constexpr std::string_view kEtag = "etag:";
  if (line.size() > kEtag.size() &&
      std::equal(kEtag.begin(), kEtag.end(), line.begin(),
                 [](char a, char b) { return a == std::tolower(static_cast<unsigned char>(b)); })) {
    line.remove_prefix(kEtag.size());
    while (!line.empty() && (line.front() == ' ' || line.front() == '\t'))
      line.remove_prefix(1);
    while (!line.empty() && (line.back() == '\r' || line.back() == '\n' || line.back() == ' '))
      line.remove_suffix(1);
    transfer.response.etag = std::string(line);
  }
  return size;
}

bool retryable_code(std::string_view code) {
  return code == "SlowDown" || code == "RequestTimeout" || code == "InternalError" ||
         code == "ServiceUnavailable" || code == "RequestTimeTooSkewed";
}

bool credentials_code(std::string_view code) {
  return code == "InvalidAccessKeyId" || code == "SignatureDoesNotMatch" ||
         code == "ExpiredToken" || code == "InvalidToken" || code == "TokenRefreshRequired" ||
         code == "AuthorizationHeaderMalformed" || code == "InvalidSecurity";
}

}  // namespace

struct S3Client::Impl {
  S3Settings settings;
  CURL* curl = nullptr;
  std::optional<std::chrono::steady_clock::time_point> deadline;

  ~Impl() {
    if (curl != nullptr) curl_easy_cleanup(curl);
  }

  [[nodiscard]] std::string url(const Request& request) const {
    std::string path;
    std::string_view key = request.key;
    while (!key.empty()) {
      const std::size_t slash = std::min(key.find('/'), key.size());
      path.push_back('/');
      path.append(escaped(curl, key.substr(0, slash)));
      key.remove_prefix(std::min(slash + 1, key.size()));
    }
    if (request.key.ends_with('/')) path.push_back('/');
    const std::string endpoint = settings.endpoint_url();
    std::string base;
    if (settings.path_style) {
      base = fmt::format("{}/{}", endpoint, request.bucket);
    } else {
      const std::size_t host = endpoint.find("://") + 3;
      base =
          fmt::format("{}{}.{}", endpoint.substr(0, host), request.bucket, endpoint.substr(host));
    }
    if (path.empty()) path.push_back('/');
    return request.query.empty() ? fmt::format("{}{}", base, path)
                                 : fmt::format("{}{}?{}", base, path, request.query);
  }

  [[nodiscard]] std::string describe(const Request& request) const {
    return fmt::format("{} s3://{}/{}", request.method, request.bucket, request.key);
  }

  [[nodiscard]] std::string where(std::string_view bucket) const {
    return fmt::format("bucket '{}' at endpoint '{}'", bucket, settings.endpoint_url());
  }

  // One attempt. Returns the CURLcode; fills transfer.response.
  CURLcode attempt(Transfer& transfer, const Request& request) {
    curl_easy_reset(curl);
    const std::string address = url(request);
    curl_easy_setopt(curl, CURLOPT_URL, address.c_str());
    curl_easy_setopt(curl, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
    if (settings.verbose) curl_easy_setopt(curl, CURLOPT_VERBOSE, 1L);
    curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS,
                     static_cast<long>(settings.connect_timeout.count()));
    curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, 1024L);
    curl_easy_setopt(
        curl, CURLOPT_LOW_SPEED_TIME,
        static_cast<long>(std::max<std::int64_t>(
            1, std::chrono::duration_cast<std::chrono::seconds>(settings.stall_timeout).count())));
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, &on_body);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &transfer);
    curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, &on_header);
    curl_easy_setopt(curl, CURLOPT_HEADERDATA, &transfer);
    const std::string method = request.method;
    if (method == "GET") {
      curl_easy_setopt(curl, CURLOPT_HTTPGET, 1L);
    } else if (method == "PUT" || method == "POST") {
      curl_easy_setopt(curl, CURLOPT_POST, 1L);
      curl_easy_setopt(curl, CURLOPT_POSTFIELDS, request.body.data());
      curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE,
                       static_cast<curl_off_t>(request.body.size()));
      if (method == "PUT") curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, "PUT");
    } else {
      curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, request.method);
    }
    // curl signs every header given here (so none may be an empty "Name:", which removes the
    // header but would still be signed) and takes the payload's hash from this one.
    std::vector<std::string> lines{
        fmt::format("x-amz-content-sha256: {}", sha256_hex(request.body)),
        "Content-Type: application/octet-stream"};
    if (!settings.session_token.empty())
      lines.push_back(fmt::format("x-amz-security-token: {}", settings.session_token));
    curl_slist* headers = nullptr;
    for (const std::string& line : lines)
      headers = curl_slist_append(headers, line.c_str());
    const std::unique_ptr<curl_slist, decltype(&curl_slist_free_all)> owned(headers,
                                                                            &curl_slist_free_all);
    curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
    const std::string sigv4 = fmt::format("aws:amz:{}:s3", settings.region);
    if (!settings.access_key.empty()) {
      curl_easy_setopt(curl, CURLOPT_AWS_SIGV4, sigv4.c_str());
      curl_easy_setopt(curl, CURLOPT_USERNAME, settings.access_key.c_str());
      curl_easy_setopt(curl, CURLOPT_PASSWORD, settings.secret_key.c_str());
    }
    const CURLcode result = curl_easy_perform(curl);
    curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &transfer.response.status);
    return result;
  }

  // Sends a request, retrying what may pass; returns any answer that is not retried (2xx or an
  // error the caller may expect, such as 404 NoSuchKey), throws for the rest.
  Response perform(const Request& request, int max_attempts = 0) {
    if (max_attempts == 0) max_attempts = settings.max_attempts;
    std::chrono::milliseconds pause = settings.first_backoff;
    std::string problem;
    for (int attempt_number = 1;; ++attempt_number) {
      if (request.sink != nullptr) request.sink->reset();
      Transfer transfer{.curl = curl, .request = &request};
      const CURLcode result = attempt(transfer, request);
      if (!transfer.bound.empty()) {
        throw IoError(
            fmt::format("{} ({}): {}", describe(request), where(request.bucket), transfer.bound));
      }
      if (transfer.failure) std::rethrow_exception(transfer.failure);  // the sink's, as it is
      Response& response = transfer.response;
      if (result != CURLE_OK) {
        problem = curl_easy_strerror(result);
      } else if (response.status < 200 || response.status >= 300) {
        const std::optional<XmlLeaves> answer = parse_xml(response.body);
        response.code = answer ? answer->find("Error/Code") : std::string();
        const std::string message = answer ? answer->find("Error/Message") : response.body;
        problem = fmt::format("HTTP {}{}{}{}{}", response.status, response.code.empty() ? "" : " ",
                              response.code, message.empty() ? "" : ": ", message);
        const bool retry =
            response.status == 429 || response.status >= 500 || retryable_code(response.code);
        if (!retry) {
          classify(request, response, problem);
          return response;
        }
      } else {
        return response;
      }
      if (attempt_number >= max_attempts) {
        throw IoError(fmt::format("{} ({}) failed after {} attempts: {}", describe(request),
                                  where(request.bucket), attempt_number, problem));
      }
      // Under a deadline the first attempt is always made and runs to its end (a slow but
      // working bucket still answers a poll made at the deadline); only retries stop there.
      if (deadline && std::chrono::steady_clock::now() + pause >= *deadline)
        throw past_deadline(request, attempt_number, problem);
      logger().info("{} ({}): {}; retrying in {} ms (attempt {} of {})", describe(request),
                    where(request.bucket), problem, pause.count(), attempt_number + 1,
                    max_attempts);
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, settings.max_backoff);
    }
  }

  [[nodiscard]] TimeoutError past_deadline(const Request& request, int attempts,
                                           const std::string& problem) const {
    return TimeoutError(
        fmt::format("{} ({}): gave up at the caller's deadline after {} attempt{}{}{}",
                    describe(request), where(request.bucket), attempts, attempts == 1 ? "" : "s",
                    problem.empty() ? "" : ": ", problem));
  }

  // Throws for an error answer that no caller expects; returns for a missing key.
  void classify(const Request& request, const Response& response, const std::string& problem) {
    const std::string& code = response.code;
    if (credentials_code(code) || (response.status == 401)) {
      throw InvalidArgument(fmt::format(
          "{}: the credentials were refused by {} ({}; access key id '{}', region '{}')",
          describe(request), where(request.bucket), problem,
          settings.access_key.empty() ? "none: unsigned request" : settings.access_key,
          settings.region));
    }
    if (code == "AccessDenied" || code == "AllAccessDisabled" || response.status == 403) {
      throw InvalidArgument(
          fmt::format("{}: access denied to {} ({}; access key id '{}')", describe(request),
                      where(request.bucket), problem,
                      settings.access_key.empty() ? "none" : settings.access_key));
    }
    if (code == "NoSuchBucket") {
      throw InvalidArgument(fmt::format("{}: {} does not exist ({})", describe(request),
                                        where(request.bucket), problem));
    }
    if (response.status == 404 && (code == "NoSuchKey" || code.empty())) return;
    throw IoError(fmt::format("{} ({}): {}", describe(request), where(request.bucket), problem));
  }

  std::string upload_part(const Request& base, int number, const std::string& upload_id,
                          std::span<const std::byte> bytes) {
    Request request = base;
    request.method = "PUT";
    request.query = fmt::format("partNumber={}&uploadId={}", number, escaped(curl, upload_id));
    request.body = bytes;
    const Response response = perform(request);
    if (response.status == 404 || response.etag.empty()) {
      throw IoError(fmt::format("{} part {} ({}): the answer has no ETag (HTTP {})",
                                describe(request), number, where(request.bucket), response.status));
    }
    return response.etag;
  }
};

S3Client::S3Client(S3Settings settings) : impl_(std::make_unique<Impl>()) {
  global_init();
  impl_->settings = std::move(settings);
  impl_->curl = curl_easy_init();
  if (impl_->curl == nullptr) throw IoError("curl_easy_init failed");
}

S3Client::~S3Client() = default;

const S3Settings& S3Client::settings() const noexcept {
  return impl_->settings;
}

std::string S3Client::where(std::string_view bucket) const {
  return impl_->where(bucket);
}

void S3Client::set_deadline(
    std::optional<std::chrono::steady_clock::time_point> deadline) noexcept {
  impl_->deadline = deadline;
}

void S3Client::put_object(std::string_view bucket, std::string_view key,
                          std::span<const std::byte> bytes) {
  const Response response = impl_->perform(
      {.method = "PUT", .bucket = std::string(bucket), .key = std::string(key), .body = bytes});
  if (response.status == 404) {
    throw IoError(fmt::format("PUT s3://{}/{} ({}): HTTP 404", bucket, key, where(bucket)));
  }
}

FileChecksum S3Client::put_file(std::string_view bucket, std::string_view key,
                                const std::filesystem::path& path) {
  const InputFile input(path, "a file to upload");
  const std::uint64_t part_bytes = impl_->settings.part_bytes;
  DigestStream digest;
  std::vector<std::byte> buffer(static_cast<std::size_t>(std::min(input.size(), part_bytes)));
  if (input.size() <= part_bytes) {
    input.read_at(0, buffer);
    digest.update(buffer);
    put_object(bucket, key, buffer);
    return {.size = input.size(), .digest = digest.finish()};
  }
  const Request base{.bucket = std::string(bucket), .key = std::string(key)};
  Request create = base;
  create.method = "POST";
  create.query = "uploads=";
  const Response created = impl_->perform(create);
  const std::optional<XmlLeaves> answer = parse_xml(created.body);
  const std::string upload_id =
      answer ? answer->find("InitiateMultipartUploadResult/UploadId") : std::string();
  if (upload_id.empty()) {
    throw IoError(fmt::format("{} ({}): the answer names no upload id", impl_->describe(create),
                              where(bucket)));
  }
  try {
    std::string complete = "<CompleteMultipartUpload>";
    int number = 0;
    for (std::uint64_t offset = 0; offset < input.size(); offset += part_bytes) {
      const std::span<std::byte> part(
          buffer.data(), static_cast<std::size_t>(std::min(part_bytes, input.size() - offset)));
      input.read_at(offset, part);
      digest.update(part);
      ++number;
      const std::string etag = impl_->upload_part(base, number, upload_id, part);
      complete +=
          fmt::format("<Part><PartNumber>{}</PartNumber><ETag>{}</ETag></Part>", number, etag);
      if (part_hook) part_hook(number);
    }
    complete += "</CompleteMultipartUpload>";
    Request finish = base;
    finish.method = "POST";
    finish.query = fmt::format("uploadId={}", escaped(impl_->curl, upload_id));
    finish.body = std::as_bytes(std::span(complete.data(), complete.size()));
    const Response finished = impl_->perform(finish);
    // S3 may answer 200 and still fail the completion in the body.
    const std::optional<XmlLeaves> result = parse_xml(finished.body);
    if (finished.status == 404 || !result || result->root() == "Error") {
      throw IoError(fmt::format("{} ({}): completing the multipart upload failed: {}",
                                impl_->describe(finish), where(bucket), finished.body));
    }
  } catch (...) {
    try {
      Request abort = base;
      abort.method = "DELETE";
      abort.query = fmt::format("uploadId={}", escaped(impl_->curl, upload_id));
      (void)impl_->perform(abort, 1);  // best effort: S3's lifecycle rules clean up the rest
    } catch (const std::exception& error) {
      logger().warn("aborting the multipart upload of s3://{}/{} failed: {}", bucket, key,
                    error.what());
    }
    throw;
  }
  return {.size = input.size(), .digest = digest.finish()};
}

bool S3Client::get_object(std::string_view bucket, std::string_view key, ObjectSink& sink,
                          std::uint64_t max_bytes) {
  const Response response = impl_->perform({.method = "GET",
                                            .bucket = std::string(bucket),
                                            .key = std::string(key),
                                            .sink = &sink,
                                            .max_bytes = max_bytes});
  return response.status != 404;
}

std::optional<std::vector<std::byte>> S3Client::get_bytes(std::string_view bucket,
                                                          std::string_view key,
                                                          std::uint64_t max_bytes) {
  struct Bytes final : ObjectSink {
    std::vector<std::byte> bytes;
    void reset() override { bytes.clear(); }
    void write(std::span<const std::byte> data) override {
      bytes.insert(bytes.end(), data.begin(), data.end());
    }
  } sink;
  if (!get_object(bucket, key, sink, max_bytes)) return std::nullopt;
  return std::move(sink.bytes);
}

std::vector<std::string> S3Client::list_keys(std::string_view bucket, std::string_view prefix) {
  std::vector<std::string> keys;
  std::string token;
  for (;;) {
    std::string query = token.empty()
                            ? std::string()
                            : fmt::format("continuation-token={}&", escaped(impl_->curl, token));
    query.append(fmt::format("list-type=2&prefix={}", escaped(impl_->curl, prefix)));
    const Request request{.method = "GET", .bucket = std::string(bucket), .query = query};
    const Response response = impl_->perform(request);
    const std::optional<XmlLeaves> answer = parse_xml(response.body);
    if (response.status == 404 || !answer) {
      throw IoError(fmt::format("{} ({}): not a ListObjectsV2 answer", impl_->describe(request),
                                where(bucket)));
    }
    for (const auto& [name, value] : answer->leaves)
      if (name == "ListBucketResult/Contents/Key") keys.push_back(value);
    token = answer->find("ListBucketResult/NextContinuationToken");
    if (answer->find("ListBucketResult/IsTruncated") != "true" || token.empty()) break;
  }
  return keys;
}

void S3Client::delete_object(std::string_view bucket, std::string_view key) {
  (void)impl_->perform(
      {.method = "DELETE", .bucket = std::string(bucket), .key = std::string(key)});
}

}  // namespace pulseloco::io
