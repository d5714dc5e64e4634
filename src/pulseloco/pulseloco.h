// The public API of pulseloco. `#include <pulseloco/pulseloco.h>` and link pulseloco::pulseloco.
#pragma once

#include "base/bf16.h"
#include "base/build_config.h"
#include "base/digest.h"
#include "base/errors.h"
#include "base/tensor_view.h"
