// Internal: the messages between the elastic coordinator (coordinator.h) and its workers
// (membership_client.h).
//
// Wire protocol
// -------------
// One TCP connection per worker, for the worker's whole life. It starts with the HMAC-SHA256
// challenge-response of transport/tcp/handshake.h (purpose `membership`; any other purpose, a wrong
// secret or a malformed hello is refused). After it, both directions carry messages: a u32
// little-endian length (1 .. 1 MiB) followed by that many bytes of UTF-8 JSON, an object with a
// string "type". Every request gets exactly one reply, in order.
//
//   worker -> coordinator                          coordinator -> worker
//   {type: register, worker_id,                    {type: registered, generation}
//    data_host, data_port,                         {type: refused, reason}  (connection closed)
//    [local_ranks: [{host, port}]]}
//   {type: next_group, reason}                     {type: group, generation, rank, workers:
//                                                    [{id, host, port, [local_ranks]}],
//                                                    group_key, joined, lost}
//                                                  {type: error, message}
//   {type: boundary, window}                       {type: boundary, regroup}  or  {type: error}
//   {type: leave}                                  {type: bye}  (connection closed)
//
// A worker of G ranks (elastic_engine.h, ElasticOptions::ranks_per_worker) registers once, from
// its local rank 0, with the data addresses of its local ranks 1 .. G-1 in `local_ranks`; each
// group lists them the same way, and local rank j's group is every member's local rank j.
// The registration must complete within the handshake deadline of the connection
// (transport/tcp/listener.h, kHandshakeTimeout). A wildcard or
// empty data_host is replaced by the address the connection comes from. A message that is not
// a framed JSON object of a known type, a length above the limit, or a second request while one
// is unanswered is a protocol violation: the coordinator logs it and closes that connection,
// and the worker is treated as lost. Nothing such a connection does reaches other workers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>

namespace pulseloco::elastic {

using Json = nlohmann::json;

// Requests and replies are a few hundred bytes (a group table a few KiB); anything near this
// bound is not a membership message.
inline constexpr std::uint32_t kMaxMessageBytes = std::uint32_t{1} << 20;
inline constexpr std::size_t kLengthBytes = 4;
// The longest worker id or data host.
inline constexpr std::size_t kMaxNameBytes = 255;
// The most local ranks a registration may list (beyond local rank 0).
inline constexpr std::size_t kMaxLocalRanks = 1023;

// The length prefix and the JSON body of `message`.
[[nodiscard]] std::string encode_message(const Json& message);
// The body length a length prefix announces; ProtocolError when it is 0 or above the bound.
[[nodiscard]] std::uint32_t decode_length(std::span<const std::byte, kLengthBytes> prefix);
// A message body: a JSON object with a string "type"; ProtocolError otherwise.
[[nodiscard]] Json parse_message(std::string_view body);

// A string / unsigned field of a message; ProtocolError naming it when absent or of another
// type.
[[nodiscard]] std::string string_field(const Json& message, const char* name);
[[nodiscard]] std::uint64_t unsigned_field(const Json& message, const char* name);

// Why `name` cannot be a worker id or host ("" when it can): empty, too long, or with a
// control character.
[[nodiscard]] std::string check_name(std::string_view name, std::string_view what);

}  // namespace pulseloco::elastic
