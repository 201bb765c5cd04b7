// The emulated device's stand-in for the CUDA runtime header (see emulated_cuda.h).
#pragma once

#include "emulated_cuda.h"
