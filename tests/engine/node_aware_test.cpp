// Node-aware exchanges (EngineOptions::node_aware): which groups gain from them, and the
// window's bits: over nodes of equal and unequal sizes, contiguous or not, every exchange kind
// gives the flat group's digests while each rank's messages enter each other node once.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <string>
#include <vector>

#include <pulseloco/engine/node_layout.h>
#include <pulseloco/transport/forwarding.h>
#include "collectives/test_groups.h"
#include "engine/engine_test_util.h"

namespace pulseloco {
namespace {

using engine_detail::node_count;
using engine_detail::node_name;
using engine_detail::spans_shared_nodes;

TEST(NodeLayout, OnlyGroupsOfSeveralNodesWithSomeSharedNodeGain) {
  EXPECT_FALSE(spans_shared_nodes({{0, 0, 0, 0}}));  // one node
  EXPECT_FALSE(spans_shared_nodes({{0, 1, 2, 3}}));  // one rank per node
  EXPECT_TRUE(spans_shared_nodes({{0, 0, 2, 2}}));
  EXPECT_TRUE(spans_shared_nodes({{0, 1, 0, 3}}));  // unequal, not contiguous
  EXPECT_EQ(node_count({{0, 1, 0, 3}}), 3);
  EXPECT_EQ(node_name("rack-7"), "rack-7");
  EXPECT_FALSE(node_name("").empty());  // PULSELOCO_NODE, else the host name
}

// Counts the bytes each rank receives from ranks of other nodes (every tag: payload, headers,
// notices), as a node's link to the others would carry them.
class RemoteBytes : public transport::ForwardingTransport {
 public:
  RemoteBytes(std::unique_ptr<transport::Transport> inner, std::vector<int> nodes,
              std::atomic<std::uint64_t>& into_node)
      : ForwardingTransport(std::move(inner)), nodes_(std::move(nodes)), into_node_(into_node) {}
  [[nodiscard]] std::unique_ptr<transport::Request> irecv(int peer, transport::Tag tag,
                                                          std::span<std::byte> data) override {
    if (nodes_[static_cast<std::size_t>(peer)] != nodes_[static_cast<std::size_t>(rank())])
      into_node_ += data.size();
    return ForwardingTransport::irecv(peer, tag, data);
  }

 private:
  std::vector<int> nodes_;
  std::atomic<std::uint64_t>& into_node_;
};

struct NodesRun {
  std::vector<std::vector<Digest>> digests;  // per window, per rank
  std::vector<std::string> kinds;            // per window (rank 0)
  std::uint64_t remote_bytes = 0;            // into every node from the others, all windows
};

// `windows` blocking windows over `nodes` (rank r on node nodes[r]), every rank training on its
// own data, so the ranks' sets overlap partly.
NodesRun run_over_nodes(const std::vector<int>& nodes, DType dtype, Exchange exchange,
                        bool node_aware, int windows) {
  const int world = static_cast<int>(nodes.size());
  std::vector<testing::LocalModel> models;
  for (int r = 0; r < world; ++r)
    models.push_back(testing::make_model({5000, 1500, 700}, dtype, 40));
  EngineOptions options = testing::small_options();
  options.exchange = exchange;
  options.node_aware = node_aware;
  options.threads = 1;
  std::atomic<std::uint64_t> remote{0};
  auto inner = testing::make_test_group("inproc", world);
  std::vector<std::unique_ptr<Engine>> engines(static_cast<std::size_t>(world));
  testing::rethrow_first(testing::run_ranks(world, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    engines[i] = std::make_unique<Engine>(testing::views_of(models[i]), options);
    engines[i]->attach(std::make_unique<RemoteBytes>(std::move(inner[i]), nodes, remote),
                       GroupInfo{.node = "node-" + std::to_string(nodes[i])});
  }));
  remote = 0;  // the windows only, not the join
  NodesRun run;
  for (int w = 0; w < windows; ++w) {
    for (int r = 0; r < world; ++r) {
      testing::local_training(models[static_cast<std::size_t>(r)], 4e-3f, 2,
                              static_cast<std::uint32_t>(700 + 10 * w + r % 3));
    }
    std::vector<WindowReport> reports(static_cast<std::size_t>(world));
    testing::rethrow_first(testing::run_ranks(world, [&](int r) {
      reports[static_cast<std::size_t>(r)] = engines[static_cast<std::size_t>(r)]->run_window();
    }));
    run.digests.emplace_back();
    for (const WindowReport& report : reports) {
      run.digests.back().push_back(report.digest);
      EXPECT_TRUE(report.replicas_identical);
    }
    run.kinds.push_back(reports[0].exchange);
  }
  run.remote_bytes = remote;
  return run;
}

using NodesParam = std::tuple<std::vector<int>, DType, Exchange>;

class NodeAwareExchange : public ::testing::TestWithParam<NodesParam> {};

TEST_P(NodeAwareExchange, GivesTheFlatGroupsDigestsAndLessTrafficBetweenNodes) {
  const auto& [nodes, dtype, exchange] = GetParam();
  const int windows = 3;
  const NodesRun flat = run_over_nodes(nodes, dtype, exchange, false, windows);
  const NodesRun aware = run_over_nodes(nodes, dtype, exchange, true, windows);
  EXPECT_EQ(aware.digests, flat.digests);
  EXPECT_EQ(aware.kinds, flat.kinds);
  // Each message (or reduced range) enters each other node once instead of once per rank
  // there: with 2 to 4 ranks on a node, well under the flat group's bytes. The reduction's
  // all-to-all sends each owner its piece either way; only its all-gather of ranges gains.
  if (exchange == Exchange::allgather) {
    EXPECT_LT(aware.remote_bytes * 4, flat.remote_bytes * 3)
        << "node-aware " << aware.remote_bytes << " B, flat " << flat.remote_bytes << " B";
  } else {
    EXPECT_LT(aware.remote_bytes, flat.remote_bytes)
        << "node-aware " << aware.remote_bytes << " B, flat " << flat.remote_bytes << " B";
  }
}

std::string layout_name(const std::vector<int>& nodes) {
  std::string name;
  for (const int node : nodes)
    name += std::to_string(node);
  return name;
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, NodeAwareExchange,
    ::testing::Combine(::testing::Values(std::vector<int>{0, 0, 1, 1},
                                         std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1},
                                         std::vector<int>{0, 1, 0, 2, 1, 0}),  // unequal
                       ::testing::Values(DType::float32, DType::bfloat16),
                       ::testing::Values(Exchange::allgather, Exchange::reduction)),
    [](const ::testing::TestParamInfo<NodesParam>& param) {
      return "nodes_" + layout_name(std::get<0>(param.param)) + "_" +
             (std::get<1>(param.param) == DType::float32 ? "fp32" : "bf16") + "_" +
             std::string(exchange_name(std::get<2>(param.param)));
    });

}  // namespace
}  // namespace pulseloco
