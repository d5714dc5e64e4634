// The public API of pulseloco. `#include <pulseloco/pulseloco.h>` and link pulseloco::pulseloco.
//
//   pulseloco::Engine        the window engine over raw fp32/bf16 buffers (engine/engine.h)
//   pulseloco::EngineOptions its options (engine/options.h); WindowReport (engine/report.h)
//   pulseloco::group::make_transport / from_environment: TCP, MPI or NCCL groups
//     (group/make_transport.h; MPI and NCCL need pulseloco::transport_mpi / _nccl linked)
//   pulseloco::ElasticEngine: an Engine whose group may lose and gain workers
//     (elastic/elastic_engine.h; the coordinator is elastic/coordinator.h)
//   pulseloco::replay_window: offline replay of a traced window (engine/replay.h)
// The libtorch adapter is in <pulseloco/torch.h>.
#pragma once

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/digest.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/base/tensor_view.h>
#include <pulseloco/build_config.h>
#include <pulseloco/elastic/coordinator.h>
#include <pulseloco/elastic/elastic_engine.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/engine/options.h>
#include <pulseloco/engine/replay.h>
#include <pulseloco/engine/report.h>
#include <pulseloco/group/make_transport.h>
