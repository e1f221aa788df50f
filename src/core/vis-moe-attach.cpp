// vis-moe-attach.cpp - creating a context's expert cache: which layers are managed,
// how many slots they get (--moe-slots, --moe-cache-mib or the --moe-mem plan),
// the slabs, the paging tiers and what gets locked in memory.
#include "vis-moe.h"
#include "vis-moe-attach-plan.h"
#include "vis-moe-attach-slabs.h"
#include "vis-moe-attach-upload.h"
#include "vis-moe-borrow.h"
#include "vis-moe-encoder.h"
#include "vis-moe-encoder-release.h"
#include "vis-moe-capacity.h"
#include "vis-moe-context.h"
#include "vis-moe-passes.h"
#include "vis-moe-lend.h"
#include "vis-moe-stage.h"
#include "vis-moe-fetch.h"  // vis_moe_context's members, destroyed if creation throws
#include "vis-moe-prefetch.h"
#include "vis-moe-precision.h"
#include "vis-moe-replay.h"
#include "vis-moe-modality.h"
#include "vis-moe-named-files.h"
#include "vis-moe-online.h"
#include "vis-pages.h"
#include "vis-moe-shadow.h"
#include "vis-moe-settings.h"
#include "vis-moe-mode.h"
#include <cstdio>
#include "vis-moe-substitute.h"
#include "vis-moe-status.h"
#include "vis-moe-telemetry.h"
#include "vis-moe-topk.h"
#include "vis-moe-trace.h"
#include "vis-moe-upload.h"
#include "vis-error.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include <sys/resource.h>
#include <unistd.h>

std::array<ggml_tensor *, VIS_T_COUNT> vis_moe_expert_tensors(const llama_layer & l) {
    return { l.ffn_gate_exps, l.ffn_up_exps, l.ffn_down_exps, l.ffn_gate_up_exps };
}

namespace {

using attach_plan = vis_moe_attach_plan;

// step 3a: --moe-cache-mib: slots from a slab budget
void size_from_cache_mib(const vis_moe_settings & s, int n_exp, attach_plan & ap) {
    // shadow slots share the budget: paired with the full slots (auto), or a fixed number taken off the top
    const int64_t fixed = ap.shadow_slots > 0 ? (int64_t) ap.shadow_slots * ap.shadow_per_slot : 0;
    const int64_t unit  = ap.per_slot + (ap.shadow_slots > 0 ? 0 : ap.shadow_per_slot);
    const int64_t slots_total = std::max<int64_t>(0, (s.params.cache_mib << 20) - fixed) / unit;  // includes the staging slot
    ap.n_slots = (int) std::min<int64_t>(slots_total - ap.staging, n_exp);
    ap.planned = true;
    if (ap.n_slots < 1) {
        const double need = ((double) unit * (1 + ap.staging) + (double) fixed) / (1 << 20);
        throw std::runtime_error("--moe-cache-mib " + std::to_string(s.params.cache_mib) + " is too small: the " +
                                 std::to_string(ap.managed.size()) + " managed layers need at least " +
                                 std::to_string((int64_t) std::ceil(need)) + " MiB (one slot" +
                                 (ap.staging ? " + 1 staging slot" : "") + (ap.shadow_per_slot ? " and their shadow slots" : "") +
                                 " each); raise it or pin fewer layers");
    }
}

// step 3b: --moe-mem: split one budget over resident weights, KV cache, compute, slabs and the host cache
void size_from_memory_plan(const llama_context * lctx, const llama_model & model, const vis_moe_settings & s,
                           attach_plan & ap, vis_moe_context & vm) {
    // the request the check before the KV cache asked (vis_moe_check_kv), now with the KV cache allocated
    const llama_vis_moe_plan_request rq = vis_moe_plan_request(model, s, ap, lctx ? (int64_t) lctx->n_ubatch() : 512,
                                                               vis_moe_kv_bytes(lctx));
    struct llama_vis_moe_plan plan;  // "struct": the function has the same name
    if (llama_vis_moe_plan(&rq, &plan) != 0 || !plan.ok) {
        throw std::runtime_error(std::string("--moe-mem ") + (s.tier.mem_mib < 0 ? "auto" : std::to_string(s.tier.mem_mib)) +
                                 ": " + llama_vis_last_error());
    }
    ap.n_slots    = plan.n_slots;
    ap.host_bytes = plan.host_bytes;
    ap.pageable   = plan.pageable_bytes;
    std::string suffix;  // the plan line's: the online controller's slots, the encoder release's
    if (s.plan.online > 0) {
        // the online controller (vis-moe-online.h): the KV cache priced at its admission floor, one sequence of the
        // asked context; the slabs made for the slots that leaves, the controller shrinks them as the KV cache grows
        if (!ap.cpu_only) {
            throw std::runtime_error("VIS_MOE_ONLINE=on: the KV cache or the slabs are on a GPU, whose memory the "
                                     "controller cannot release page by page; run on the CPU or unset VIS_MOE_ONLINE");
        }
        llama_vis_moe_plan_request rq2 = rq;
        rq2.kv_bytes = rq.kv_bytes / std::max<int64_t>(1, lctx ? (int64_t) llama_n_seq_max(lctx) : 1);
        struct llama_vis_moe_plan p2;
        if (llama_vis_moe_plan(&rq2, &p2) == 0 && p2.ok && p2.n_slots >= plan.n_slots) {
            ap.online_min_slots = plan.n_slots;
            ap.online_fixed     = p2.fixed_bytes - rq2.kv_bytes + p2.host_bytes;
            ap.n_slots          = p2.n_slots;
            ap.host_bytes       = p2.host_bytes;
            char line[240];
            std::snprintf(line, sizeof(line), "; online controller: KV priced at its floor %.0f MiB (one sequence of "
                          "%.0f), slabs for %d slots, %d..%d active", rq2.kv_bytes / 1048576.0, rq.kv_bytes / 1048576.0,
                          p2.n_slots, plan.n_slots, p2.n_slots);
            suffix = line;
        }
    }
    if (s.plan.encoder_release > 0 && rq.encoder_bytes > 0) {
        // the slots once the encoder is freed: the plan without it.  Where the floor left resident weights pageable,
        // that plan gives them the encoder's bytes first: they stay unlocked, the page cache gets the room
        llama_vis_moe_plan_request rq3 = rq;
        rq3.encoder_bytes = 0;
        struct llama_vis_moe_plan p3;
        const int without = llama_vis_moe_plan(&rq3, &p3) == 0 && p3.ok && p3.pageable_bytes == 0 ? p3.n_slots : 0;
        suffix += vis_moe_encoder_release_plan(s, ap, without, rq.encoder_bytes, (int) model.hparams.n_expert);
    }
    ap.planned    = s.params.n_slots <= 0;
    suffix += vis_moe_borrow_plan(model, s, ap, rq, plan, lctx ? (int64_t) lctx->n_ubatch() : 512);
    // the bytes left after whole slot rows: one more slot in some layers (vis_moe_apply_slot_split), unless a
    // controller scales every layer's slots together (online, encoder release: their plans are even)
    if (ap.borrow_base_slots <= 0) {
        ap.extra_slots = s.plan.online > 0 || ap.encoder_held_slots > 0 ? 0 : plan.extra_slots;
    }
    // the line shows the asked ubatch's plan (borrowed slots: the suffix names the slabs' size)
    const int shown_extra = ap.borrow_base_slots > 0 ? plan.extra_slots : ap.extra_slots;
    const std::string extra = shown_extra > 0 ? " + 1 in " + std::to_string(shown_extra) : "";
    vm.plan_budget  = plan.budget;
    vm.plan_reserve = rq.reserve_bytes;
    vm.plan_encoder = rq.encoder_bytes;
    vm.plan_free    = std::max<int64_t>(0, plan.budget - plan.fixed_bytes - plan.slab_bytes - plan.host_bytes);
    llama_vis_mem_info mi;
    llama_vis_mem_probe(&mi);
    if (s.tier.mem_mib > 0 && plan.budget < (s.tier.mem_mib << 20)) {
        // seen without -v and under llama-bench (issue #25: "clamped, with a line"); repeated in the stats footer
        vm.notes.push_back("--moe-mem " + std::to_string(s.tier.mem_mib) + " exceeds what this process may hold (" +
                           (mi.cgroup_limit > 0 && mi.cgroup_limit <= mi.mem_total
                                ? "cgroup v" + std::to_string(mi.cgroup_version) + " limit" : std::string("MemTotal")) +
                           "): planned for " + std::to_string(plan.budget >> 20) + " MiB instead");
        vis_tell_user(vm.notes.back());
    }
    if (s.tier.mem_mib < 0) {
        vm.plan_source = mi.cgroup_limit > 0 && mi.cgroup_limit <= plan.budget
            ? "auto: cgroup v" + std::to_string(mi.cgroup_version) + " limit" : std::string("auto: MemAvailable");
    } else {
        vm.plan_source = "--moe-mem";
    }
    LLAMA_LOG_INFO("vis-moe: memory plan: budget %.0f MiB = resident %.0f + KV %.0f + compute/runtime %.0f%s + I/O "
                   "buffers %.1f + slabs %.0f (%d slots x %zu layers%s) + host cache %.0f MiB%s\n", plan.budget / 1048576.0,
                   rq.resident_bytes / 1048576.0, rq.kv_bytes / 1048576.0, rq.reserve_bytes / 1048576.0,
                   vis_moe_encoder_line(rq.encoder_bytes).c_str(), rq.io_bytes / 1048576.0,
                   (plan.slab_bytes - (int64_t) (plan.extra_slots - shown_extra) * rq.expert_bytes) / 1048576.0,
                   plan.n_slots, ap.managed.size(), extra.c_str(), plan.host_bytes / 1048576.0, suffix.c_str());
}

// step 3: slots per managed layer and the host-cache bytes
void size_slots(const llama_context * lctx, const llama_model & model, const vis_moe_settings & s, attach_plan & ap,
                vis_moe_context & vm) {
    const int n_exp = (int) model.hparams.n_expert;
    const int k     = vm.n_expert_used;
    ap.n_slots    = s.params.n_slots;
    ap.host_bytes = s.tier.host_mib > 0 ? (s.tier.host_mib << 20) : 0;
    if (s.params.cache_mib > 0 && !ap.managed.empty()) {
        size_from_cache_mib(s, n_exp, ap);
    } else if (s.tier.mem_mib != 0 && !ap.managed.empty() && model.hparams.no_alloc) {
        ap.n_slots = s.params.n_slots > 0 ? s.params.n_slots : k;  // a memory-fit probe (--fit): nothing loaded, nothing to plan
    } else if (vis_moe_uses_memory_plan(model, s, ap)) {
        // with no managed layer (--moe-pinned-layers -1, --moe-slots >= experts) the plan has nothing to page and
        // checks that all of it fits (pyvis plan asks the same question)
        size_from_memory_plan(lctx, model, s, ap, vm);
        ap.n_slots = std::max(ap.n_slots, s.params.n_slots);  // a plan with nothing to page gives n_expert
    } else if (ap.n_slots <= 0) {
        ap.n_slots = n_exp;  // deferred layers with the cache off: every expert gets a slot
    }
    if (ap.n_slots < 1) {
        throw std::runtime_error("--moe-slots " + std::to_string(ap.n_slots) + ": valid range 1.." + std::to_string(n_exp) +
                                 " (0 = off)");
    }
    if (ap.n_slots < k && !ap.managed.empty()) {
        // exact all the same: every step runs its experts in passes of n_slots
        char msg[320];
        std::snprintf(msg, sizeof(msg), "%d slot%s per layer%s, below the model's top-k (%d): each decode step runs %d "
                      "passes per managed layer and reads most routed experts again%s", ap.n_slots, ap.n_slots == 1 ? "" : "s",
                      ap.planned ? " fit the budget" : "", k, (k + ap.n_slots - 1) / ap.n_slots,
                      ap.planned ? "; a larger budget gives top-k slots" : "");
        const std::string more = ap.extra_slots > 0 ? " (" + std::to_string(ap.extra_slots) + " layers get one more " +
                                                          "from the bytes left over)" : "";
        vm.note(msg + more);
    }
    const std::string split = vis_moe_apply_slot_split(model, s, ap);  // throws on a file for another model
    for (size_t a = 0; a < split.size();) {
        const size_t b = std::min(split.find('\n', a), split.size());
        LLAMA_LOG_INFO("vis-moe: %s\n", split.substr(a, b - a).c_str());
        a = b + 1;
    }
}

void log_summary(const vis_moe_settings & s, const attach_plan & ap, const vis_moe_context & vm, int n_exp) {
    if (vm.n_managed > 0) {
        LLAMA_LOG_INFO("vis-moe: expert cache: %d of %zu MoE layers managed (%d pinned), %d slots%s of %d experts each, "
                       "slabs %.2f MiB\n", vm.n_managed, ap.moe_layers.size(), ap.pinned, std::min(ap.n_slots, n_exp),
                       ap.layer_slots.empty() ? "" : " on average", n_exp, vm.slab_bytes / 1048576.0);
        if (ap.any_deferred) {
            LLAMA_LOG_INFO("vis-moe: tiers: slabs %.2f MiB (%s) | host cache %.2f MiB (%s) | file: %s, %d I/O threads%s\n",
                           vm.slab_bytes / 1048576.0, vm.unified ? "filled straight from the file" : "filled through a staging buffer",
                           (vm.host ? vm.host->capacity_blocks() * vm.host->block_bytes() : 0) / 1048576.0,
                           vm.host ? (vm.host_exclusive ? "exclusive of the slabs" : "inclusive") : "off",
                           s.tier.direct_io == 0 ? "buffered reads, pages dropped" : "O_DIRECT where allowed",
                           s.tier.io_threads, vm.locked ? ", memory locked" : "");
        }
    } else if (s.cache_on()) {
        LLAMA_LOG_INFO("vis-moe: expert cache: every MoE layer fits (%d slots >= %d experts, or pinned); upstream graph\n",
                       ap.n_slots, n_exp);
    }
}

vis_owned<vis_moe_context> attach(const llama_context * lctx, const llama_model & model) {
    vis_moe_settings s = vis_moe_settings_current();
    const auto & hp = model.hparams;
    attach_plan ap;
    vis_moe_find_moe_layers(model, ap);
    bool whole_fits = false;  // --moe-mem and the whole model fits: no cache
    if (vis_moe_runs_whole(s, ap, model)) {
        whole_fits = true;
        // the loader found that the whole model fits the budget (vis_moe_settings_model_fits), or the model was
        // loaded without the cache: every expert is in memory already, so upstream's path is the fastest exact one
        if (!hp.no_alloc) {  // not for the --fit probe: one line per run
            LLAMA_LOG_INFO("vis-moe: --moe-mem: the whole model fits the memory budget; running upstream's path "
                           "(no expert cache, weights loaded and repacked as upstream does)\n");
        }
        s.tier.mem_mib = 0;
    }
    {
        // --moe-mode fast: its lossy mechanisms, unless a flag chose them (vis-moe-mode.h); one line per run
        const std::string line = vis_moe_mode_resolve(s, (int) hp.n_expert_used_max());
        if (!line.empty() && !hp.no_alloc) {
            // straight to stderr, as the replay warning: llama-cli and llama-bench silence the llama log
            std::fprintf(stderr, "%s\n", line.c_str());
            std::fflush(stderr);
        }
    }
    // the fit probe (--fit) creates contexts on a model without data: it never writes a trace
    const bool tracing = !s.trace_path.empty() && !hp.no_alloc;
    if (!s.cache_on() && !ap.any_deferred && s.tier.host_mib > 0) {
        vis_tell_user("--moe-host-mib " + std::to_string(s.tier.host_mib) + " ignored: the host cache sits below the "
                      "expert slots, which are off; add --moe-mem, --moe-slots or --moe-cache-mib");
    }
    if (!s.cache_on() && !ap.any_deferred && s.sub.on() && !hp.no_alloc) {
        vis_tell_user("--moe-substitute ignored: it serves misses of the expert cache, which is off; add --moe-mem, "
                      "--moe-slots or --moe-cache-mib");
    }
    if (!s.cache_on() && !ap.any_deferred && (!s.prec.shadow.empty() || s.prec.on()) && !hp.no_alloc) {
        const std::string what = (s.prec.shadow.empty() ? std::string() : "--moe-shadow " + s.prec.shadow) +
                                 (s.prec.on() ? (s.prec.shadow.empty() ? "--moe-precision" : " and --moe-precision") : "");
        vis_tell_user(what + " ignored: shadows are for the managed layers of the expert cache, which is " +
                      (whole_fits ? "not used: the whole model fits the memory budget"
                                  : "off; add --moe-mem, --moe-slots or --moe-cache-mib"));
    }
    const int n_used = vis_moe_topk_attach(s, model);  // throws on N above the model's k
    const bool topk  = n_used < (int) hp.n_expert_used_max();
    // VIS_MOE_REPLAY (vis-moe-replay.h): a benchmark knob; with every cache feature off the context still gets an
    // object, with no managed layer, whose only graph change is the replay ops (the upstream-path baseline)
    const bool replaying = !s.replay_path.empty() && !hp.no_alloc;
    if (replaying && hp.n_expert == 0) {
        throw std::runtime_error("VIS_MOE_REPLAY: " + s.replay_path + ": the model has no routed experts to replay "
                                 "routing on (unset VIS_MOE_REPLAY)");
    }
    const bool csv = !s.csv_path.empty() && !hp.no_alloc;  // --moe-csv: rows even on upstream's path (a baseline)
    if (!s.cache_on() && !ap.any_deferred && !tracing && !topk && !replaying && !csv) {
        return nullptr;  // feature off: no object, no graph change
    }
    if (hp.n_expert == 0) {
        vis_tell_user("the model has no routed experts; --moe-* options ignored");
        return nullptr;
    }
    vis_owned<vis_moe_context> vm(new vis_moe_context());
    vm->model         = &model;
    vm->params        = s.params;
    vm->tier          = s.tier;
    vm->stream_passes = s.stream_passes;
    vm->n_expert_used = n_used;
    vm->topk          = topk ? n_used : 0;
    if (topk && !hp.no_alloc) {
        vis_moe_topk_note(*vm, (int) hp.n_expert_used_max());
    }
    vm->layers.resize(hp.n_layer());
    if (replaying) {
        vm->replay = vm->add(std::make_unique<vis_moe_replay>(s.replay_path, ap.moe_layers, (int) hp.n_layer(),
                                                              (int) hp.n_expert, (int) hp.n_expert_used_max(), n_used,
                                                              llm_arch_name(model.arch)));  // throws on a bad or mismatched trace
    }

    ap.policy = s.policy;
    vis_moe_choose_managed(model, s, ap);
    if (!ap.unpaged.empty() && !hp.no_alloc && (s.cache_on() || ap.any_deferred)) {
        vis_tell_user(vis_moe_unpaged_line(model, ap));
    }
    // the sidecar first (header and tensor table only): with --moe-precision on its slots share the budget
    vm->shadow = vm->add(vis_moe_plan_shadow(model, s, ap));
    vm->unified = s.tier.unified != 0 && ap.all_host_devices;
    size_slots(lctx, model, s, ap, *vm);
    bool locked = vis_moe_create_slabs(model, s, ap, *vm);
    if (ap.borrow_base_slots > 0 && !hp.no_alloc && vm->n_managed > 0) {
        // its base slots faulted and locked now, before the resident weights fill the memory cgroup: memory faulted
        // at the limit is pages its reclaim frees one by one, and O_DIRECT reads into them were measured slower
        // (docs/planning.md#stop-42-the-borrowed-slots-pages-were-physically-scattered-found-and-fixed)
        vis_moe_borrow_attach(*vm, lctx, model, ap.borrow_base_slots, ap.n_slots, lctx ? (int64_t) lctx->n_ubatch() : 512,
                              ap.per_slot, ap.pageable, s.tier.mlock != 0);
        locked = vm->locked;
    }
    if (vm->n_managed > 0 && ap.any_deferred) {
        vm->io = std::make_unique<vis_io_pool>(s.tier.io_threads, s.tier.direct_io);
        vm->overlap = s.overlap < 0 ? n_used : s.overlap;  // VIS_MOE_OVERLAP: on = up to k miss passes
        if (s.tier.mlock && !hp.no_alloc) {
            vis_moe_lock_resident_weights(model, ap, *vm);
        }
    }
    if (vm->n_managed > 0 && ap.any_deferred && !hp.no_alloc) {
        vis_moe_log_unified(model, ap.managed, s.tier.unified, ap.all_host_devices, *vm);
    }
    if (vm->n_managed > 0 && ap.host_bytes > 0 && ap.n_slots < (int) hp.n_expert && !hp.no_alloc) {
        // pinned on a discrete GPU within the cap (--moe-pin-mib), else anonymous memory as before
        vm->host = vis_moe_make_host_cache(*vm, (size_t) ap.host_bytes, (size_t) ap.exp_max, s.tier.mlock != 0);
        vm->host_exclusive = vm->unified;
        locked = locked && vm->host->locked();
    }
    vm->locked = s.tier.mlock && locked && vm->n_managed > 0;
    rusage ru = {};
    getrusage(RUSAGE_SELF, &ru);
    vm->majflt0 = vm->majflt_last = ru.ru_majflt;
    if (tracing) {
        vm->trace = vm->add(std::make_unique<vis_moe_trace>(s.trace_path, hp.n_layer(), hp.n_expert, (uint32_t) vm->n_expert_used));
    }
    if (!hp.no_alloc) {  // not for the --fit probe: the real attach says it
        log_summary(s, ap, *vm, (int) hp.n_expert);
    }
    if (s.sub.on() && !hp.no_alloc) {
        vis_moe_substitute_attach(*vm, model, s, ap.any_deferred);  // throws on a bad profile or combination
    }
    if (s.predict.on() && !hp.no_alloc) {
        vis_moe_prefetch_attach(*vm, model, s, ap.any_deferred);
    }
    if (!s.prec.shadow.empty() && !hp.no_alloc) {
        vis_moe_shadow_attach(*vm, s.prec.shadow, s.prec.on());  // the log line of the sidecar loaded above
    }
    if (s.prec.on() && !hp.no_alloc && ap.pageable > 0 && vm->shadow) {
        // the plan is at its floor (resident weights left pageable): shadow slabs would be memory it does not have
        // (measured: OOM-killed at 12.5 % of a 5.7 GB model, docs/precision-speed.md)
        vm->note("--moe-precision: the memory budget cannot hold the resident weights next to the minimal slabs, so "
                 "there is no room for shadow slots: precision is off for this context (raise --moe-mem)");
    } else if (s.prec.on() && !hp.no_alloc) {
        // the shadow slots and the policy; throws without a sidecar
        vis_moe_precision_attach(*vm, s, ap.shadow_slots > 0 ? ap.shadow_slots : std::min(ap.n_slots, (int) hp.n_expert),
                                 ap.any_deferred);
    }
    if (s.cap.on() && !hp.no_alloc) {
        vis_moe_capacity_attach(*vm, model, s);  // throws on a bad modality profile
    }
    if (ap.encoder_held_slots > 0 && !hp.no_alloc && vm->n_managed > 0) {
        // before the staging, which fits its buffers to the memory held until the encoder is freed
        vis_moe_encoder_release_attach(*vm, ap.encoder_held_slots, ap.n_slots, vm->plan_encoder, ap.per_slot);
    }
    if (!hp.no_alloc && ap.any_deferred && ap.cpu_only) {
        vis_moe_stage_attach(*vm, s);  // before the read-ahead's one-worker fetcher: staging wants --moe-io-threads
    }
    vm->stream_ahead = s.stream_ahead && s.stream_passes > 0 && ap.any_deferred && vm->n_managed > 0 && !hp.no_alloc;
    if (vm->stream_ahead && !vm->fetch) {
        vm->fetch = std::make_unique<vis_moe_fetcher>(1, s.tier.direct_io);
    }
    if (!hp.no_alloc) {
        vis_moe_lend_decide(*vm, s.stream_lend, vm->plan_budget > 0 ? vm->plan_free : -1);
    }
    if (s.plan.online > 0 && !hp.no_alloc && vm->n_managed > 0) {
        if (ap.online_min_slots <= 0) {
            throw std::runtime_error("VIS_MOE_ONLINE=on needs a --moe-mem budget to move bytes within (slots from "
                                     "--moe-slots or --moe-cache-mib are fixed); add --moe-mem or unset VIS_MOE_ONLINE");
        }
        vis_moe_online::plan op;
        op.budget    = vm->plan_budget;
        op.fixed     = ap.online_fixed;
        op.row_bytes = ap.per_slot;
        op.min_slots = ap.online_min_slots;
        op.max_slots = ap.n_slots;
        op.n_ubatch  = lctx ? (int64_t) lctx->n_ubatch() : 512;
        vis_moe_online_attach(*vm, lctx, op);  // throws where it cannot work
    }
    if (vm->n_managed > 0 && !hp.no_alloc) {
        for (const auto & [name, t] : model.tensors_by_name) {
            if (t->buffer && std::strstr(ggml_backend_buffer_name(t->buffer), "REPACK")) {
                // docs/paging.md#weight-layouts: the repacked kernels round differently from the plain ones
                LLAMA_LOG_INFO("vis-moe: resident weights are repacked for this CPU (%s), managed layers compute on "
                               "the file's plain layout: their output matches upstream with --no-repack\n",
                               ggml_backend_buffer_name(t->buffer));
                break;
            }
        }
    }
    if (vm->n_managed == 0 && !vm->trace && !vm->topk && !vm->replay && !csv) {
        return nullptr;
    }
    if (!hp.no_alloc) {
        if (!s.csv_path.empty() && s.csv_path == s.trace_path) {
            throw std::runtime_error("--moe-csv: '" + s.csv_path + "' is also the --moe-trace file; give each its own file");
        }
        vm->telemetry = vm->add(std::make_unique<vis_moe_telemetry>(  // throws on a refused --moe-csv file
            s.csv_path, vis_moe_run_inputs(*vm, s), vis_moe_status_wanted(vm->params.print_stats != 0, STDERR_FILENO),
            vis_moe_lossy_what(*vm), vis_moe_props_json(*vm, vis_moe_kv_bytes(lctx)), vis_moe_counters_now(*vm)));
    }
    return vm;
}

} // namespace

vis_owned<vis_moe_context> vis_moe_context_attach(const llama_context * lctx, const llama_model & model) {
    try {
        auto vm = attach(lctx, model);
        if (!model.hparams.no_alloc) {  // not for the --fit probe
            vis_moe_check_named_files(vis_moe_settings_current(), model, vm.get());
        }
        return vm;
    } catch (const std::exception & e) {
        vis_set_last_error(e.what());
        LLAMA_LOG_ERROR("%s\n", e.what());
        throw;
    }
}
