// test-vis-upload: the host side of the discrete-GPU path (src/store/vis-moe-upload.h, vis_host_cache in
// src/store/vis-moe-store.h), checked without a GPU.  Buffer types that stand for a device's pinned host memory are
// made here the way CUDA's is (a CPU buffer relabelled with the pinned type), plus one that refuses and one that
// silently falls back to ordinary memory, as cudaMallocHost's failure path does.
//   - tier 2 without a pinned type is today's anonymous arena (CPU, unified memory);
//   - with one: the first blocks pinned up to the cap, the rest anonymous, every block usable and distinct;
//   - refused or silently unpinned allocations fall back to the anonymous arena, reported as refused;
//   - the pinned budget (--moe-pin-mib): off, N MiB, auto = 25 % of MemTotal;
//   - staging blocks: pinned while the budget allows, then ordinary; reused after release;
//   - the uploader of a device without events (the CPU) copies synchronously and returns no event.
#include "vis-check.h"
#include "vis-moe-upload.h"

#include "ggml-backend-impl.h"  // to make test buffer types (tests/CMakeLists.txt adds ggml/src)

#include <cstdio>
#include <cstring>
#include <set>
#include <vector>


// ---- test buffer types ------------------------------------------------------------

static size_t g_pinned_live = 0;  // bytes of "pinned" buffers not yet freed

static const char * name_pinned(ggml_backend_buffer_type_t) { return "TEST_Pinned"; }
static const char * name_refuse(ggml_backend_buffer_type_t) { return "TEST_Refuse"; }
static const char * name_fallback(ggml_backend_buffer_type_t) { return "TEST_Fallback"; }
static size_t align_64(ggml_backend_buffer_type_t) { return 64; }
static bool   yes(ggml_backend_buffer_type_t) { return true; }

static void (*g_cpu_free)(ggml_backend_buffer_t) = nullptr;
static void free_pinned(ggml_backend_buffer_t b) {
    g_pinned_live -= ggml_backend_buffer_get_size(b);
    g_cpu_free(b);
}

static ggml_backend_buffer_t alloc_pinned(ggml_backend_buffer_type_t buft, size_t size) {
    // what CUDA's host buffer type does: cudaMallocHost'd memory in a CPU buffer, relabelled
    ggml_backend_buffer_t b = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), size);
    if (!b) {
        return nullptr;
    }
    b->buft = buft;
    g_cpu_free = b->iface.free_buffer;
    b->iface.free_buffer = free_pinned;
    g_pinned_live += size;
    return b;
}
static ggml_backend_buffer_t alloc_refuse(ggml_backend_buffer_type_t, size_t) { return nullptr; }
static ggml_backend_buffer_t alloc_fallback(ggml_backend_buffer_type_t, size_t size) {
    return ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), size);  // cudaMallocHost refused
}

static ggml_backend_buffer_type make_buft(const char * (*name)(ggml_backend_buffer_type_t),
                                          ggml_backend_buffer_t (*alloc)(ggml_backend_buffer_type_t, size_t)) {
    ggml_backend_buffer_type t = {};
    t.iface.get_name      = name;
    t.iface.alloc_buffer  = alloc;
    t.iface.get_alignment = align_64;
    t.iface.is_host       = yes;
    return t;
}

static ggml_backend_buffer_type g_pinned   = make_buft(name_pinned, alloc_pinned);
static ggml_backend_buffer_type g_refuse   = make_buft(name_refuse, alloc_refuse);
static ggml_backend_buffer_type g_fallback = make_buft(name_fallback, alloc_fallback);

// ---- tier 2 -------------------------------------------------------------------------

// every block of the cache: distinct, writable, and read back after all were written
static void check_blocks(vis_host_cache & hc, size_t n, size_t block) {
    CHECK(hc.capacity_blocks() == n);
    std::set<uint8_t *> seen;
    for (size_t e = 0; e < n; ++e) {
        uint8_t * b = hc.insert(0, (int) e);
        CHECK(b != nullptr);
        seen.insert(b);
        std::memset(b, (int) (e + 1), block);
    }
    CHECK(seen.size() == n);
    for (size_t e = 0; e < n; ++e) {
        const uint8_t * b = hc.find(0, (int) e);
        CHECK(b != nullptr && b[0] == (uint8_t) (e + 1) && b[block - 1] == (uint8_t) (e + 1));
    }
    CHECK(hc.insert(0, (int) n) != nullptr && hc.n_evictions == 1);  // full: the LRU block is reused
}

static void test_host_cache() {
    const size_t block = 8192;
    {   // CPU and unified memory: no pinned type, today's arena
        vis_host_cache hc(10 * block, block, false);
        CHECK(hc.pinned_bytes() == 0 && !hc.pin_refused());
        check_blocks(hc, 10, block);
    }
    {   // a null type is the same
        vis_host_pinning pin;
        pin.cap = 1ull << 30;
        vis_host_cache hc(10 * block, block, false, pin);
        CHECK(hc.pinned_bytes() == 0 && !hc.pin_refused());
        check_blocks(hc, 10, block);
    }
    {   // all pinned under a large cap
        vis_host_cache hc(10 * block, block, false, { &g_pinned, 1ull << 30 });
        CHECK(hc.pinned_bytes() == 10 * block && !hc.pin_refused() && hc.locked());
        CHECK(g_pinned_live == 10 * block);
        check_blocks(hc, 10, block);
    }
    CHECK(g_pinned_live == 0);  // freed with the cache
    {   // the cap cuts it: 2 of 10 blocks pinned (2.5 blocks of cap), they are handed out first
        vis_host_cache hc(10 * block, block, false, { &g_pinned, 5 * block / 2 });
        CHECK(hc.pinned_bytes() == 2 * block && !hc.pin_refused());
        CHECK(g_pinned_live == 2 * block);
        check_blocks(hc, 10, block);
    }
    {   // a cap below one block pins nothing, and is not a refusal
        vis_host_cache hc(4 * block, block, false, { &g_pinned, block - 1 });
        CHECK(hc.pinned_bytes() == 0 && !hc.pin_refused());
        check_blocks(hc, 4, block);
    }
    {   // refused: all anonymous
        vis_host_cache hc(6 * block, block, false, { &g_refuse, 1ull << 30 });
        CHECK(hc.pinned_bytes() == 0 && hc.pin_refused());
        check_blocks(hc, 6, block);
    }
    {   // silently not pinned (an ordinary CPU buffer came back): freed, reported as refused, all anonymous
        vis_host_cache hc(6 * block, block, false, { &g_fallback, 1ull << 30 });
        CHECK(hc.pinned_bytes() == 0 && hc.pin_refused());
        check_blocks(hc, 6, block);
    }
    CHECK(vis_alloc_pinned(nullptr, 4096) == nullptr);
    CHECK(vis_alloc_pinned(&g_refuse, 4096) == nullptr);
    CHECK(vis_alloc_pinned(&g_fallback, 4096) == nullptr);
    ggml_backend_buffer_t b = vis_alloc_pinned(&g_pinned, 4096);
    CHECK(b != nullptr && ggml_backend_buffer_get_type(b) == &g_pinned);
    ggml_backend_buffer_free(b);
}

// ---- the pinned budget and staging blocks ----------------------------------------------

static void test_budget() {
    vis_pin_budget off = vis_pin_budget_from(0);
    CHECK(off.cap == 0 && off.left() == 0 && off.why.find("off") != std::string::npos);
    vis_pin_budget n = vis_pin_budget_from(100);
    CHECK(n.cap == 100ull << 20 && n.left() == n.cap);
    vis_pin_budget a = vis_pin_budget_from(-1);
    CHECK(a.cap > 0 && a.why.find("25 %") != std::string::npos);
    n.used = n.cap + 1;
    CHECK(n.left() == 0);
}

static void test_staging() {
    const size_t block = 4096;
    {   // no pinned type (CPU): ordinary blocks, made on demand
        vis_staging_pool pool(block, nullptr, nullptr);
        CHECK(pool.pinned_bytes() == 0 && pool.plain_bytes() == 0);
        auto b = pool.acquire();
        CHECK(b && !b.pinned());
        std::memset(b.data(), 7, block);
        CHECK(pool.plain_bytes() >= block && pool.pinned_bytes() == 0);
    }
    {   // pinned within the budget (3 blocks), then ordinary; released blocks come back
        vis_pin_budget pin;
        pin.buft = &g_pinned;
        pin.cap  = 3 * block;
        vis_staging_pool pool(block, &g_pinned, &pin);
        pool.reserve(2);
        CHECK(pool.pinned_bytes() == 2 * block && pin.used == 2 * block);
        std::vector<vis_staging_pool::block> held;
        std::set<uint8_t *> seen;
        int n_pinned = 0;
        for (int i = 0; i < 8; ++i) {
            held.push_back(pool.acquire());
            CHECK(held.back());
            seen.insert(held.back().data());
            n_pinned += held.back().pinned() ? 1 : 0;
            std::memset(held.back().data(), i, block);
        }
        CHECK(seen.size() == 8);
        CHECK(n_pinned == 3 && pin.used == 3 * block && pool.pinned_bytes() == 3 * block);
        const size_t plain = pool.plain_bytes();
        uint8_t * first = held.front().data();
        held.clear();  // back to the pool
        for (int i = 0; i < 8; ++i) {
            held.push_back(pool.acquire());
        }
        CHECK(pool.plain_bytes() == plain && pool.pinned_bytes() == 3 * block);  // reused, nothing new
        bool found = false;
        for (auto & h : held) {
            found = found || h.data() == first;
        }
        CHECK(found);
        vis_staging_pool::block moved = std::move(held.back());
        CHECK(moved && !held.back());
    }
    CHECK(g_pinned_live == 0);
    {   // refused: ordinary blocks, and no further attempts
        vis_pin_budget pin;
        pin.buft = &g_refuse;
        pin.cap  = 1ull << 30;
        vis_staging_pool pool(block, &g_refuse, &pin);
        auto b = pool.acquire();
        CHECK(b && !b.pinned() && pin.used == 0 && pool.pinned_bytes() == 0);
    }
}

// ---- the uploader on a device without events: synchronous copies -----------------------

static void test_uploader_sync() {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    CHECK(cpu != nullptr);
    if (!cpu) {
        return;
    }
    vis_moe_uploader up(cpu);
    CHECK(!up.async() && up.device() == cpu);
    ggml_init_params ip = { ggml_tensor_overhead() * 4, nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * slab = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 16, 4, 3);  // 3 slots of 256 bytes
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_cpu_buffer_type());
    CHECK(buf != nullptr);
    ggml_backend_buffer_clear(buf, 0);
    std::vector<uint8_t> src(slab->nb[2], 0xab);
    std::vector<vis_upload_copy> copies = { { slab, src.data(), 2 * slab->nb[2], slab->nb[2] } };
    ggml_backend_event_t ev = up.issue(copies);
    CHECK(ev == nullptr);  // synchronous: done already
    up.wait(ev);           // a no-op
    CHECK(up.issue({}) == nullptr);
    const uint8_t * d = (const uint8_t *) slab->data;
    CHECK(d[0] == 0 && d[2 * slab->nb[2]] == 0xab && d[3 * slab->nb[2] - 1] == 0xab);
    const auto c = up.get_counters();
    CHECK(c.n_issued == 1 && c.n_copies == 1 && c.bytes == (int64_t) slab->nb[2]);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    // the CPU offers no pinned host memory type: the cache then keeps today's arena
    CHECK(ggml_backend_dev_host_buffer_type(cpu) == nullptr);
}

int main() {
    test_host_cache();
    test_budget();
    test_staging();
    test_uploader_sync();
    return vis_check_done("test-vis-upload");
}
