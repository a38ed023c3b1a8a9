// emu_encode.cpp - kernels/encode.cu built as host C++ for the SIMT emulator (check_gpu_emu).
#include "kernels/encode.cu"
