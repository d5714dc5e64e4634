#include <pulseloco/base/errors.h>

#include <gtest/gtest.h>

namespace pulseloco {
namespace {

TEST(Errors, MessageNamesEverythingInTheContext) {
  const ProtocolError error(
      "frame checksum mismatch",
      {.rank = 1, .peer = 3, .tensor = "layers.0.w", .index = 42, .byte_offset = 1024});
  EXPECT_EQ(error.kind(), ErrorKind::protocol);
  EXPECT_EQ(std::string(error.what()),
            "protocol violation: frame checksum mismatch (raised on rank 1; peer 3; tensor "
            "'layers.0.w'; index 42; byte offset 1024)");
  EXPECT_EQ(error.message(), "frame checksum mismatch");
  EXPECT_EQ(error.context().peer, 3);
}

TEST(Errors, EmptyContextLeavesNoParentheses) {
  const TimeoutError error("receive deadline passed");
  EXPECT_EQ(std::string(error.what()), "timeout: receive deadline passed");
}

TEST(Errors, DivergenceNamesTheRanks) {
  const DivergenceError error("digests differ", {.ranks = {0, 2}});
  EXPECT_EQ(std::string(error.what()), "replica divergence: digests differ (ranks involved: 0, 2)");
}

TEST(Errors, OneRankInvolvedIsNotCalledRanks) {
  const DivergenceError error("digests differ", {.rank = 1, .ranks = {1}});
  EXPECT_EQ(std::string(error.what()),
            "replica divergence: digests differ (raised on rank 1; rank involved: 1)");
}

TEST(Errors, AnAbortIsAPeerLostErrorOfItsOwnKind) {
  try {
    throw AbortedError("the engine gave up", {.rank = 2});
  } catch (const PeerLostError& error) {
    EXPECT_EQ(error.kind(), ErrorKind::aborted);
    EXPECT_EQ(error.message(), "the engine gave up");
    EXPECT_EQ(std::string(error.what()), "aborted: the engine gave up (raised on rank 2)");
  }
}

TEST(Errors, EveryKindIsCatchableAsError) {
  auto throws = [](ErrorKind kind) {
    switch (kind) {
      case ErrorKind::invalid_argument:
        throw InvalidArgument("x");
      case ErrorKind::io:
        throw IoError("x");
      case ErrorKind::timeout:
        throw TimeoutError("x");
      case ErrorKind::peer_lost:
        throw PeerLostError("x");
      case ErrorKind::aborted:
        throw AbortedError("x");
      case ErrorKind::protocol:
        throw ProtocolError("x");
      case ErrorKind::divergence:
        throw DivergenceError("x");
      case ErrorKind::non_finite:
        throw NonFiniteError("x");
      case ErrorKind::membership:
        throw MembershipError("x");
    }
  };
  for (auto kind : {ErrorKind::invalid_argument, ErrorKind::io, ErrorKind::timeout,
                    ErrorKind::peer_lost, ErrorKind::aborted, ErrorKind::protocol,
                    ErrorKind::divergence, ErrorKind::non_finite, ErrorKind::membership}) {
    try {
      throws(kind);
      FAIL() << "did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), kind);
      EXPECT_EQ(std::string(e.what()).rfind(std::string(error_kind_name(kind)), 0), 0u);
    }
  }
}

}  // namespace
}  // namespace pulseloco
