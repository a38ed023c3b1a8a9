// emu_common.cpp - kernels/cuda_common.cu built as host C++ for the SIMT emulator (check_gpu_emu).
#include "kernels/cuda_common.cu"
