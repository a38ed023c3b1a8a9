// public_headers.cpp - libtqkv's public (installed) headers seen from C++17 (tests/cxx.cmake).
//
// Compiled with g++ -std=c++17 -Wall -Wextra -Werror: a header that is not valid C++
// fails the build. Every function referenced below must keep C linkage (extern "C"
// guards): tests/cxx/check_headers.cmake fails when the object asks for a C++-mangled
// tqkv symbol, which a C++ program could never link against libtqkv. The headers are
// the five docs/api.md lists (tests/install/run.sh checks that exactly they are
// installed); TQKV_CLIENT_OPTS_INIT is used as a C++ program uses it.
#include "kernels/block_shape.h"
#include "kernels/status.h"
#include "kernels/version.h"
#include "transport/client.h"
#include "transport/client_bulk.h"

#include <cstdio>

int
main()
{
    // One function of each header, and of each part of client.h, by address (nothing
    // is called).
    void (*volatile fns[])() = {
        reinterpret_cast<void (*)()>(&tqkv_client_create),
        reinterpret_cast<void (*)()>(&tqkv_client_get),
        reinterpret_cast<void (*)()>(&tqkv_client_last_error),
        reinterpret_cast<void (*)()>(&tqkv_client_get_nccl),
        reinterpret_cast<void (*)()>(&tqkv_client_decode_page),
        reinterpret_cast<void (*)()>(&tqkv_client_attend),
        reinterpret_cast<void (*)()>(&tqkv_client_repair_stats),
        reinterpret_cast<void (*)()>(&tqkv_client_put_many),
        reinterpret_cast<void (*)()>(&tqkv_client_get_into),
        reinterpret_cast<void (*)()>(&tqkv_strerror),
        reinterpret_cast<void (*)()>(&tqkv_version),
    };
    tqkv_client_opts_t o = TQKV_CLIENT_OPTS_INIT;
    tqkv_block_shape_t shape = {16, 1, 128};
    tqkv_client_stats_t st = {};
    static_assert(sizeof st.tiers / sizeof st.tiers[0] == TQKV_CLIENT_TIER_COUNT,
                  "tiers sized by the count");
    std::printf("%zu %u %zu %d\n", sizeof fns / sizeof fns[0], shape.head_dim, o.struct_size,
                o.transport == TQKV_CLIENT_TRANSPORT_GRPC);
    return o.struct_size == sizeof o ? TQKV_OK : TQKV_EINTERNAL;
}
