// public_headers.cpp - libtqkv's public headers seen from C++17 (tests/cxx.cmake).
//
// Compiled with g++ -std=c++17 -Wall -Wextra -Werror: a header that is not valid C++
// fails the build. Every function referenced below must keep C linkage (extern "C"
// guards): tests/cxx/check_headers.cmake fails when the object asks for a C++-mangled
// tqkv symbol, which a C++ program could never link against libtqkv.
#include "kernels/attention.h"
#include "kernels/page.h"
#include "kernels/page_format.h"
#include "kernels/policy.h"
#include "kernels/status.h"
#include "kernels/version.h"
#include "transport/client.h"
#include "transport/client_bulk.h"

#include <cstdio>

int
main()
{
    // One function of each header, by address (nothing is called).
    void (*volatile fns[])() = {
        reinterpret_cast<void (*)()>(&tqkv_client_create),
        reinterpret_cast<void (*)()>(&tqkv_client_get),
        reinterpret_cast<void (*)()>(&tqkv_client_last_error),
        reinterpret_cast<void (*)()>(&tqkv_client_get_nccl),
        reinterpret_cast<void (*)()>(&tqkv_strerror),
        reinterpret_cast<void (*)()>(&tqkv_page_size),
        reinterpret_cast<void (*)()>(&tqkv_page_validate),
        reinterpret_cast<void (*)()>(&tqkv_crc32c),
        reinterpret_cast<void (*)()>(&tqkv_attn_decode),
        reinterpret_cast<void (*)()>(&tqkv_policy_default),
        reinterpret_cast<void (*)()>(&tqkv_version),
    };
    tqkv_client_opts_t o = {};
    tqkv_block_shape_t shape = {16, 1, 128};
    tqkv_page_header_t hdr = {};
    std::printf("%zu %u %zu %d\n", sizeof fns / sizeof fns[0], shape.head_dim, sizeof hdr,
                o.transport == TQKV_CLIENT_TRANSPORT_GRPC);
    return TQKV_OK;
}
