// The one place that decides where CUDA driver declarations come from: the
// toolkit's cuda.h when the build found it (CXL_HAVE_CUDA_H), else our
// cuda_min.h.  Nothing here declares functions; see driver.h.
#pragma once

#ifdef CXL_HAVE_CUDA_H
#include <cuda.h>
#else
#include "driver/cuda_min.h"
#endif
