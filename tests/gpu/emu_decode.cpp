// emu_decode.cpp - kernels/decode.cu built as host C++ for the SIMT emulator (check_gpu_emu).
#include "kernels/decode.cu"
