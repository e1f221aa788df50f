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

// the copies that put a packed expert into slot s of a device slab (discrete GPU, through the upload stream)
static void slab_copies(const vis_moe_layer & L, int s, const uint8_t * packed, std::vector<vis_upload_copy> & out) {
    for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
        if (ggml_tensor * dst = L.slab[ti]) {
            const size_t nb = dst->nb[2];
            out.push_back({ dst, packed + L.part_off[ti], (size_t) s * nb, nb });
        }
    }
}

// slot s gets a packed expert now: through the upload stream on a discrete GPU (then waited for), else as before
static void slab_put(vis_moe_layer & L, int s, const uint8_t * packed) {
    if (L.upload && L.upload->async()) {
        std::vector<vis_upload_copy> copies;
        slab_copies(L, s, packed, copies);
        L.upload->wait(L.upload->issue(copies));
    } else {
        slab_write(L, s, packed);
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
            const vis_staging_pool::block buf = vm.staging->acquire();  // nb <= one expert <= a block
            ggml_backend_tensor_get(src, buf.data(), soff, nb);
            if (dst_host) {
                std::memcpy((char *) dst->data + doff, buf.data(), nb);
            } else {
                ggml_backend_tensor_set(dst, buf.data(), doff, nb);
            }
        }
    }
}

bool vis_moe_serve_from_memory(vis_moe_context & vm, vis_moe_layer & L, int il, int e, int s,
                               std::vector<vis_upload_copy> * copies) {
    if (vm.host) {
        if (const uint8_t * h = vm.host->find(il, e)) {
            if (copies) {
                slab_copies(L, s, h, *copies);  // tier 2 is inclusive there: h stays until the caller waited
            } else {
                slab_write(L, s, h);
            }
            if (vm.host_exclusive) {
                vm.host->erase(il, e);  // unified memory only, never with an uploader: h was copied above
            }
            vm.n_host_hits++;
            return true;
        }
    }
    if (!L.deferred) {
        model_copy(vm, L, e, s);
        vm.n_model_copies++;
        return true;
    }
    return false;
}

void vis_moe_slot_reqs(const vis_moe_layer & L, int il, int e, int s, std::vector<vis_read_req> & reqs) {
    for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
        if (L.file[ti]) {
            reqs.push_back({ L.file[ti], il, e, (char *) L.slab[ti]->data + (size_t) s * L.slab[ti]->nb[2] });
        }
    }
}

// Demand misses on a discrete GPU with an upload stream: every copy of the pass is issued asynchronously and
// the pass waits once, at the end.  The pass's kernels need all of its experts, so waiting per copy (the
// synchronous ggml_backend_tensor_set does a stream synchronisation per tensor, three per expert) buys nothing;
// issuing them together lets the tier-2 hits copy while the file is read, from pinned blocks at DMA speed.  The
// copies share the stream with background uploads, so a pass may also wait for a background copy issued before
// it (one expert each, already under way).
void vis_moe_fill_slots(vis_moe_context & vm, vis_moe_layer & L, int il, const std::vector<std::pair<int, int>> & misses) {
    struct staged_miss {
        int slot, expert;
        vis_staging_pool::block buf;
    };
    std::vector<vis_read_req> reqs;
    std::vector<staged_miss> staged;       // read into staging blocks, copied to their slots after the reads
    std::vector<vis_upload_copy> copies;   // asynchronous uploads of this pass (discrete GPU)
    vis_moe_uploader * up = L.upload && L.upload->async() ? L.upload : nullptr;
    for (const auto & [e, s] : misses) {
        if (vis_moe_serve_from_memory(vm, L, il, e, s, up ? &copies : nullptr)) {
            continue;
        }
        vm.n_file_reads++;
        if (L.direct_write) {
            vis_moe_slot_reqs(L, il, e, s, reqs);
        } else {
            staged.push_back({ s, e, vm.staging->acquire() });
            uint8_t * buf = staged.back().buf.data();
            for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
                if (L.file[ti]) {
                    reqs.push_back({ L.file[ti], il, e, buf + L.part_off[ti] });
                }
            }
        }
    }
    ggml_backend_event_t ev_hits = up ? up->issue(copies) : nullptr;  // tier-2 hits copy during the reads
    if (reqs.empty()) {
        if (up) {
            up->wait(ev_hits);
        }
        return;
    }
    try {
        vis_fetch_demand demand(vm.fetch.get());  // reads ahead wait: this pass needs the disk now
        reqs.front().src->file->check_unchanged();
        vm.io->read(reqs);
    } catch (...) {
        if (up) {
            up->wait(ev_hits);  // their source blocks may be reused once we return
        }
        throw;
    }
    copies.clear();
    for (const auto & m : staged) {
        if (up) {
            slab_copies(L, m.slot, m.buf.data(), copies);
        } else {
            slab_write(L, m.slot, m.buf.data());
        }
    }
    if (up) {
        ggml_backend_event_t ev_read = up->issue(copies);
        up->wait(ev_hits);
        up->wait(ev_read);
    }
    // after the wait: an insert may evict and overwrite the tier-2 block a hit above was copied from
    for (const auto & m : staged) {
        if (vm.host && !vm.host_exclusive) {
            // discrete GPU: tier 2 keeps a (pinned) host copy of what went to the device
            if (uint8_t * h = vm.host->insert(il, m.expert)) {
                std::memcpy(h, m.buf.data(), (size_t) L.expert_bytes);
            }
        }
    }
}

std::unique_ptr<vis_fetch_job> vis_moe_fetch_job(vis_moe_context & vm, vis_moe_layer & L, int il, int e, int s) {
    if (vm.host) {
        if (const uint8_t * h = vm.host->find(il, e)) {
            slab_put(L, s, h);
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
    job->staged = L.bg_staged;
    if (job->staged) {
        job->staging = vm.staging->acquire();
        if (L.upload && L.upload->async()) {
            job->upload = L.upload;  // the worker issues the copy right after the read
            slab_copies(L, s, job->staging.data(), job->copies);
        }
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

void vis_moe_fetch_finish(vis_moe_layer & L, vis_fetch_job & job) {
    if (job.upload) {
        job.wait_upload();  // issued by the worker: only this job's copy is waited for
    } else if (job.staged) {
        slab_write(L, job.slot, job.staging.data());  // compute thread, between kernels
    }
}
