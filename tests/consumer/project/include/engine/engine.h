// The consumer's own header, named like one of pulseloco's internal paths (see base/errors.h).
#pragma once

namespace consumer {
struct Engine {
  int cylinders = 8;
};
}  // namespace consumer
