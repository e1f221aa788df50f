// vis-moe-transfer.cpp - filling slots from the tiers (vis-moe-transfer.h).
#include "vis-moe-transfer.h"
#include "vis-moe-context.h"
#include "vis-moe-fetch.h"

#include <algorithm>
#include <cstring>

// copy a packed expert into slot s
static void slab_write(vis_moe_layer & L, int s, const uint8_t * packed) {
    for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
        ggml_tensor * dst = L.slab[ti];
        if (!dst) {
            continue;
        }
        const size_t nb = dst->nb[2];
        if (ggml_backend_buffer_is_host(dst->buffer)) {
            std::memcpy((char *) dst->data + (size_t) s * nb, packed + L.part_off[ti], nb);
        } else {
            ggml_backend_tensor_set(dst, packed + L.part_off[ti], (size_t) s * nb, nb);
        }
    }
}

void vis_moe_slab_read(const vis_moe_layer & L, int s, uint8_t * packed) {
    for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
        const ggml_tensor * src = L.slab[ti];
        if (!src) {
            continue;
        }
        const size_t nb = src->nb[2];
        if (ggml_backend_buffer_is_host(src->buffer)) {
            std::memcpy(packed + L.part_off[ti], (const char *) src->data + (size_t) s * nb, nb);
        } else {
            ggml_backend_tensor_get(src, packed + L.part_off[ti], (size_t) s * nb, nb);
        }
    }
}

// store = model: copy expert e from llama.cpp's own copy of the weights
static void model_copy(vis_moe_context & vm, vis_moe_layer & L, int e, int s) {
    for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
        ggml_tensor * src = L.orig[ti];
        ggml_tensor * dst = L.slab[ti];
        if (!src) {
            continue;
        }
        const size_t nb   = src->nb[2];
        const size_t soff = (size_t) e * nb;
        const size_t doff = (size_t) s * nb;
        const bool src_host = ggml_backend_buffer_is_host(src->buffer);
        const bool dst_host = ggml_backend_buffer_is_host(dst->buffer);
        if (src_host && dst_host) {
            std::memcpy((char *) dst->data + doff, (const char *) src->data + soff, nb);
        } else if (src_host) {
            ggml_backend_tensor_set(dst, (const char *) src->data + soff, doff, nb);
        } else {
            vm.staging.resize(nb);
            ggml_backend_tensor_get(src, vm.staging.data(), soff, nb);
            if (dst_host) {
                std::memcpy((char *) dst->data + doff, vm.staging.data(), nb);
            } else {
                ggml_backend_tensor_set(dst, vm.staging.data(), doff, nb);
            }
        }
    }
}

void vis_moe_fill_slots(vis_moe_context & vm, vis_moe_layer & L, int il, const std::vector<std::pair<int, int>> & misses) {
    std::vector<vis_read_req> reqs;
    std::vector<std::pair<int, size_t>> staged;  // (slot, offset in vm.staging) to copy after the reads
    std::vector<int> staged_expert;
    if (L.deferred && !L.direct_write) {
        vm.staging.resize(std::max<size_t>(vm.staging.size(), misses.size() * (size_t) L.expert_bytes));
    }
    size_t stage_off = 0;
    for (const auto & [e, s] : misses) {
        if (vm.host) {
            if (const uint8_t * h = vm.host->find(il, e)) {
                slab_write(L, s, h);
                if (vm.host_exclusive) {
                    vm.host->erase(il, e);
                }
                vm.n_host_hits++;
                continue;
            }
        }
        if (!L.deferred) {
            model_copy(vm, L, e, s);
            vm.n_model_copies++;
            continue;
        }
        vm.n_file_reads++;
        if (L.direct_write) {
            for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
                if (L.file[ti]) {
                    reqs.push_back({ L.file[ti], il, e, (char *) L.slab[ti]->data + (size_t) s * L.slab[ti]->nb[2] });
                }
            }
        } else {
            uint8_t * buf = vm.staging.data() + stage_off;
            for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
                if (L.file[ti]) {
                    reqs.push_back({ L.file[ti], il, e, buf + L.part_off[ti] });
                }
            }
            staged.emplace_back(s, stage_off);
            staged_expert.push_back(e);
            stage_off += (size_t) L.expert_bytes;
        }
    }
    if (reqs.empty()) {
        return;
    }
    reqs.front().src->file->check_unchanged();
    vm.io->read(reqs);
    for (size_t i = 0; i < staged.size(); ++i) {
        const uint8_t * buf = vm.staging.data() + staged[i].second;
        slab_write(L, staged[i].first, buf);
        if (vm.host && !vm.host_exclusive) {
            // discrete GPU: tier 2 keeps a pinned-host copy of what went to the device
            if (uint8_t * h = vm.host->insert(il, staged_expert[i])) {
                std::memcpy(h, buf, (size_t) L.expert_bytes);
            }
        }
    }
}

std::unique_ptr<vis_fetch_job> vis_moe_fetch_job(vis_moe_context & vm, vis_moe_layer & L, int il, int e, int s) {
    if (vm.host) {
        if (const uint8_t * h = vm.host->find(il, e)) {
            slab_write(L, s, h);
            if (vm.host_exclusive) {
                vm.host->erase(il, e);
            }
            vm.n_host_hits++;
            return nullptr;
        }
    }
    if (!L.deferred) {
        model_copy(vm, L, e, s);  // the model's own copy is in memory: as cheap as a host hit
        vm.n_model_copies++;
        return nullptr;
    }
    auto job = std::make_unique<vis_fetch_job>();
    job->il     = il;
    job->expert = e;
    job->slot   = s;
    job->bytes  = L.expert_bytes;
    job->staged = !L.direct_write;
    if (job->staged) {
        job->staging.resize((size_t) L.expert_bytes);
    }
    for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
        if (L.file[ti]) {
            void * dst = job->staged ? (void *) (job->staging.data() + L.part_off[ti])
                                     : (void *) ((char *) L.slab[ti]->data + (size_t) s * L.slab[ti]->nb[2]);
            job->reqs.push_back({ L.file[ti], il, e, dst });
        }
    }
    return job;
}

void vis_moe_fetch_finish(vis_moe_layer & L, const vis_fetch_job & job) {
    if (job.staged) {
        slab_write(L, job.slot, job.staging.data());
    }
}
