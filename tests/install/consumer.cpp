// consumer.cpp - a C++17 program built against the INSTALLED libtqkv with nothing but
// `pkg-config --cflags --libs tqkv` (tests/install/run.sh): Put a grid of BF16 blocks
// (4 hashes x 2 layers) with tqkv_client_put_many, Lookup with a lease, Get it PACKED
// decoded straight into scattered destinations with tqkv_client_get_into, Get it BF16
// the same way (the server's decode of the same pages) and compare exactly; a missing
// block reads found = 0. Usage: consumer_cpp HOST:PORT.
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <tqkv/client.h> // plain includes: the public headers carry extern "C" guards
#include <tqkv/client_bulk.h>
#include <tqkv/kernels/version.h>

namespace
{

constexpr uint32_t kT = 16, kH = 8, kD = 128, kN = kT * kH * kD;
constexpr size_t kHashes = 4, kLayers = 2;

int
fail(const std::string &what, tqkv_status_t st)
{
    std::fprintf(stderr, "consumer.cpp: %s: %s (%s)\n", what.c_str(), tqkv_strerror(st),
                 tqkv_client_last_error()->message);
    return 1;
}

} // namespace

int
main(int argc, char **argv)
{
    if (argc != 2) {
        std::fprintf(stderr, "usage: consumer_cpp HOST:PORT\n");
        return 2;
    }
    const char *targets[] = {argv[1]};
    tqkv_client_opts_t o = TQKV_CLIENT_OPTS_INIT;
    o.targets = targets;
    o.num_targets = 1;
    o.wait_for_ready = 1;
    o.transport = TQKV_CLIENT_TRANSPORT_TCP;
    tqkv_client_t *c = nullptr;
    tqkv_status_t st = tqkv_client_create(&o, &c);
    if (st != TQKV_OK)
        return fail("create", st);

    std::mt19937 rng(11);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    auto to_bf16 = [](float f) {
        uint32_t u;
        std::memcpy(&u, &f, 4);
        return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    };
    const size_t cells = kHashes * kLayers;
    std::vector<std::vector<uint16_t>> k(cells, std::vector<uint16_t>(kN)), v = k;
    for (size_t e = 0; e < cells; e++)
        for (uint32_t i = 0; i < kN; i++) {
            k[e][i] = to_bf16(nd(rng));
            v[e][i] = to_bf16(0.5f * nd(rng));
        }
    std::vector<tqkv_hash_t> hashes(kHashes + 1);
    for (size_t i = 0; i < hashes.size(); i++) {
        hashes[i].len = 32;
        for (int j = 0; j < 32; j++)
            hashes[i].bytes[j] = static_cast<uint8_t>(rng());
    }
    std::vector<const void *> kp(cells), vp(cells);
    for (size_t e = 0; e < cells; e++) {
        kp[e] = k[e].data();
        vp[e] = v[e].data();
    }
    tqkv_put_many_req_t pr{};
    pr.ns = "install-cpp";
    pr.hashes = hashes.data();
    pr.num_hashes = kHashes;
    pr.layer_begin = 0;
    pr.layer_end = kLayers;
    pr.num_layers = kLayers;
    pr.shape = {kT, kH, kD};
    pr.keys = kp.data();
    pr.values = vp.data();
    tqkv_put_result_t res{};
    if ((st = tqkv_client_put_many(c, nullptr, &pr, &res)) != TQKV_OK)
        return fail("put_many", st);
    if (res.blocks_stored != cells) {
        std::fprintf(stderr, "consumer.cpp: stored %llu blocks, want %zu\n",
                     static_cast<unsigned long long>(res.blocks_stored), cells);
        return 1;
    }
    uint32_t prefix = 0;
    std::vector<uint8_t> tiers(kHashes + 1);
    tqkv_lookup_req_t lq{};
    lq.ns = "install-cpp";
    lq.hashes = hashes.data();
    lq.num_hashes = kHashes + 1; // the last one was never put
    lq.num_layers = kLayers;
    lq.lease_ms = 5000;
    if ((st = tqkv_client_lookup(c, &lq, &prefix, tiers.data())) != TQKV_OK)
        return fail("lookup", st);
    if (prefix != kHashes || tiers[kHashes] != TQKV_CLIENT_TIER_NONE) {
        std::fprintf(stderr, "consumer.cpp: lookup prefix %u, want %zu\n", prefix, kHashes);
        return 1;
    }
    // Destinations scattered in one arena, in another order than the Put (a block table).
    const size_t grid = (kHashes + 1) * kLayers;
    std::vector<uint16_t> arena_pk(2 * grid * kN, 0x7fc0), arena_bf(2 * grid * kN, 0x7fc0);
    auto get = [&](int enc, std::vector<uint16_t> &arena, std::vector<uint8_t> &found) {
        std::vector<void *> kd(grid), vd(grid);
        for (size_t e = 0; e < grid; e++) {
            size_t slot = grid - 1 - e;
            kd[e] = &arena[(2 * slot) * kN];
            vd[e] = &arena[(2 * slot + 1) * kN];
        }
        tqkv_get_req_t gq{};
        gq.ns = "install-cpp";
        gq.hashes = hashes.data();
        gq.num_hashes = kHashes + 1;
        gq.layer_begin = 0;
        gq.layer_end = kLayers;
        gq.encoding = enc;
        tqkv_get_into_t dst{};
        dst.shape = {kT, kH, kD};
        dst.keys = kd.data();
        dst.values = vd.data();
        dst.found = found.data();
        uint64_t nfound = 0, bytes = 0;
        tqkv_status_t s = tqkv_client_get_into(c, &gq, &dst, &nfound, &bytes);
        if (s == TQKV_OK && nfound != cells)
            s = TQKV_EINTERNAL;
        return s;
    };
    std::vector<uint8_t> f_pk(grid), f_bf(grid);
    if ((st = get(TQKV_CLIENT_PACKED, arena_pk, f_pk)) != TQKV_OK)
        return fail("get_into packed", st);
    if ((st = get(TQKV_CLIENT_BF16, arena_bf, f_bf)) != TQKV_OK)
        return fail("get_into bf16", st);
    for (size_t l = 0; l < kLayers; l++) {
        size_t miss = l * (kHashes + 1) + kHashes;
        if (f_pk[miss] || f_bf[miss]) {
            std::fprintf(stderr, "consumer.cpp: a block never put reads found\n");
            return 1;
        }
    }
    if (arena_pk != arena_bf) {
        std::fprintf(stderr, "consumer.cpp: client decode differs from the server's BF16\n");
        return 1;
    }
    uint64_t pages = 0;
    if ((st = tqkv_client_delete(c, "install-cpp", nullptr, 0, 1, &pages, nullptr)) != TQKV_OK)
        return fail("delete", st);
    if (pages != cells) {
        std::fprintf(stderr, "consumer.cpp: deleted %llu pages, want %zu\n",
                     static_cast<unsigned long long>(pages), cells);
        return 1;
    }
    tqkv_client_destroy(c);
    std::printf("consumer.cpp: ok (tqkv %s, %zu blocks)\n", tqkv_version(), cells);
    return 0;
}
