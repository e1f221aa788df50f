// test-vis-shadow MODEL SHADOW: the C loader of shadow sidecars (src/features/vis-moe-shadow.h) and the positioned read a
// later change will use.  Loads MODEL, loads SHADOW for every MoE layer, and reads the last expert of every shadow
// tensor through vis_io_pool (O_DIRECT where allowed, as the model's deferred experts are read).  Prints one line
// per tensor: "name type offs nb2 n_expert fnv64(last expert's bytes)"; tests/test_shadow.py compares the lines
// with the file as the gguf package reads it.  Not registered with ctest: it needs a sidecar that pytest writes.
#include "vis-check.h"
#include "vis-moe-io-pool.h"
#include "vis-moe-shadow.h"

#include "llama.h"

#include <cinttypes>
#include <cstdio>
#include <exception>
#include <vector>

static uint64_t fnv64(const std::vector<uint8_t> & b) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint8_t c : b) {
        h = (h ^ c) * 0x100000001b3ull;
    }
    return h;
}

int main(int argc, char ** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: %s MODEL SHADOW\n", argv[0]);
        return 2;
    }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    CHECK(model != nullptr);
    if (!model) {
        return vis_check_done("test-vis-shadow");
    }
    const int n_layer = llama_model_n_layer(model);
    std::vector<int> all;
    for (int il = 0; il < n_layer; ++il) {
        all.push_back(il);
    }
    try {
        auto sh = vis_moe_shadow_load(argv[2], *model, {});   // no layer required: the header and fingerprint only
        CHECK(sh->n_layers == 0 && sh->bytes == 0);
        std::vector<int> moe;
        // the layers the file covers: those whose tensors load when required
        for (int il : all) {
            try {
                auto one = vis_moe_shadow_load(argv[2], *model, { il });
                if (one->n_layers == 1) {
                    moe.push_back(il);
                }
            } catch (const std::exception &) {
            }
        }
        CHECK(!moe.empty());
        sh = vis_moe_shadow_load(argv[2], *model, moe);
        CHECK(sh->n_layers == (int) moe.size() && sh->bytes > 0 && sh->bytes <= sh->model_bytes);
        vis_io_pool io(2, -1);
        for (int il : moe) {
            size_t sum = 0;
            for (int k = 0; k < VIS_SHADOW_KINDS; ++k) {
                const vis_shadow_tensor * t = sh->get(il, k);
                if (!t) {
                    continue;
                }
                sum += t->src.nb2;
                CHECK(t->type == sh->type && t->src.nb2 * t->src.n_expert <= sh->file->size);
                const int e = (int) t->src.n_expert - 1;
                std::vector<uint8_t> buf(t->src.nb2);
                io.read({ { &t->src, il, e, buf.data() } });
                std::printf("%s %s %" PRIu64 " %zu %" PRId64 " %016" PRIx64 "\n", t->src.name.c_str(),
                            ggml_type_name(t->type), t->src.offs, t->src.nb2, t->src.n_expert, fnv64(buf));
            }
            CHECK(sum == sh->expert_bytes(il));
        }
        CHECK(sh->get(-1, 0) == nullptr && sh->get(n_layer, 0) == nullptr && sh->get(moe[0], VIS_SHADOW_KINDS) == nullptr);
    } catch (const std::exception & e) {
        std::fprintf(stderr, "%s\n", e.what());
        CHECK(false);
    }
    llama_model_free(model);
    return vis_check_done("test-vis-shadow");
}
