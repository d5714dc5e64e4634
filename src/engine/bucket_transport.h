// A group whose ranks exchange through an S3-compatible bucket instead of connections
// (docs/operations.md, "A group through a bucket"): no rank listens on any port or connects to
// another rank. It is a transport whose messages match by order and whose collectives are
// native (transport/native_collectives.h, as NCCL's are), so every collective of the engine
// (the join's checks and broadcast, the window's all-gather, the vote, the digests, diloco's
// all-reduce) runs through it unchanged:
//
//   all-gather   each rank writes its contribution as one object, then reads every other
//                rank's; a window's message is one object per rank
//   broadcast    the root writes one object, every other rank reads it
//   all-reduce   an all-gather of the inputs, summed in rank order (the same bytes everywhere)
//   messages     the collectives' headers and completion notices: one object per message
//
// Object names: <prefix>/<job id>/w<window>/c<n>-r<rank> (the n-th collective of the job;
// the window is the engine's, label_bucket_window) and .../p<k>-r<from>-r<to> (the k-th message
// from one rank to another). Every object is sealed (io/sealed_object.h): a MAC with the job's
// secret over its name and content, so that an object written without the secret, or copied
// from another name (another window, rank or job), is refused with a ProtocolError naming it
// and the rank it claims to come from.
//
// Forming the group: rank and world size come from the caller (the launcher's RANK and
// WORLD_SIZE); each rank writes a hello object <prefix>/<job id>/hello/r<rank> (its world size)
// and waits, up to form_timeout, for every rank's. A rank whose hello is already there refuses
// to start (the job id was used before: objects of that job would be taken for this one's).
// The engine's join then checks options, tensor tables and weights through the collectives.
//
// Waits poll the bucket (first_poll, doubling to max_poll) until their deadline; a wait that
// ends without the object throws TimeoutError naming the rank whose object is missing.
//
// Old objects: when the engine labels window w, each rank deletes the objects it wrote in
// windows w-2 and earlier (every rank has finished reading them: it completed window w-1's
// collectives, whose completion round follows every read). The hellos and the last two
// windows' objects remain when the job ends.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <pulseloco/io/s3_settings.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco {

struct BucketGroupOptions {
  std::string address;  // s3://bucket/prefix
  std::string job_id;   // names this job's objects; a new one for every job (PULSELOCO_RUN_ID)
  std::string secret;   // keys every object's MAC (PULSELOCO_SECRET); required
  int rank = -1;
  int world_size = -1;
  std::chrono::milliseconds form_timeout{60'000};  // waiting for every rank's hello
  std::chrono::milliseconds first_poll{5};
  std::chrono::milliseconds max_poll{100};
  std::optional<io::S3Settings> settings;  // nullopt: io::S3Settings::from_environment()
};

// Forms the group as above and returns its transport (backend "bucket"). InvalidArgument
// naming the field for invalid options; TimeoutError naming the ranks whose hello is missing.
[[nodiscard]] std::unique_ptr<transport::Transport> join_bucket_group(BucketGroupOptions options);

// Names the window whose collectives follow (the engine calls it at each window's start; a
// no-op on other transports), and deletes this rank's objects of windows before window - 1.
void label_bucket_window(transport::Transport& transport, std::uint64_t window);

// The requests a bucket group's transport has made: objects written, objects read, reads that
// found no object yet (polls), objects deleted. All zero for another transport.
struct BucketRequests {
  std::uint64_t puts = 0;
  std::uint64_t gets = 0;
  std::uint64_t misses = 0;
  std::uint64_t deletes = 0;
};
[[nodiscard]] BucketRequests bucket_requests(const transport::Transport& transport);

// True when `transport` is a bucket group's.
[[nodiscard]] bool is_bucket_group(const transport::Transport& transport) noexcept;

}  // namespace pulseloco
