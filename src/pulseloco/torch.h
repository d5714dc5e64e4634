// The libtorch adapter: `#include <pulseloco/torch.h>` (needs a build with libtorch).
#pragma once

#include <pulseloco/pulseloco.h>
#include <pulseloco/adapters/torch/synchronizer.h>
