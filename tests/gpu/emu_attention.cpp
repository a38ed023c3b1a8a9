// emu_attention.cpp - kernels/attention.cu built as host C++ for the SIMT emulator (check_gpu_emu).
#include "kernels/attention.cu"
