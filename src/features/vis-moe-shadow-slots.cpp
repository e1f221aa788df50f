// vis-moe-shadow-slots.cpp - shadow slots, shadow passes and their allocation (vis-moe-shadow-slots.h).
#include "vis-moe-shadow-slots.h"
#include "vis-moe-context.h"
#include "vis-moe-fetch.h"
#include "vis-moe-passes.h"
#include "vis-moe-shadow.h"

#include "llama-impl.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <stdexcept>

void vis_shadow_plan(const vis_moe_layer & L, vis_ubatch_plan & plan, int first_pass) {
    const vis_shadow_slots & S = L.shadow;
    plan.shadow_passes.clear();
    plan.shadow_first_pass = first_pass;
    if (!S.on()) {
        return;
    }
    std::vector<int32_t> order;  // shadow hits first: they never look for a victim
    for (int pass = 0; pass < 2; ++pass) {
        for (int e = 0; e < L.n_expert; ++e) {
            if (plan.shadow_serve[e] && S.pool.resident(e) == (pass == 0)) {
                order.push_back(e);
            }
        }
    }
    for (size_t i = 0; i < order.size(); i += S.n_slots) {
        const size_t end = std::min(order.size(), i + (size_t) S.n_slots);
        plan.shadow_passes.emplace_back(order.begin() + i, order.begin() + end);
        for (size_t x = i; x < end; ++x) {
            plan.pass_of[order[x]] = first_pass + (int32_t) plan.shadow_passes.size() - 1;
        }
    }
}

// write one packed shadow expert (the sidecar's tensors back to back, VIS_T_* order) into slot s
static void shadow_slab_write(vis_shadow_slots & S, int s, const uint8_t * packed) {
    size_t off = 0;
    for (int k = 0; k < 4; ++k) {
        if (ggml_tensor * t = S.slab[k]) {
            ggml_backend_tensor_set(t, packed + off, (size_t) s * t->nb[2], t->nb[2]);
            off += t->nb[2];
        }
    }
}

void vis_shadow_run_pass(vis_moe_context & vm, vis_moe_layer & L, int il, int sp, const int32_t * ids, int64_t n_pairs,
                         int32_t * out, llama_vis_moe_prec_stats & st) {
    vis_shadow_slots & S = L.shadow;
    const auto t0 = std::chrono::steady_clock::now();
    static const std::vector<int32_t> none;
    const vis_ubatch_plan & plan = L.ubatch_plan;
    const std::vector<int32_t> & experts = sp < (int) plan.shadow_passes.size() ? plan.shadow_passes[sp] : none;
    const int32_t foreign = L.cpu_passes ? -1 : S.n_slots;
    if (!experts.empty()) {
        S.pool.policy().begin_pass();
        for (int e : experts) {
            if (S.pool.resident(e)) {
                S.pool.policy().touch(S.pool.slot_of(e), e);
                st.n_shadow_hits++;
            }
        }
        std::vector<std::pair<int, int>> misses;  // (expert, slot)
        for (int e : experts) {
            if (S.pool.resident(e)) {
                continue;
            }
            const int s = S.pool.policy().victim();
            GGML_ASSERT(s >= 0 && "vis-moe: a shadow pass needs more experts than shadow slots (plan bug)");
            S.pool.evict(s);
            S.pool.place(e, s);
            S.pool.policy().touch(s, e);
            misses.emplace_back(e, s);
        }
        std::vector<vis_read_req> reqs;
        std::vector<std::vector<uint8_t>> bounce;  // device slabs: the packed expert, uploaded after the reads
        bounce.reserve(misses.size());
        for (const auto & [e, s] : misses) {
            if (!S.host_write) {
                bounce.emplace_back((size_t) S.expert_bytes);
            }
            size_t off = 0;
            for (int k = 0; k < 4; ++k) {
                if (!S.slab[k]) {
                    continue;
                }
                void * dst = S.host_write ? (void *) ((char *) S.slab[k]->data + (size_t) s * S.slab[k]->nb[2])
                                          : (void *) (bounce.back().data() + off);
                reqs.push_back({ &S.src[k]->src, il, e, dst });
                off += S.slab[k]->nb[2];
            }
        }
        try {
            if (!reqs.empty()) {
                vis_fetch_demand demand(vm.fetch.get());  // reads ahead wait: this pass needs the disk now
                reqs.front().src->file->check_unchanged();
                vm.io->read(reqs);
            }
        } catch (...) {
            for (const auto & [e, s] : misses) {  // never leave a slot marked as holding what it does not hold
                S.pool.evict(s);
            }
            st.load_us += std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
            throw;
        }
        for (size_t i = 0; i < bounce.size(); ++i) {
            shadow_slab_write(S, misses[i].second, bounce[i].data());
        }
        st.n_shadow_reads += (int64_t) misses.size();
        st.bytes_shadow   += (int64_t) misses.size() * S.expert_bytes;
        // what the critical path did not read: the full expert, less its shadow when the shadow had to be read
        st.bytes_saved += (int64_t) experts.size() * L.expert_bytes - (int64_t) misses.size() * S.expert_bytes;
    }
    const int32_t me = plan.shadow_first_pass + sp;
    for (int64_t j = 0; j < n_pairs; ++j) {
        const int e = ids[j];
        out[j] = plan.pass_of[e] == me ? S.pool.slot_of(e) : foreign;
        st.n_shadow_pairs += plan.pass_of[e] == me ? 1 : 0;
    }
    const ggml_tensor * slab = S.slab[0] ? S.slab[0] : S.slab[2] ? S.slab[2] : S.slab[3];
    if (!L.cpu_passes && slab) {
        vis_moe_distinct_foreign(out, n_pairs, plan.n_used, (int32_t) slab->ne[2], foreign);  // a GPU's mul_mat_id
    }
    st.load_us += std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
}

void vis_shadow_slots_create(vis_moe_context & vm, int n_slots) {
    static const char * const KIND[4] = { "gate", "up", "down", "gate_up" };
    std::map<ggml_backend_buffer_type_t, ggml_context *> ctx_of;
    std::vector<ggml_context *> made;
    for (size_t il = 0; il < vm.layers.size(); ++il) {
        vis_moe_layer & L = vm.layers[il];
        if (!L.managed || !vm.shadow) {
            continue;
        }
        vis_shadow_slots & S = L.shadow;
        const int ns = std::min(n_slots, L.n_expert);
        ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(L.any_slab()->buffer);
        ggml_context *& c = ctx_of[buft];
        if (!c) {
            ggml_init_params ip = { /*.mem_size =*/ ggml_tensor_overhead() * (size_t) (4 * vm.layers.size() + 8),
                                    /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ true };
            c = ggml_init(ip);
            vm.ctxs.push_back(c);  // freed with the context
        }
        S.expert_bytes = 0;
        for (int k = 0; k < 4; ++k) {
            const vis_shadow_tensor * t = vm.shadow->get((int) il, k);
            if (!L.orig[k]) {
                continue;
            }
            if (!t) {
                throw std::runtime_error("vis-moe: --moe-shadow has no " + std::string(KIND[k]) + " tensor for layer " +
                                         std::to_string(il) + " (loader bug)");
            }
            S.src[k]  = t;
            S.slab[k] = ggml_new_tensor_3d(c, t->type, t->ne0, t->ne1,
                                           ns + vis_moe_staging_slots(L.cpu_passes, ns, vm.n_expert_used));
            ggml_format_name(S.slab[k], "vis_shadow_slab.blk.%zu.%s", il, KIND[k]);
            S.expert_bytes += (int64_t) S.slab[k]->nb[2];
        }
        S.n_slots = ns;
        S.pool.init(L.n_expert, ns, vis_moe_policy_lru(ns));
    }
    for (auto & [buft, c] : ctx_of) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(c, buft);
        if (!buf) {
            throw std::runtime_error(std::string("vis-moe: failed to allocate the shadow slabs in ") +
                                     ggml_backend_buft_name(buft) + "; lower --moe-shadow-slots or the cache size");
        }
        ggml_backend_buffer_clear(buf, 0);  // the staging slot (if any) holds finite zeros
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        vm.shadow_slab_bytes += (int64_t) ggml_backend_buffer_get_size(buf);
        if (vm.tier.mlock && ggml_backend_buffer_is_host(buf)) {
            vis_mlock_region(ggml_backend_buffer_get_base(buf), ggml_backend_buffer_get_size(buf), "the shadow slabs");
        }
        vm.bufs.push_back(buf);
    }
    for (auto & L : vm.layers) {
        for (ggml_tensor * t : L.shadow.slab) {
            if (t) {
                L.shadow.host_write = ggml_backend_buffer_is_host(t->buffer);
            }
        }
    }
}
