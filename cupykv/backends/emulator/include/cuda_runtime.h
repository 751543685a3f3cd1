// cuda_runtime.h (cupykv emulator shim): everything a kernel needs already comes from
// the force-included cuemu.h; this file only lets `#include <cuda_runtime.h>` resolve.
#pragma once
#include "cuemu.h"
