// The per-window report's byte counts agree with what the transport moved and with the other
// ranks' reports, over the in-process and the TCP transport, in every mode; a peer that joins the
// exchange late shows as waiting, not transfer, and is named while it is awaited.
#include <gtest/gtest.h>

#include <chrono>
#include <stdexcept>

#include <pulseloco/engine/engine.h>
#include "base/log_capture.h"
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

class ReportWait : public ::testing::TestWithParam<Mode> {};

// Rank 0 enters its window only once rank 1 has logged that it waits for rank 0's header, which
// it does after a whole progress interval (PULSELOCO_WAIT_LOG_SECONDS) in its exchange: rank 1's
// exchange_wait is at least that interval. Every rank's exchange is its wait plus its transfer.
TEST_P(ReportWait, APeerThatJoinsLateIsWaitNotTransferAndIsNamed) {
  const Mode mode = GetParam();
  const testing::ScopedVariable interval("PULSELOCO_WAIT_LOG_SECONDS", "0.2");
  const int world = 2;
  std::vector<testing::LocalModel> models;
  for (int r = 0; r < world; ++r)
    models.push_back(testing::make_model({4096, 17}, DType::float32, 7));
  EngineOptions options = testing::small_options(mode);
  options.steps_per_window = 1;
  auto engines = testing::start_engines(models, options);
  std::vector<std::vector<std::vector<float>>> gradients(world);
  for (int r = 0; r < world; ++r) {
    for (const auto& t : models[static_cast<std::size_t>(r)])
      gradients[static_cast<std::size_t>(r)].emplace_back(t.numel(), 0.25f);
  }
  std::vector<WindowReport> reports(world);
  const testing::LogCapture log(spdlog::level::warn);
  testing::rethrow_first(testing::run_ranks(world, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    if (r == 0 && !log.wait_for("no header yet from rank 0", std::chrono::seconds(120))) {
      throw std::runtime_error("rank 1 never said that it waits for rank 0");
    }
    if (mode == Mode::ddp) {
      std::vector<TensorView> views;
      for (auto& g : gradients[i])
        views.push_back({g.data(), g.size(), DType::float32, Device{}});
      engines[i]->average_gradients(views);
      reports[i] = engines[i]->after_optimizer_step().value();
    } else {
      reports[i] = engines[i]->run_window();
    }
  }));
  EXPECT_NE(log.text().find("now for rank 0"), std::string::npos) << log.text();
  EXPECT_GE(reports[1].seconds.exchange_wait, 0.2);
  for (int r = 0; r < world; ++r) {
    const PhaseSeconds& s = reports[static_cast<std::size_t>(r)].seconds;
    EXPECT_GE(s.exchange_wait, 0.0) << "rank " << r;
    EXPECT_GE(s.exchange_transfer, 0.0) << "rank " << r;
    EXPECT_NEAR(s.exchange_wait + s.exchange_transfer, s.exchange, 1e-9) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, ReportWait, ::testing::Values(Mode::pulse, Mode::diloco, Mode::ddp),
                         [](const ::testing::TestParamInfo<Mode>& param_info) {
                           return std::string(mode_name(param_info.param));
                         });

}  // namespace
}  // namespace pulseloco
