// vis-moe-attach-slabs.cpp - steps 4 and 5 of the attach (vis-moe-attach.cpp, vis-moe-attach-slabs.h): each managed
// layer's slot table and slab tensors, the slab buffers (placed for reads in place, zeroed, locked; dummies in
// upstream's --fit probe), and locking the resident weights the plan has room for.
#include "vis-moe-attach-slabs.h"
#include "vis-moe-attach-upload.h"
#include "vis-moe-context.h"
#include "vis-moe-io-pool.h"
#include "vis-moe-passes.h"
#include "vis-pages.h"

#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <stdexcept>
#include <string>

#include <unistd.h>

namespace {

const char * const VIS_T_NAME[VIS_T_COUNT] = { "gate", "up", "down", "gate_up" };

using attach_plan = vis_moe_attach_plan;

// step 4: one layer's slot table and slab tensors (in the context for its device's buffer type)
void create_layer(const llama_model & model, int il, const attach_plan & ap, ggml_context * c, vis_moe_context & vm) {
    const llama_layer & l = model.layers[il];
    const int n_exp = (int) model.hparams.n_expert;
    vis_moe_layer & L = vm.layers[il];
    L.orig     = vis_moe_expert_tensors(l);
    L.deferred = ap.deferred[il];
    size_t off = 0;
    for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
        ggml_tensor * t = L.orig[ti];
        if (!t) {
            continue;
        }
        if (!L.deferred && t->extra != nullptr) {
            throw std::runtime_error(std::string("vis-moe: ") + t->name + " is held in a repacked CPU buffer (" +
                                     ggml_backend_buffer_name(t->buffer) + "), which cannot serve single experts; "
                                     "run with --no-repack (-nr) to use the expert cache");
        }
        if (!ggml_is_contiguous(t)) {
            throw std::runtime_error(std::string("vis-moe: ") + t->name + " is not contiguous");
        }
        if (L.deferred) {
            L.file[ti] = vis_moe_deferred(t);
            if (!L.file[ti]) {
                throw std::runtime_error(std::string("vis-moe: ") + t->name + " of a deferred layer has no file record");
            }
        }
        L.part_off[ti] = off;
        off += t->nb[2];
    }
    const int ns = std::min(ap.slots(il), n_exp);
    for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
        if (ggml_tensor * t = L.orig[ti]) {
            // staging slots for the pairs of other passes (with a GPU): enough for distinct ids per token
            L.slab[ti] = ggml_new_tensor_3d(c, t->type, t->ne[0], t->ne[1],
                                            ns + vis_moe_staging_slots(ap.cpu_only, ns, vm.n_expert_used));
            ggml_format_name(L.slab[ti], "vis_slab.blk.%d.%s", il, VIS_T_NAME[ti]);
        }
    }
    L.managed      = true;
    L.n_slots      = ns;
    L.n_expert     = n_exp;
    L.expert_bytes = vis_moe_layer_expert_bytes(l);
    L.ubatch_plan.pass_of.assign(n_exp, -1);
    L.slots.init(n_exp, ns, vis_moe_policy_make(ap.policy, ns, n_exp));
    L.stats.n_slots = ns;
    L.stats.managed = 1;
    // CPU-only run: the CPU mul_mat_id skips id -1 (patch 0006), so passes compute only their own pairs;
    // with a GPU present the scheduler may offload a host-weight mul_mat_id, so keep the staging slot there
    L.cpu_passes = ap.cpu_only;
    vm.n_managed++;
}

// step 4: slot tables and slabs of every managed layer that does not fit, allocated per buffer type.
// Returns whether every slab buffer is locked in memory (mlock on).
} // namespace

bool vis_moe_create_slabs(const llama_model & model, const vis_moe_settings & s, const attach_plan & ap, vis_moe_context & vm) {
    const int n_exp   = (int) model.hparams.n_expert;
    const int n_layer = (int) model.hparams.n_layer();
    std::map<ggml_backend_buffer_type_t, ggml_context *> ctx_of;
    for (int il : ap.managed) {
        if (ap.slots(il) >= n_exp && !ap.deferred[il]) {
            continue;  // everything fits: bypass, upstream graph
        }
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(model.dev_layer(il));
        ggml_context *& c = ctx_of[buft];
        if (!c) {
            ggml_init_params ip = { /*.mem_size =*/ ggml_tensor_overhead() * (size_t) (4 * n_layer + 8),
                                    /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ true };
            c = ggml_init(ip);
            vm.ctxs.push_back(c);
        }
        create_layer(model, il, ap, c, vm);
    }
    // a slab of a layer read from the file starts where its file tensor starts within a page: reads land in place
    std::map<const ggml_tensor *, int64_t> page_pos;
    for (const auto & L : vm.layers) {
        for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
            if (L.managed && L.file[ti] && L.slab[ti]) {
                page_pos[L.slab[ti]] = (int64_t) (L.file[ti]->offs % (uint64_t) VIS_DIO_ALIGN);
            }
        }
    }
    bool locked = true;
    for (auto & [buft, c] : ctx_of) {
        if (model.hparams.no_alloc) {
            // upstream's --fit probe: a dummy buffer, as its own weights and KV cache get there.  A real one was
            // allocated, zeroed and locked, then freed: with --moe-slots that churned the slabs' size through memory
            // before the real load, and the run after it read and computed 1.3x slower (48-layer model, replayed
            // trace, 4 GiB: decode 5.9 against 7.8 tok/s with -fit off; docs/benchmarks.md#stop-39)
            ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, 0);
            if (!buf) {
                throw std::runtime_error(std::string("vis-moe: no buffer of ") + ggml_backend_buft_name(buft));
            }
            for (ggml_tensor * t = ggml_get_first_tensor(c); t; t = ggml_get_next_tensor(c, t)) {
                t->buffer = buf;
            }
            vm.bufs.push_back(buf);
            locked = false;
            continue;
        }
        ggml_backend_buffer_t buf = vis_dio_alloc_tensors(c, buft, [&](const ggml_tensor * t) {
            const auto it = page_pos.find(t);
            return it == page_pos.end() ? (int64_t) -1 : it->second;
        });
        if (!buf) {
            throw std::runtime_error(std::string("vis-moe: failed to allocate the expert slabs in ") + ggml_backend_buft_name(buft) +
                                     "; lower --moe-slots / --moe-cache-mib / --moe-mem");
        }
        // the staging slot (if any) and the padding hold finite zeros; with the online controller the slabs are
        // made for its most slots and only the active ones become resident: their pages are dropped, not written
        // (the encoder release alike; borrowed slots fault every slot right after, vis_moe_borrow_attach)
        const bool limited = ap.online_min_slots > 0 || ap.encoder_held_slots > 0 || ap.borrow_base_slots > 0;
        if (limited) {
            vis_buffer_clear_lazy(buf);
        } else {
            ggml_backend_buffer_clear(buf, 0);
        }
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        vm.slab_bytes += (int64_t) ggml_backend_buffer_get_size(buf);
        if (limited && ggml_backend_buffer_is_host(buf)) {
            locked = false;  // locking would make every slot resident; the controller releases the inactive ones
        } else if (s.tier.mlock && ggml_backend_buffer_is_host(buf)) {
            locked = vis_mlock_region(ggml_backend_buffer_get_base(buf), ggml_backend_buffer_get_size(buf), "the expert slabs") && locked;
        } else if (s.tier.mlock) {
            locked = false;
        }
        vm.bufs.push_back(buf);
    }
    std::vector<ggml_backend_dev_t> device_slabs(vm.layers.size(), nullptr);  // per layer: a device the CPU cannot write
    for (int il : ap.managed) {
        vis_moe_layer & L = vm.layers[il];
        if (!L.managed) {
            continue;
        }
        const bool writable = vis_cpu_writable(L.any_slab()->buffer, model.dev_layer(il));
        L.direct_write = L.deferred && vm.unified && writable;
        // background reads stage unless the slabs are plain host memory: device memory, or managed memory that
        // the CPU may write only between kernels (no concurrent managed access, jetson/README.md)
        L.bg_staged = !L.direct_write || !ggml_backend_buffer_is_host(L.any_slab()->buffer);
        device_slabs[il] = writable ? nullptr : model.dev_layer(il);
    }
    vis_moe_attach_uploads(vm, device_slabs, s.pin_mib, (size_t) ap.exp_max, model.hparams.no_alloc);
    return locked;
}

// step 5: the resident weights are mapped file pages: under memory pressure the kernel would drop them and fault
// them back in every token (mmap thrash).  Lock them, tensor by tensor (mapped ranges also span deferred experts,
// which must stay out of memory), as far as the plan has room for them: the `pageable` bytes it could not fit stay
// unlocked, so the kernel can reclaim them instead of killing us.
void vis_moe_lock_resident_weights(const llama_model & model, const attach_plan & ap, vis_moe_context & vm) {
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    size_t n_locked = 0, n_skipped = 0;
    bool ok = true;
    for (const auto & [name, t] : model.tensors_by_name) {
        if (!t->buffer || !ggml_backend_buffer_is_host(t->buffer) || !t->data || vis_moe_deferred(t) || vis_moe_row_gathered(model, t)) {
            continue;
        }
        const uintptr_t a = (uintptr_t) t->data & ~(uintptr_t) (page - 1);
        const uintptr_t b = ((uintptr_t) t->data + ggml_nbytes(t) + page - 1) & ~(uintptr_t) (page - 1);
        if (n_skipped < (size_t) ap.pageable) {
            n_skipped += ggml_nbytes(t);  // left unlocked until the plan's pageable bytes are covered
            continue;
        }
        ok = vis_mlock_region((void *) a, b - a, "the resident weights") && ok;
        n_locked += b - a;
    }
    if (ok && n_locked > 0) {
        LLAMA_LOG_INFO("vis-moe: locked %.2f MiB of resident weights in memory\n", n_locked / 1048576.0);
    }
    if (n_skipped > 0) {
        char msg[320];
        std::snprintf(msg, sizeof(msg), "the memory budget cannot hold all resident weights next to the minimal "
                      "slabs: %.2f MiB of them stay unlocked and are re-read from the file whenever the kernel "
                      "drops them (slow); a budget of %.0f MiB or more keeps them locked",
                      n_skipped / 1048576.0, (vm.plan_budget + ap.pageable) / 1048576.0);
        vm.note(msg);
    }
}
