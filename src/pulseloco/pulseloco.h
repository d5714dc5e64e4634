// The public API of pulseloco. `#include <pulseloco/pulseloco.h>` and link pulseloco::pulseloco.
//
//   pulseloco::Engine        the window engine over raw fp32/bf16 buffers (engine/engine.h)
//   pulseloco::EngineOptions its options (engine/options.h); WindowReport (engine/report.h)
//   pulseloco::transport::make_transport / from_environment: TCP, MPI or NCCL groups
//   pulseloco::replay_window: offline replay of a traced window (engine/replay.h)
// The libtorch adapter is in <pulseloco/torch.h>.
#pragma once

#include "base/bf16.h"
#include "base/build_config.h"
#include "base/digest.h"
#include "base/errors.h"
#include "base/tensor_view.h"
#include "engine/elastic.h"
#include "engine/engine.h"
#include "engine/options.h"
#include "engine/replay.h"
#include "engine/report.h"
#include "transport/factory.h"
#include "transport/membership.h"
