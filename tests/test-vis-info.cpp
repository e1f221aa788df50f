// test-vis-info: the fork's C API is linked into libllama and reachable
// through upstream (patch 0001), and llama_vis_model_moe_info() reports the
// MoE shape that the GGUF metadata of each fixture declares.
//
// usage: test-vis-info MODEL.gguf...
#include "llama-vis.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

static int g_failures = 0;

#define CHECK(cond, ...)                                              \
    do {                                                              \
        if (!(cond)) {                                                \
            std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            std::fprintf(stderr, __VA_ARGS__);                        \
            std::fprintf(stderr, "\n");                               \
            g_failures++;                                             \
        }                                                             \
    } while (0)

static long meta_int(const llama_model * model, const std::string & key) {
    char buf[128];
    if (llama_model_meta_val_str(model, key.c_str(), buf, sizeof(buf)) < 0) {
        return -1;
    }
    return std::strtol(buf, nullptr, 10);
}

static void check_model(const char * path) {
    auto mparams = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(path, mparams);
    CHECK(model != nullptr, "cannot load %s (generate fixtures with `pyvis fixtures`)", path);
    if (!model) {
        return;
    }
    char arch[64] = {0};
    llama_model_meta_val_str(model, "general.architecture", arch, sizeof(arch));

    llama_vis_moe_info info;
    CHECK(llama_vis_model_moe_info(model, &info) == 0, "%s", path);

    const std::string a(arch);
    const long n_expert      = meta_int(model, a + ".expert_count");
    const long n_expert_used = meta_int(model, a + ".expert_used_count");
    const long n_layer       = meta_int(model, a + ".block_count");
    long n_dense_lead        = meta_int(model, a + ".leading_dense_block_count");
    if (n_dense_lead < 0) {
        n_dense_lead = 0;
    }
    CHECK(info.n_layer == n_layer, "%s: n_layer %d vs %ld", path, info.n_layer, n_layer);
    CHECK(info.n_expert == n_expert, "%s: n_expert %d vs %ld", path, info.n_expert, n_expert);
    CHECK(info.n_expert_used == n_expert_used, "%s: n_expert_used %d vs %ld", path, info.n_expert_used, n_expert_used);
    CHECK(info.n_moe_layers == n_layer - n_dense_lead, "%s: n_moe_layers %d", path, info.n_moe_layers);
    CHECK(info.first_moe_layer == n_dense_lead, "%s: first_moe_layer %d", path, info.first_moe_layer);
    CHECK(info.expert_bytes > 0, "%s: expert_bytes %lld", path, (long long) info.expert_bytes);
    CHECK(info.routed_bytes == info.expert_bytes * info.n_expert * info.n_moe_layers,
          "%s: routed_bytes %lld != expert_bytes*n_expert*n_moe_layers", path, (long long) info.routed_bytes);
    CHECK(info.routed_bytes < (long long) llama_model_size(model), "%s: routed bytes exceed model size", path);
    if (a == "deepseek2") {
        CHECK(info.has_shared_exp == 1 && info.n_expert_shared > 0, "%s: shared experts not seen", path);
    }
    if (a == "gpt-oss") {
        CHECK(info.has_exp_bias == 1, "%s: expert biases not seen", path);
    }
    std::printf("ok %s: arch=%s layers=%d moe_layers=%d experts=%d top-k=%d expert_bytes=%lld\n", path, arch,
                info.n_layer, info.n_moe_layers, info.n_expert, info.n_expert_used, (long long) info.expert_bytes);
    llama_model_free(model);
}

int main(int argc, char ** argv) {
    llama_backend_init();
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);

    CHECK(std::strlen(llama_vis_version()) > 0, "empty version");
    CHECK(std::string(llama_vis_upstream_commit()) == "0c1e570", "upstream commit %s", llama_vis_upstream_commit());
    const std::string sysinfo = llama_print_system_info();
    CHECK(sysinfo.find(llama_vis_system_info()) != std::string::npos,
          "llama_print_system_info() lacks the fork fragment (is patch 0001 applied?): %s", sysinfo.c_str());
    CHECK(llama_vis_model_moe_info(nullptr, nullptr) == -1, "NULL model must return -1");

    for (int i = 1; i < argc; ++i) {
        check_model(argv[i]);
    }
    llama_backend_free();
    if (g_failures) {
        std::fprintf(stderr, "%d check(s) failed\n", g_failures);
        return 1;
    }
    std::printf("all checks passed\n");
    return 0;
}
