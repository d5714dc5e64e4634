// The consumer's own header, named like one of pulseloco's internal paths: pulseloco's installed
// headers must never pick it up (they include <pulseloco/base/errors.h>).
#pragma once

namespace consumer {
inline constexpr int kOwnErrorsHeader = 1;
}
