// The public API of pulseloco. `#include <pulseloco/pulseloco.h>` and link pulseloco::pulseloco.
//
//   pulseloco::Engine        the window engine over raw fp32/bf16 buffers (engine/engine.h)
//   pulseloco::EngineOptions its options (engine/options.h); WindowReport (engine/report.h)
//   pulseloco::transport::make_transport / from_environment: TCP, MPI or NCCL groups
//   pulseloco::replay_window: offline replay of a traced window (engine/replay.h)
// The libtorch adapter is in <pulseloco/torch.h>.
#pragma once

#include <pulseloco/base/bf16.h>
#include <pulseloco/build_config.h>
#include <pulseloco/base/digest.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/base/tensor_view.h>
#include <pulseloco/engine/elastic.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/engine/options.h>
#include <pulseloco/engine/replay.h>
#include <pulseloco/engine/report.h>
#include <pulseloco/transport/factory.h>
#include <pulseloco/transport/membership.h>
