// The per-window report's byte counts agree with what the transport moved and with the other
// ranks' reports, over the in-process and the TCP transport, in every mode.
#include <gtest/gtest.h>

#include <pulseloco/engine/engine.h>
#include "collectives/test_groups.h"
#include "engine/engine_test_util.h"

namespace pulseloco {
namespace {

class ReportBytes : public ::testing::TestWithParam<std::tuple<std::string, Mode>> {};

TEST_P(ReportBytes, AgreeWithTheTransportAndWithEveryRank) {
  const auto& [backend, mode] = GetParam();
  const int world = 3;
  std::vector<testing::LocalModel> models;
  for (int r = 0; r < world; ++r) {
    models.push_back(testing::make_model({20000, 513}, DType::float32, 400 + r));
  }
  EngineOptions options;
  options.mode = mode;
  options.steps_per_window = 2;
  options.chunk_elements = 4096;
  options.threads = 1;
  options.allgather = collectives::CollectiveAlgorithm::direct;  // each message goes once per peer
  options.exchange = Exchange::allgather;  // every rank receives every other rank's message
  auto transports = testing::make_test_group(backend, world);
  std::vector<std::unique_ptr<Engine>> engines(world);
  // A report covers the end of the previous window (or the engine's construction) to the end
  // of its own, so the transport's counters are read at those points too: not when a window
  // starts, since a peer that starts earlier may already have sent this rank the first part
  // of its exchange (the all-reduce sends along with its header).
  std::vector<transport::TransportStats> previous(world);
  testing::rethrow_first(testing::run_ranks(world, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    engines[i] =
        std::make_unique<Engine>(testing::views_of(models[i]), options, std::move(transports[i]));
    previous[i] = engines[i]->transport().stats();
  }));

  // Mode ddp: every rank's gradients, averaged at every step.
  std::vector<std::vector<std::vector<float>>> gradients(world);
  for (int r = 0; r < world; ++r) {
    for (const auto& t : models[static_cast<std::size_t>(r)])
      gradients[static_cast<std::size_t>(r)].emplace_back(t.numel(), 0.25f * (r + 1));
  }

  for (int window = 0; window < 2; ++window) {
    // (Mode ddp keeps the replicas identical: no step of one rank alone.)
    for (int r = 0; r < world && mode != Mode::ddp; ++r) {
      testing::local_training(models[static_cast<std::size_t>(r)], 5e-5f, 2, 900 + 10 * window + r);
    }
    std::vector<WindowReport> reports(world);
    const std::vector<transport::TransportStats> before = previous;
    std::vector<transport::TransportStats> after(world);
    testing::rethrow_first(testing::run_ranks(world, [&](int r) {
      const auto i = static_cast<std::size_t>(r);
      for (std::uint32_t step = 0; mode == Mode::ddp && step < options.steps_per_window; ++step) {
        std::vector<TensorView> views;
        for (auto& g : gradients[i])
          views.push_back({g.data(), g.size(), DType::float32, Device{}});
        engines[i]->average_gradients(views);
      }
      reports[i] = engines[i]->run_window();
      after[i] = engines[i]->transport().stats();
    }));
    previous = after;
    std::uint64_t all_payloads = 0;
    for (const auto& report : reports)
      all_payloads += report.payload_bytes;
    for (int r = 0; r < world; ++r) {
      const auto i = static_cast<std::size_t>(r);
      const WindowReport& report = reports[i];
      // The report's wire counts are the transport's counters from the end of the previous
      // window to the end of this one. Sends are counted exactly. Receipts are counted as the
      // I/O thread reads them, so a peer's last small control message of a window (its commit
      // vote or digest) may land just after this rank's end-of-window snapshot and be counted
      // in the next window's report: allow one such frame either way. (The windows here start
      // only once every rank has finished the previous one, so no peer's next exchange can
      // land early.)
      EXPECT_EQ(report.wire_bytes_sent, after[i].wire_bytes_sent - before[i].wire_bytes_sent);
      EXPECT_NEAR(static_cast<double>(report.wire_bytes_received),
                  static_cast<double>(after[i].wire_bytes_received - before[i].wire_bytes_received),
                  1024.0)
          << "rank " << r;
      // The direct all-gather hands the payload to the transport once per peer; everything
      // else the window sends (sizes, commit vote, digests, framing) is small.
      const std::uint64_t payload_sent = after[i].payload_bytes_sent - before[i].payload_bytes_sent;
      const std::uint64_t payload_received =
          after[i].payload_bytes_received - before[i].payload_bytes_received;
      if (mode == Mode::pulse) {
        // What this rank received is exactly what the others contributed.
        EXPECT_EQ(report.received_bytes, all_payloads - report.payload_bytes) << "rank " << r;
        EXPECT_GE(payload_sent, (world - 1) * report.payload_bytes) << "rank " << r;
        EXPECT_LE(payload_sent, (world - 1) * report.payload_bytes + 4096) << "rank " << r;
      } else {
        // The all-reduce: each rank sends and receives 2 (R-1)/R of the dense payload (diloco:
        // the pseudo-gradient; ddp: every step's gradients), not x of it.
        const auto dense = static_cast<double>(report.payload_bytes);
        const double expected = 2.0 * (world - 1) / world * dense;
        EXPECT_NEAR(static_cast<double>(payload_sent), expected, 0.01 * dense + 4096)
            << "rank " << r;
        EXPECT_NEAR(static_cast<double>(report.received_bytes), expected, 0.01 * dense + 4096)
            << "rank " << r;
      }
      // The report counts the exchange's receipts; the rest of the window (commit vote,
      // digests) received little.
      EXPECT_GE(payload_received, report.received_bytes) << "rank " << r;
      EXPECT_LE(payload_received, report.received_bytes + 4096) << "rank " << r;
      EXPECT_GE(report.wire_bytes_sent, payload_sent);
      EXPECT_LE(report.wire_bytes_sent, payload_sent + payload_sent / 10 + 16384);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Backends, ReportBytes,
    ::testing::Combine(::testing::ValuesIn(testing::test_backends()),
                       ::testing::Values(Mode::pulse, Mode::diloco, Mode::ddp)),
    [](const ::testing::TestParamInfo<std::tuple<std::string, Mode>>& param_info) {
      return std::get<0>(param_info.param) + "_" +
             std::string(mode_name(std::get<1>(param_info.param)));
    });

}  // namespace
}  // namespace pulseloco
