#include <pulseloco/transport/tcp/job_id.h>

#include <fmt/format.h>
#include <openssl/rand.h>

#include <algorithm>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/transport/tcp/handshake.h>

namespace pulseloco::transport {

JobId derive_job_id(std::string_view secret, std::string_view run_id) {
  constexpr std::string_view kLabel = "pulseloco-job-v1|";
  std::vector<std::uint8_t> message(kLabel.begin(), kLabel.end());
  message.insert(message.end(), run_id.begin(), run_id.end());
  const tcp::Mac mac = tcp::hmac_sha256(secret, message);
  JobId job{};
  std::copy_n(mac.begin(), job.size(), job.begin());
  return job;
}

JobId random_job_id() {
  JobId job{};
  if (RAND_bytes(job.data(), static_cast<int>(job.size())) != 1)
    throw IoError("OpenSSL RAND_bytes failed to produce a job id");
  return job;
}

GroupId make_group_id(const JobId& job, std::span<const std::uint8_t, 8> within) {
  GroupId id{};
  std::copy(job.begin(), job.end(), id.begin());
  std::copy(within.begin(), within.end(), id.begin() + job.size());
  return id;
}

GroupId job_only_group_id(const JobId& job) {
  constexpr std::array<std::uint8_t, 8> kNoGroup{};
  return make_group_id(job, kNoGroup);
}

JobId job_of(const GroupId& group_id) noexcept {
  JobId job{};
  std::copy_n(group_id.begin(), job.size(), job.begin());
  return job;
}

std::string to_string(const JobId& job) {
  std::string text;
  for (const auto byte : job)
    text += fmt::format("{:02x}", byte);
  return text;
}

std::string group_mismatch(const GroupId& theirs, const GroupId& ours, bool check_group) {
  if (job_of(theirs) != job_of(ours))
    return fmt::format(
        "it belongs to job {}, this is job {} (jobs sharing a secret need distinct "
        "PULSELOCO_RUN_ID values)",
        to_string(job_of(theirs)), to_string(job_of(ours)));
  if (check_group && theirs != ours)
    return fmt::format(
        "it belongs to another group of job {} (the group id differs: an earlier run or "
        "generation)",
        to_string(job_of(ours)));
  return {};
}

}  // namespace pulseloco::transport
