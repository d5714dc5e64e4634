// The coordinator's membership policy (elastic/membership_policy.h) alone: workers register and
// send requests as events, time is an argument, and every test checks the decisions that come
// back (who is placed where, who is refused and why, when the run ends). No sockets, threads or
// clocks: each test is deterministic and takes microseconds.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/elastic/membership_policy.h>

namespace pulseloco::elastic {
namespace {

using namespace std::chrono_literals;
using TimePoint = MembershipPolicy::TimePoint;
using Ids = std::vector<std::string>;

const TimePoint t0 = TimePoint{} + 1000h;  // any instant: the policy only compares them

MembershipRules rules(int initial, int min_workers = 1, int max_workers = 0) {
  return MembershipRules{.initial_workers = initial,
                         .min_workers = min_workers,
                         .max_workers = max_workers,
                         .join_every_windows = 1,
                         .regroup_timeout = 10s};
}

// A policy whose workers the test names by id.
class Roster {
 public:
  explicit Roster(MembershipRules rules) : policy(rules) {}

  WorkerKey add(const std::string& id) {
    const auto registration = policy.register_worker(
        {.worker_id = id, .data_host = "127.0.0.1", .data_port = port_of(id), .from = "test"});
    EXPECT_TRUE(registration.key) << registration.refusal;
    keys[id] = registration.key.value_or(0);
    return keys[id];
  }
  Decisions ask(const std::string& id, TimePoint now = t0) {
    return policy.next_group(keys.at(id), "join", now);
  }
  Decisions boundary(const std::string& id, std::uint64_t window, TimePoint now = t0) {
    return policy.boundary(keys.at(id), window, now);
  }
  Decisions leave(const std::string& id) { return policy.leave(keys.at(id)); }
  Decisions lose(const std::string& id) {
    return policy.connection_closed(keys.at(id), "connection closed");
  }
  Standing standing(const std::string& id) const { return policy.standing(keys.at(id)).value(); }
  // Registers `ids` and has them ask in that order; returns the decisions of the last request.
  Decisions join(const Ids& ids) {
    Decisions last;
    for (const auto& id : ids)
      add(id);
    for (const auto& id : ids)
      last = ask(id);
    return last;
  }

  static std::uint16_t port_of(const std::string& id) {
    return static_cast<std::uint16_t>(20000 + id.size() * 100 + static_cast<unsigned char>(id[0]));
  }

  MembershipPolicy policy;
  std::map<std::string, WorkerKey> keys;
};

// The error reply to `to` among `decisions`, or "" when it got none.
std::string error_to(const Decisions& decisions, WorkerKey to) {
  for (const auto& error : decisions.errors)
    if (error.to == to) return error.message;
  return {};
}

bool answers_regroup(const Decisions& decisions) {
  EXPECT_EQ(decisions.boundary_replies.size(), 1u);
  EXPECT_TRUE(decisions.errors.empty());
  return !decisions.boundary_replies.empty() && decisions.boundary_replies.front().regroup;
}

bool has_note(const Decisions& decisions, Note::Level level, const std::string& part) {
  return std::any_of(decisions.notes.begin(), decisions.notes.end(), [&](const Note& note) {
    return note.level == level && note.text.find(part) != std::string::npos;
  });
}

TEST(MembershipPolicy, RulesThatCannotDescribeARunAreRefusedNamingTheField) {
  const auto refused = [](MembershipRules bad, const std::string& field) {
    try {
      MembershipPolicy policy(bad);
      ADD_FAILURE() << "rules accepted; expected a complaint about " << field;
    } catch (const InvalidArgument& error) {
      EXPECT_NE(std::string(error.what()).find(field), std::string::npos) << error.what();
    }
  };
  refused(rules(0), "initial_workers is 0");
  refused(rules(2, 3), "min_workers is 3");
  refused(rules(2, 0), "min_workers is 0");
  refused(rules(3, 1, 2), "max_workers is 2");
  auto every = rules(2);
  every.join_every_windows = 0;
  refused(every, "join_every_windows");
  auto timeout = rules(2);
  timeout.regroup_timeout = 0ms;
  refused(timeout, "regroup_timeout is 0 ms");
  MembershipPolicy unlimited(rules(2, 1, 0));  // 0 = no limit
  EXPECT_EQ(unlimited.phase(), RunPhase::forming);
}

TEST(MembershipPolicy, TheFirstGenerationFormsOnceTheInitialWorkersWaitRankedInArrivalOrder) {
  Roster run(rules(3));
  for (const char* id : {"a", "b", "c", "d"})
    run.add(id);
  EXPECT_FALSE(run.ask("c").formed);
  EXPECT_FALSE(run.ask("a").formed);
  EXPECT_EQ(run.policy.waiting(), 2u);
  EXPECT_EQ(run.policy.generation(), 0u);
  const auto decisions = run.ask("b");
  ASSERT_TRUE(decisions.formed);
  const Generation& first = *decisions.formed;
  EXPECT_EQ(first.number, 1u);
  EXPECT_EQ(first.worker_ids, (Ids{"c", "a", "b"}));
  EXPECT_EQ(first.members, (std::vector<WorkerKey>{run.keys["c"], run.keys["a"], run.keys["b"]}));
  EXPECT_EQ(first.data_addresses[0].port, Roster::port_of("c"));
  EXPECT_EQ(first.joined, (Ids{"c", "a", "b"}));  // everyone is new in generation 1
  EXPECT_TRUE(first.lost.empty());
  EXPECT_EQ(run.policy.phase(), RunPhase::running);
  EXPECT_EQ(run.policy.waiting(), 0u);
  EXPECT_EQ(run.standing("a"), Standing::member);
  // A fourth worker waits for a boundary or a regroup: no generation forms by itself.
  EXPECT_FALSE(run.ask("d").formed);
  EXPECT_EQ(run.standing("d"), Standing::waiting);
  EXPECT_EQ(run.policy.waiting(), 1u);
}

TEST(MembershipPolicy, AWorkerLostWhileTheFirstGenerationFormsLeavesTheQueue) {
  Roster run(rules(2));
  run.add("a");
  run.add("b");
  run.add("c");
  (void)run.ask("a");
  const auto lost = run.lose("a");
  EXPECT_TRUE(has_note(lost, Note::Level::info, "worker a lost while waiting to join"));
  EXPECT_EQ(run.policy.waiting(), 0u);
  EXPECT_FALSE(run.ask("b").formed);  // `a` no longer counts
  const auto formed = run.ask("c").formed;
  ASSERT_TRUE(formed);
  EXPECT_EQ(formed->worker_ids, (Ids{"b", "c"}));
}

TEST(MembershipPolicy, RegistrationRefusesBadIdsHostsAndPortsAndResolvesAWildcardHost) {
  MembershipPolicy policy(rules(1));
  const auto refusal = [&](RegistrationRequest request) {
    const auto registration = policy.register_worker(request);
    EXPECT_FALSE(registration.key);
    return registration.refusal;
  };
  EXPECT_EQ(refusal({.worker_id = "", .data_host = "h", .data_port = 1}), "the worker id is empty");
  EXPECT_EQ(refusal({.worker_id = "a\nb", .data_host = "h", .data_port = 1}),
            "the worker id contains a control character");
  EXPECT_EQ(refusal({.worker_id = "a", .data_host = std::string(256, 'h'), .data_port = 1}),
            "the data host is longer than 255 bytes");
  EXPECT_EQ(refusal({.worker_id = "a", .data_host = "h", .data_port = 0}),
            "data port 0 is not in 1..65535");
  EXPECT_EQ(refusal({.worker_id = "a", .data_host = "h", .data_port = 65536}),
            "data port 65536 is not in 1..65535");
  EXPECT_EQ(refusal({.worker_id = "a", .data_host = "0.0.0.0", .data_port = 7}),
            "cannot tell the address of the connection for its wildcard data host");
  EXPECT_EQ(policy.known_workers(), 0u);  // a refusal leaves nothing behind

  for (const char* wildcard : {"", "0.0.0.0", "::"}) {
    const std::string id = std::string("w") + wildcard;
    const auto registration = policy.register_worker({.worker_id = id,
                                                      .data_host = wildcard,
                                                      .data_port = 7,
                                                      .remote_address = "192.0.2.5",
                                                      .from = "192.0.2.5:4000"});
    ASSERT_TRUE(registration.key) << registration.refusal;
    EXPECT_NE(registration.note.text.find("data address 192.0.2.5:7"), std::string::npos)
        << registration.note.text;
  }
}

TEST(MembershipPolicy, AWorkerOfSeveralRanksIsOneMemberWithEveryLocalRanksAddress) {
  MembershipPolicy policy(rules(2));
  const auto register_worker = [&](const std::string& id, std::vector<StatedAddress> lanes) {
    return policy.register_worker({.worker_id = id,
                                   .data_host = "0.0.0.0",
                                   .data_port = 7000,
                                   .local_ranks = std::move(lanes),
                                   .remote_address = "192.0.2.5",
                                   .from = "test"});
  };
  const auto a = register_worker("a", {{"10.0.0.1", 7001}, {"", 7002}});
  ASSERT_TRUE(a.key) << a.refusal;
  EXPECT_NE(a.note.text.find("192.0.2.5:7000, 10.0.0.1:7001, 192.0.2.5:7002"), std::string::npos)
      << a.note.text;
  // The first registration set three ranks per worker: another layout is refused, naming both.
  const auto b = register_worker("b", {{"10.0.0.2", 7001}});
  EXPECT_FALSE(b.key);
  EXPECT_EQ(b.refusal,
            "worker layouts differ: worker b has 2 ranks; the run's workers have 3 (worker a "
            "registered first with that many)");
  const auto bad = register_worker("c", {{"h", 7001}, {"h", 0}});
  EXPECT_EQ(bad.refusal, "local rank 2's data port 0 is not in 1..65535");
  const auto c = register_worker("c", {{"10.0.0.3", 7001}, {"10.0.0.3", 7002}});
  ASSERT_TRUE(c.key) << c.refusal;

  // The unit is the worker: one request each forms the generation.
  (void)policy.next_group(*a.key, "join", t0);
  const auto formed = policy.next_group(*c.key, "join", t0).formed;
  ASSERT_TRUE(formed);
  EXPECT_EQ(formed->worker_ids, (Ids{"a", "c"}));
  ASSERT_EQ(formed->local_rank_addresses.size(), 2u);
  EXPECT_EQ(to_string(formed->data_addresses[1]), "192.0.2.5:7000");
  ASSERT_EQ(formed->local_rank_addresses[1].size(), 2u);
  EXPECT_EQ(to_string(formed->local_rank_addresses[0][1]), "192.0.2.5:7002");
  EXPECT_EQ(to_string(formed->local_rank_addresses[1][0]), "10.0.0.3:7001");
}

TEST(MembershipPolicy, AWorkerIdIsTakenWhileItsHolderIsLiveAndFreeOnceItLeftWasLostOrRemoved) {
  Roster run(rules(1));
  run.add("a");
  const auto duplicate = run.policy.register_worker(
      {.worker_id = "a", .data_host = "h", .data_port = 1, .from = "198.51.100.7:5000"});
  EXPECT_FALSE(duplicate.key);
  EXPECT_EQ(duplicate.refusal, "worker id 'a' is taken by a live worker (connected from test)");
  (void)run.leave("a");  // its connection is still open, but it is no longer live
  const WorkerKey returning = run.add("a");
  EXPECT_NE(returning, 0u);
  (void)run.lose("a");
  EXPECT_NE(run.add("a"), returning);  // a new registration, a new key
}

TEST(MembershipPolicy, ASecondRequestWhileOneIsPendingOrAnyAfterLeaveIsAProtocolViolation) {
  Roster run(rules(2));
  run.add("a");
  run.add("b");
  (void)run.ask("a");
  EXPECT_THROW((void)run.ask("a"), ProtocolError);  // a duplicate join
  EXPECT_THROW((void)run.boundary("a", 1), ProtocolError);
  EXPECT_EQ(run.policy.waiting(), 1u);  // unchanged
  ASSERT_TRUE(run.ask("b").formed);
  (void)run.ask("a");  // a member asks: its next_group is pending again
  EXPECT_THROW((void)run.boundary("a", 1), ProtocolError);
  (void)run.leave("b");
  EXPECT_THROW((void)run.ask("b"), ProtocolError);
  EXPECT_THROW((void)run.leave("b"), ProtocolError);
}

TEST(MembershipPolicy, ALostMemberIsLeftOutAndTheSurvivorsKeepTheirRankOrder) {
  Roster run(rules(4, 2));
  ASSERT_TRUE(run.join({"a", "b", "c", "d"}).formed);
  (void)run.lose("b");
  // The survivors ask in any order; their ranks follow generation 1's.
  EXPECT_FALSE(run.ask("d").formed);
  EXPECT_FALSE(run.ask("a").formed);
  const auto decisions = run.ask("c");
  ASSERT_TRUE(decisions.formed);
  EXPECT_EQ(decisions.formed->number, 2u);
  EXPECT_EQ(decisions.formed->worker_ids, (Ids{"a", "c", "d"}));
  EXPECT_EQ(decisions.formed->lost, (Ids{"b"}));
  EXPECT_TRUE(decisions.formed->joined.empty());
  EXPECT_FALSE(run.policy.deadline());  // the regroup is over
}

TEST(MembershipPolicy, AdmittedJoinersFollowTheSurvivorsInArrivalOrder) {
  Roster run(rules(2));
  ASSERT_TRUE(run.join({"a", "b"}).formed);
  run.add("e");
  run.add("d");
  (void)run.ask("e");
  (void)run.ask("d");
  EXPECT_TRUE(answers_regroup(run.boundary("b", 1)));
  EXPECT_TRUE(answers_regroup(run.boundary("a", 1)));
  (void)run.ask("b");
  const auto decisions = run.ask("a");
  ASSERT_TRUE(decisions.formed);
  EXPECT_EQ(decisions.formed->worker_ids, (Ids{"a", "b", "e", "d"}));
  EXPECT_EQ(decisions.formed->joined, (Ids{"e", "d"}));
  EXPECT_TRUE(decisions.formed->lost.empty());
  EXPECT_EQ(run.standing("e"), Standing::member);
}

TEST(MembershipPolicy, AJoinerThatLeavesIsNotAdmitted) {
  Roster run(rules(2));
  ASSERT_TRUE(run.join({"a", "b"}).formed);
  for (const char* id : {"c", "d"}) {
    run.add(id);
    (void)run.ask(id);
  }
  (void)run.leave("c");
  EXPECT_EQ(run.policy.waiting(), 1u);
  EXPECT_TRUE(answers_regroup(run.boundary("a", 1)));
  (void)run.ask("a");
  const auto decisions = run.ask("b");
  ASSERT_TRUE(decisions.formed);
  EXPECT_EQ(decisions.formed->worker_ids, (Ids{"a", "b", "d"}));
  EXPECT_EQ(decisions.formed->joined, (Ids{"d"}));
}

TEST(MembershipPolicy, TheBoundaryAnswerIsDecidedOnceAndEveryMemberGetsIt) {
  Roster run(rules(2));
  ASSERT_TRUE(run.join({"a", "b"}).formed);
  EXPECT_FALSE(answers_regroup(run.boundary("a", 1)));  // nobody waits
  run.add("c");
  (void)run.ask("c");
  EXPECT_FALSE(answers_regroup(run.boundary("b", 1)));  // decided before `c` came
  EXPECT_FALSE(run.policy.deadline());
  const auto admit = run.boundary("b", 2, t0 + 3s);
  EXPECT_TRUE(answers_regroup(admit));
  EXPECT_TRUE(has_note(admit, Note::Level::info,
                       "admitting 1 waiting worker at the boundary before window 2"));
  EXPECT_EQ(run.policy.deadline(), t0 + 3s + 10s);  // the regroup started
  EXPECT_TRUE(answers_regroup(run.boundary("a", 2)));
}

TEST(MembershipPolicy, WhileARegroupIsPendingEveryBoundaryAnswerIsRegroup) {
  Roster run(rules(3));
  ASSERT_TRUE(run.join({"a", "b", "c"}).formed);
  EXPECT_FALSE(answers_regroup(run.boundary("b", 4)));
  (void)run.ask("a");                                  // its collective failed
  EXPECT_TRUE(answers_regroup(run.boundary("b", 4)));  // even a window decided "no" before
  EXPECT_TRUE(answers_regroup(run.boundary("c", 5)));
}

TEST(MembershipPolicy, JoinEveryThreeWindowsAdmitsOnlyAtMultiplesOfThree) {
  auto every_three = rules(2);
  every_three.join_every_windows = 3;
  Roster run(every_three);
  ASSERT_TRUE(run.join({"a", "b"}).formed);
  run.add("c");
  (void)run.ask("c");
  for (const std::uint64_t window : {1, 2}) {
    EXPECT_FALSE(answers_regroup(run.boundary("a", window))) << "window " << window;
    EXPECT_FALSE(answers_regroup(run.boundary("b", window))) << "window " << window;
  }
  EXPECT_TRUE(answers_regroup(run.boundary("b", 3)));
  EXPECT_TRUE(answers_regroup(run.boundary("a", 3)));
  (void)run.ask("a");
  ASSERT_TRUE(run.ask("b").formed);
  run.add("d");
  (void)run.ask("d");
  for (const std::uint64_t window : {4, 5})
    EXPECT_FALSE(answers_regroup(run.boundary("c", window))) << "window " << window;
  EXPECT_TRUE(answers_regroup(run.boundary("c", 6)));
}

TEST(MembershipPolicy, AFullGroupAdmitsJoinersOnlyWhenAPlaceFreesUp) {
  Roster run(rules(2, 1, 3));
  ASSERT_TRUE(run.join({"a", "b"}).formed);
  for (const char* id : {"c", "d"}) {
    run.add(id);
    (void)run.ask(id);
  }
  // One place left: only the first joiner is admitted; the other keeps waiting.
  const auto admit = run.boundary("a", 1);
  EXPECT_TRUE(answers_regroup(admit));
  EXPECT_TRUE(has_note(admit, Note::Level::info, "admitting 1 waiting worker"));
  (void)run.ask("a");
  const auto third = run.ask("b");
  ASSERT_TRUE(third.formed);
  EXPECT_EQ(third.formed->worker_ids, (Ids{"a", "b", "c"}));
  EXPECT_EQ(run.standing("d"), Standing::waiting);
  EXPECT_EQ(run.policy.waiting(), 1u);
  EXPECT_FALSE(answers_regroup(run.boundary("c", 1)));  // full
  // A member dies: at the regroup after the failure, `d` takes its place.
  (void)run.lose("b");
  (void)run.ask("a");
  const auto fourth = run.ask("c");
  ASSERT_TRUE(fourth.formed);
  EXPECT_EQ(fourth.formed->worker_ids, (Ids{"a", "c", "d"}));
  EXPECT_EQ(fourth.formed->joined, (Ids{"d"}));
  EXPECT_EQ(fourth.formed->lost, (Ids{"b"}));
}

TEST(MembershipPolicy, AMemberSilentUntilTheDeadlineIsRemovedAndToldSoIfItSpeaksAgain) {
  Roster run(rules(3, 2));
  ASSERT_TRUE(run.join({"a", "b", "s"}).formed);
  EXPECT_FALSE(run.ask("a", t0).formed);
  EXPECT_FALSE(run.ask("b", t0 + 4s).formed);
  EXPECT_EQ(run.policy.deadline(), t0 + 10s);  // from the trigger, not the last request
  EXPECT_FALSE(run.policy.tick(t0 + 10s - 1ns).formed);
  const auto decisions = run.policy.tick(t0 + 10s);
  ASSERT_TRUE(decisions.formed);
  EXPECT_EQ(decisions.formed->worker_ids, (Ids{"a", "b"}));
  EXPECT_EQ(decisions.formed->lost, (Ids{"s"}));
  EXPECT_TRUE(has_note(decisions, Note::Level::warn,
                       "worker s removed from the group at generation 1: it did not ask for a "
                       "new group within the regroup timeout (10000 ms)"));
  EXPECT_EQ(run.standing("s"), Standing::removed);
  EXPECT_FALSE(run.policy.deadline());
  const auto late = run.ask("s");
  EXPECT_NE(error_to(late, run.keys["s"]).find("removed from the group at generation 1"),
            std::string::npos);
  EXPECT_FALSE(late.formed);
  EXPECT_NE(error_to(run.boundary("s", 9), run.keys["s"]), "");
  // It may register again under its id, as a new worker.
  run.add("s");
  EXPECT_EQ(run.ask("s").errors.size(), 0u);
  EXPECT_EQ(run.standing("s"), Standing::waiting);
}

TEST(MembershipPolicy, ARegroupThatCompletesEarlyLeavesNoDeadline) {
  Roster run(rules(2));
  ASSERT_TRUE(run.join({"a", "b"}).formed);
  (void)run.ask("a", t0);
  EXPECT_TRUE(run.ask("b", t0 + 1s).formed);
  EXPECT_FALSE(run.policy.deadline());
  const auto later = run.policy.tick(t0 + 1h);
  EXPECT_FALSE(later.formed);
  EXPECT_TRUE(later.notes.empty());
  EXPECT_EQ(run.policy.generation(), 2u);
}

TEST(MembershipPolicy, AMemberLostOrLeavingDuringARegroupIsNotWaitedFor) {
  Roster run(rules(4, 2));
  ASSERT_TRUE(run.join({"a", "b", "c", "d"}).formed);
  (void)run.ask("a");
  EXPECT_FALSE(run.lose("c").formed);
  EXPECT_FALSE(run.leave("d").formed);
  const auto decisions = run.ask("b");
  ASSERT_TRUE(decisions.formed);
  EXPECT_EQ(decisions.formed->worker_ids, (Ids{"a", "b"}));
  EXPECT_EQ(decisions.formed->lost, (Ids{"c", "d"}));
}

TEST(MembershipPolicy, FallingBelowTheMinimumStopsTheRunAndTellsEveryWaitingWorker) {
  Roster run(rules(3, 3));
  ASSERT_TRUE(run.join({"a", "b", "c"}).formed);
  run.add("j");
  (void)run.ask("j");  // a joiner counts toward the minimum, but one is not enough
  (void)run.lose("b");
  (void)run.lose("c");
  const auto decisions = run.ask("a");
  const std::string reason = "the group fell to 2 workers, below the minimum 3";
  ASSERT_TRUE(decisions.ended);
  EXPECT_EQ(decisions.ended->stop_reason, reason);
  EXPECT_EQ(error_to(decisions, run.keys["a"]), reason);
  EXPECT_EQ(error_to(decisions, run.keys["j"]), reason);
  EXPECT_TRUE(has_note(decisions, Note::Level::error, "the run stops: " + reason));
  EXPECT_EQ(run.policy.phase(), RunPhase::stopped);
  // Every later request, and a new worker's, gets the reason.
  EXPECT_EQ(error_to(run.ask("a"), run.keys["a"]), reason);
  EXPECT_EQ(error_to(run.boundary("a", 3), run.keys["a"]), reason);
  run.add("late");
  EXPECT_EQ(error_to(run.ask("late"), run.keys["late"]), reason);
}

TEST(MembershipPolicy, JoinersCountTowardTheMinimum) {
  Roster run(rules(2, 2));
  ASSERT_TRUE(run.join({"a", "b"}).formed);
  run.add("j");
  (void)run.ask("j");
  (void)run.lose("b");
  const auto decisions = run.ask("a");
  ASSERT_TRUE(decisions.formed);
  EXPECT_EQ(decisions.formed->worker_ids, (Ids{"a", "j"}));
  EXPECT_FALSE(decisions.ended);
}

TEST(MembershipPolicy, EveryMemberLeavingFinishesTheRunAndTurnsAwayJoiners) {
  Roster run(rules(2));
  ASSERT_TRUE(run.join({"a", "b"}).formed);
  run.add("c");
  (void)run.ask("c");
  EXPECT_FALSE(run.leave("a").ended);
  const auto decisions = run.leave("b");
  ASSERT_TRUE(decisions.ended);
  EXPECT_FALSE(decisions.ended->stop_reason);  // finished, not stopped
  EXPECT_EQ(error_to(decisions, run.keys["c"]), "the run has finished");
  EXPECT_EQ(run.policy.phase(), RunPhase::finished);
  EXPECT_EQ(run.policy.waiting(), 0u);
  EXPECT_EQ(error_to(run.ask("c"), run.keys["c"]), "the run has finished");
}

TEST(MembershipPolicy, EveryMemberLostStopsTheRun) {
  Roster run(rules(2));
  ASSERT_TRUE(run.join({"a", "b"}).formed);
  EXPECT_FALSE(run.lose("a").ended);
  const auto decisions = run.lose("b");
  ASSERT_TRUE(decisions.ended);
  EXPECT_EQ(decisions.ended->stop_reason, "every worker of generation 1 was lost");
}

TEST(MembershipPolicy, ARegroupNobodyAskedForEndsTheRun) {
  // Triggered by a boundary decision, after which every member left or was lost: a group of
  // joiners alone would have no state to start from.
  Roster left(rules(2));
  ASSERT_TRUE(left.join({"a", "b"}).formed);
  left.add("j");
  (void)left.ask("j");
  EXPECT_TRUE(answers_regroup(left.boundary("a", 1)));
  (void)left.leave("a");
  const auto finished = left.lose("b");
  ASSERT_TRUE(finished.ended);
  EXPECT_FALSE(finished.ended->stop_reason);
  EXPECT_EQ(error_to(finished, left.keys["j"]), "the run has finished");

  Roster lost(rules(2));
  ASSERT_TRUE(lost.join({"a", "b"}).formed);
  lost.add("j");
  (void)lost.ask("j");
  EXPECT_TRUE(answers_regroup(lost.boundary("a", 1)));
  (void)lost.lose("a");
  const auto stopped = lost.policy.tick(t0 + 10s);  // `b` stalls until the deadline
  ASSERT_TRUE(stopped.ended);
  EXPECT_EQ(stopped.ended->stop_reason, "no member of generation 1 asked for a new group");
}

TEST(MembershipPolicy, ABoundaryFromANonMemberIsRefused) {
  Roster run(rules(2));
  run.add("a");
  const auto decisions = run.boundary("a", 1);
  EXPECT_EQ(error_to(decisions, run.keys["a"]),
            "worker a is not a member of generation 0; call next_group first");
  EXPECT_TRUE(decisions.boundary_replies.empty());
}

TEST(MembershipPolicy, DepartedWorkersAreForgottenOnceNoGenerationNamesThem) {
  Roster run(rules(3, 2));
  run.add("idle");
  ASSERT_TRUE(run.join({"a", "b", "c"}).formed);
  EXPECT_EQ(run.policy.known_workers(), 4u);
  (void)run.lose("idle");
  EXPECT_FALSE(run.policy.standing(run.keys["idle"]));
  (void)run.lose("c");  // a member: the next generation's `lost` names it
  EXPECT_EQ(run.policy.standing(run.keys["c"]), Standing::lost);
  (void)run.ask("a");
  ASSERT_TRUE(run.ask("b").formed);
  EXPECT_FALSE(run.policy.standing(run.keys["c"]));
  EXPECT_EQ(run.policy.known_workers(), 2u);
}

}  // namespace
}  // namespace pulseloco::elastic
