// test-vis-passes: the slab ids of a pass on a layer whose mul_mat_id may run on a GPU (src/core/vis-moe-passes.h).
// Upstream's CUDA mul_mat_id for a batch assumes a token never names one matrix twice; the pairs of other passes all
// went to the one staging slot and crashed it (an H100: illegal memory access in quantize_mmq_q8_1) or gave wrong
// logits.  vis_moe_distinct_foreign gives each token's foreign pairs ids distinct from each other and from the
// token's own ids, within the slab; vis_moe_staging_slots sizes the slab so that this always fits.
#include "vis-check.h"
#include "vis-moe-passes.h"

#include <cstdint>
#include <set>
#include <vector>

static bool rows_distinct(const std::vector<int32_t> & v, int k, int n_ids) {
    for (size_t r = 0; r < v.size(); r += (size_t) k) {
        std::set<int32_t> seen;
        for (int i = 0; i < k; ++i) {
            const int32_t x = v[r + (size_t) i];
            if (x < 0 || x >= n_ids || !seen.insert(x).second) {
                return false;
            }
        }
    }
    return true;
}

int main() {
    const int32_t F = 99;  // the marker of a foreign pair
    // top-8, 2 slots + 6 staging = 8 ids: token 0 runs slots 1 and 0 in this pass, token 1 none, token 2 slot 1
    {
        std::vector<int32_t> v = { 1, F, F, 0, F, F, F, F,   F, F, F, F, F, F, F, F,   F, F, 1, F, F, F, F, F };
        const std::vector<int32_t> own = v;
        CHECK(vis_moe_distinct_foreign(v.data(), (int64_t) v.size(), 8, 8, F));
        CHECK(rows_distinct(v, 8, 8));
        for (size_t j = 0; j < v.size(); ++j) {
            CHECK(own[j] == F || v[j] == own[j]);  // the pass's own pairs keep their slots
        }
        CHECK(v[1] == 7);                          // foreign pairs take the staging slots first, from the top
    }
    // what the staging slot did before: every foreign pair on it, one id repeated in a row, is what broke CUDA
    {
        std::vector<int32_t> v(4 * 6, F);
        CHECK(vis_moe_distinct_foreign(v.data(), (int64_t) v.size(), 6, 7, F));
        CHECK(rows_distinct(v, 6, 7));
    }
    // too few ids for a row: refused, nothing changed; one pair per token: nothing to do
    {
        std::vector<int32_t> v(8, F);
        CHECK(!vis_moe_distinct_foreign(v.data(), 8, 8, 7, F));
        CHECK(v == std::vector<int32_t>(8, F));
        std::vector<int32_t> w = { F, 0, F };
        CHECK(vis_moe_distinct_foreign(w.data(), 3, 1, 2, F) && w[0] == F);
    }
    // the slabs get enough staging slots: none on the CPU, at least one with a GPU, k - n_slots where fewer slots
    CHECK(vis_moe_staging_slots(true, 1, 8) == 0);
    CHECK(vis_moe_staging_slots(false, 16, 8) == 1);
    CHECK(vis_moe_staging_slots(false, 7, 8) == 1);
    CHECK(vis_moe_staging_slots(false, 2, 8) == 6);
    for (int ns = 1; ns <= 16; ++ns) {
        CHECK(ns + vis_moe_staging_slots(false, ns, 8) >= 8);
    }
    return vis_check_done("test-vis-passes");
}
