#include <pulseloco/io/s3_settings.h>

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>

#include <pulseloco/base/errors.h>

namespace pulseloco::io {
namespace {

constexpr std::string_view kScheme = "s3://";
// PULSELOCO_S3_MAX_ATTEMPTS's largest accepted value (docs/operations.md).
constexpr std::uint64_t kMaxS3Attempts = 100;

std::string environment(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? std::string() : std::string(value);
}

std::string trim(std::string_view text) {
  const auto first = text.find_first_not_of(" \t\r");
  if (first == std::string_view::npos) return {};
  const auto last = text.find_last_not_of(" \t\r");
  return std::string(text.substr(first, last - first + 1));
}

// The sections of an AWS profile file (INI: "[name]", "key = value", '#' and ';' comments).
using Profiles = std::map<std::string, std::map<std::string, std::string>>;

Profiles read_profiles(const std::filesystem::path& path) {
  Profiles profiles;
  std::ifstream file(path);
  if (!file) return profiles;  // an absent file holds no profile
  std::string line;
  std::string section;
  while (std::getline(file, line)) {
    const std::string text = trim(line);
    if (text.empty() || text[0] == '#' || text[0] == ';') continue;
    if (text.front() == '[' && text.back() == ']') {
      section = trim(std::string_view(text).substr(1, text.size() - 2));
      continue;
    }
    const auto equals = text.find('=');
    if (equals == std::string::npos || section.empty()) continue;
    profiles[section][trim(std::string_view(text).substr(0, equals))] =
        trim(std::string_view(text).substr(equals + 1));
  }
  return profiles;
}

std::filesystem::path aws_file(const char* variable, const char* name) {
  const std::string explicit_path = environment(variable);
  if (!explicit_path.empty()) return explicit_path;
  const std::string home = environment("HOME");
  return home.empty() ? std::filesystem::path() : std::filesystem::path(home) / ".aws" / name;
}

std::string profile_value(const Profiles& profiles, const std::string& section,
                          const std::string& key) {
  const auto found = profiles.find(section);
  if (found == profiles.end()) return {};
  const auto value = found->second.find(key);
  return value == found->second.end() ? std::string() : value->second;
}

// A 0/1 variable; `fallback` when unset or empty.
bool switch_variable(const char* name, bool fallback) {
  const std::string text = environment(name);
  if (text.empty()) return fallback;
  if (text != "0" && text != "1")
    throw InvalidArgument(fmt::format("{}='{}' is not 0 or 1", name, text));
  return text == "1";
}

std::uint64_t positive_variable(const char* name, std::uint64_t fallback,
                                std::uint64_t max = std::numeric_limits<std::uint64_t>::max()) {
  const std::string text = environment(name);
  if (text.empty()) return fallback;
  std::uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || value == 0 || value > max) {
    throw InvalidArgument(
        max == std::numeric_limits<std::uint64_t>::max()
            ? fmt::format("{}='{}' is not a positive integer", name, text)
            : fmt::format("{}='{}' is not an integer from 1 to {}", name, text, max));
  }
  return value;
}

std::string checked_endpoint(const std::string& name, std::string endpoint) {
  while (!endpoint.empty() && endpoint.back() == '/')
    endpoint.pop_back();
  if (endpoint.find("://") == std::string::npos) endpoint = "https://" + endpoint;
  const bool known = endpoint.starts_with("https://") || endpoint.starts_with("http://");
  const std::string_view host = std::string_view(endpoint).substr(endpoint.find("://") + 3);
  if (!known || host.empty() || host.find('/') != std::string_view::npos) {
    throw InvalidArgument(fmt::format(
        "{}='{}' is not an endpoint: expected https://host[:port] (or http:// for a local "
        "server)",
        name, endpoint));
  }
  return endpoint;
}

}  // namespace

std::string S3Address::key(std::string_view relative) const {
  if (prefix.empty()) return std::string(relative);
  return relative.empty() ? prefix : fmt::format("{}/{}", prefix, relative);
}

std::string S3Address::url(std::string_view relative) const {
  const std::string path = key(relative);
  return path.empty() ? fmt::format("s3://{}", bucket) : fmt::format("s3://{}/{}", bucket, path);
}

bool is_s3_address(std::string_view text) noexcept {
  return text.starts_with(kScheme);
}

S3Address parse_s3_address(std::string_view text) {
  if (!is_s3_address(text))
    throw InvalidArgument(fmt::format("'{}' is not an s3://bucket/prefix address", text));
  std::string_view rest = text.substr(kScheme.size());
  const auto slash = rest.find('/');
  S3Address address{.bucket = std::string(rest.substr(0, slash))};
  std::string_view prefix = slash == std::string_view::npos ? "" : rest.substr(slash + 1);
  while (prefix.ends_with('/'))
    prefix.remove_suffix(1);
  address.prefix = std::string(prefix);
  const std::string& bucket = address.bucket;
  const bool bucket_ok = bucket.size() >= 3 && bucket.size() <= 63 &&
                         std::all_of(bucket.begin(), bucket.end(),
                                     [](char c) {
                                       return std::islower(static_cast<unsigned char>(c)) ||
                                              std::isdigit(static_cast<unsigned char>(c)) ||
                                              c == '.' || c == '-';
                                     }) &&
                         std::isalnum(static_cast<unsigned char>(bucket.front())) &&
                         std::isalnum(static_cast<unsigned char>(bucket.back()));
  if (!bucket_ok) {
    throw InvalidArgument(fmt::format(
        "'{}': '{}' is not a bucket name (3 to 63 lower-case letters, digits, '.' or '-')", text,
        bucket));
  }
  std::size_t begin = 0;
  while (!prefix.empty() && begin <= prefix.size()) {
    const std::size_t end = std::min(prefix.find('/', begin), prefix.size());
    const std::string_view part = prefix.substr(begin, end - begin);
    if (part.empty() || part == "." || part == "..")
      throw InvalidArgument(fmt::format("'{}': the prefix has an empty, '.' or '..' part", text));
    begin = end + 1;
  }
  return address;
}

std::string S3Settings::endpoint_url() const {
  return endpoint.empty() ? fmt::format("https://s3.{}.amazonaws.com", region) : endpoint;
}

S3Settings S3Settings::from_environment() {
  S3Settings settings;
  const std::string named_profile = environment("AWS_PROFILE");
  const std::string profile = named_profile.empty() ? "default" : named_profile;
  const std::filesystem::path credentials_path =
      aws_file("AWS_SHARED_CREDENTIALS_FILE", "credentials");
  const std::filesystem::path config_path = aws_file("AWS_CONFIG_FILE", "config");
  const Profiles credentials =
      credentials_path.empty() ? Profiles() : read_profiles(credentials_path);
  const Profiles config = config_path.empty() ? Profiles() : read_profiles(config_path);
  // ~/.aws/config names profiles "[profile NAME]", except "[default]".
  const std::string config_section = profile == "default" ? profile : "profile " + profile;
  // A profile named but found nowhere is a typo, not a request to send unsigned requests.
  if (!named_profile.empty() && !credentials.contains(profile) &&
      !config.contains(config_section)) {
    throw InvalidArgument(fmt::format("AWS_PROFILE='{}': no such profile in '{}' or '{}'",
                                      named_profile, credentials_path.string(),
                                      config_path.string()));
  }
  const auto from_profile = [&](const std::string& key) {
    std::string value = profile_value(credentials, profile, key);
    return value.empty() ? profile_value(config, config_section, key) : value;
  };

  for (const char* name : {"PULSELOCO_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"}) {
    const std::string value = environment(name);
    if (value.empty()) continue;
    settings.endpoint = checked_endpoint(name, value);
    break;
  }
  if (settings.endpoint.empty()) {
    const std::string value = from_profile("endpoint_url");
    if (!value.empty())
      settings.endpoint = checked_endpoint(config_path.string() + " endpoint_url", value);
  }
  for (std::string value :
       {environment("AWS_REGION"), environment("AWS_DEFAULT_REGION"), from_profile("region")}) {
    if (value.empty()) continue;
    settings.region = value;
    break;
  }

  settings.access_key = environment("AWS_ACCESS_KEY_ID");
  settings.secret_key = environment("AWS_SECRET_ACCESS_KEY");
  settings.session_token = environment("AWS_SESSION_TOKEN");
  if (settings.access_key.empty() != settings.secret_key.empty()) {
    throw InvalidArgument(
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set together (one is empty)");
  }
  if (settings.access_key.empty()) {
    settings.access_key = from_profile("aws_access_key_id");
    settings.secret_key = from_profile("aws_secret_access_key");
    settings.session_token = from_profile("aws_session_token");
    if (settings.access_key.empty() != settings.secret_key.empty()) {
      throw InvalidArgument(fmt::format(
          "profile '{}' ({}, {}) has only one of aws_access_key_id and aws_secret_access_key",
          profile, credentials_path.string(), config_path.string()));
    }
  }

  settings.path_style = !settings.endpoint.empty();
  settings.path_style = switch_variable("PULSELOCO_S3_PATH_STYLE", settings.path_style);
  settings.verbose = switch_variable("PULSELOCO_S3_VERBOSE", settings.verbose);
  settings.max_attempts =
      static_cast<int>(positive_variable("PULSELOCO_S3_MAX_ATTEMPTS", 6, kMaxS3Attempts));
  settings.part_bytes = positive_variable("PULSELOCO_S3_PART_BYTES", settings.part_bytes);
  return settings;
}

}  // namespace pulseloco::io
