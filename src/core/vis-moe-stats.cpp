// vis-moe-stats.cpp - per-layer and per-tier stats of the expert cache, and the
// --moe-stats table (stderr), behind the stats half of the C API (llama-vis.h).
// Each feature prints and resets its own section (vis_moe_feature::stats_print, stats_reset); the C getters of
// a feature's struct ask that feature (its totals function), zeros when it is off.
#include "vis-moe-context.h"
#include "vis-moe-passes.h"
#include "vis-moe-capacity.h"
#include "vis-moe-precision.h"
#include "vis-moe-prefetch.h"
#include "vis-moe-substitute.h"
#include "vis-error.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>

#include <sys/resource.h>

void vis_moe_total_stats(const vis_moe_context & vm, llama_vis_moe_stats & tot) {
    tot = {};
    for (const auto & L : vm.layers) {
        const auto & s = L.stats;
        tot.n_slots = std::max(tot.n_slots, s.n_slots);
        tot.managed |= s.managed;
        tot.n_routed += s.n_routed;
        tot.n_hits += s.n_hits;
        tot.n_misses += s.n_misses;
        tot.bytes_loaded += s.bytes_loaded;
        tot.load_us += s.load_us;
        tot.n_calls += s.n_calls;
        tot.n_passes += s.n_passes;
    }
}

static int64_t rss_peak_bytes() {
    FILE * f = std::fopen("/proc/self/status", "r");
    if (!f) {
        return -1;
    }
    char line[256];
    int64_t kib = -1;
    while (std::fgets(line, sizeof(line), f)) {
        if (std::strncmp(line, "VmHWM:", 6) == 0) {
            kib = std::strtoll(line + 6, nullptr, 10);
        }
    }
    std::fclose(f);
    return kib < 0 ? -1 : kib * 1024;
}

static llama_vis_moe_io_stats io_stats(const vis_moe_context & vm) {
    llama_vis_moe_io_stats st = {};
    for (const auto & L : vm.layers) {
        st.slab_hits += L.stats.n_hits;  // one counter: the layers' hits
    }
    st.host_hits    = vm.n_host_hits;
    st.file_reads   = vm.n_file_reads;
    st.model_copies = vm.n_model_copies;
    if (vm.io) {
        const auto & c = vm.io->counters();
        st.bytes_read    = c.bytes_read;
        st.bytes_storage = c.bytes_device;
        st.bytes_copied  = c.bytes_copied;
        st.read_us       = c.wait_us;
        st.direct_io     = c.n_direct > 0 ? 1 : 0;
        st.io_threads    = vm.io->n_threads();
    }
    if (vm.host) {
        st.host_bytes     = (int64_t) (vm.host->capacity_blocks() * vm.host->block_bytes());
        st.host_used      = (int64_t) (vm.host->used_blocks() * vm.host->block_bytes());
        st.host_evictions = vm.host->n_evictions;
    }
    st.slab_bytes = vm.slab_bytes;
    st.unified    = vm.unified ? 1 : 0;
    st.locked     = vm.locked ? 1 : 0;
    rusage ru = {};
    getrusage(RUSAGE_SELF, &ru);
    st.major_faults   = ru.ru_majflt - vm.majflt0;
    st.rss_peak       = rss_peak_bytes();
    st.streamed       = vm.n_streamed;
    st.bytes_streamed = vm.bytes_streamed;
    return st;
}

// bytes not read before a layer could run, at the file read rate this context measured (0 before any read)
int64_t vis_moe_stall_saved_us(const vis_moe_context & vm, int64_t bytes_saved) {
    if (!vm.io || vm.io->counters().bytes_read <= 0) {
        return 0;
    }
    const auto & c = vm.io->counters();
    return (int64_t) ((double) bytes_saved * (double) c.wait_us / (double) c.bytes_read);
}

// the overlap stats of layer il, or their totals (il = -1)
static llama_vis_moe_overlap_stats overlap_stats(const vis_moe_context & vm, int il) {
    llama_vis_moe_overlap_stats t = {};
    const int64_t one_token = vm.n_expert_used;
    for (int i = 0; i < (int) vm.layers.size(); ++i) {
        if (il >= 0 && i != il) {
            continue;
        }
        const vis_moe_layer & L = vm.layers[i];
        const llama_vis_moe_overlap_stats & s = L.overlap.stats;
        t.max_passes = std::max(t.max_passes, L.managed ? vis_moe_overlap_passes(vm, L, one_token, false) : 0);
        t.n_ubatches += s.n_ubatches;
        t.n_reads    += s.n_reads;
        t.n_passes   += s.n_passes;
        t.wait_us    += s.wait_us;
        t.hidden_us  += s.hidden_us;
        t.n_late     += s.n_late;
    }
    return t;
}

static void print_row(const std::string & label, const std::string & slots, const llama_vis_moe_stats & s) {
    std::fprintf(stderr, "vis-moe: %5s %6s %10" PRId64 " %10" PRId64 " %10" PRId64 " %7.1f%% %12.2f %10.2f %8" PRId64 "\n",
                 label.c_str(), slots.c_str(), s.n_routed, s.n_hits, s.n_misses, s.n_routed ? 100.0 * s.n_hits / s.n_routed : 0.0,
                 s.bytes_loaded / 1048576.0, s.load_us / 1000.0, s.n_passes);
}

void vis_moe_print_stats(const vis_moe_context & vm) {
    std::fprintf(stderr, "vis-moe: expert cache stats (%d managed layers)\n", vm.n_managed);
    std::fprintf(stderr, "vis-moe: %5s %6s %10s %10s %10s %8s %12s %10s %8s\n", "layer", "slots", "routed", "hits", "misses",
                 "hit%", "MiB loaded", "stall ms", "passes");
    for (size_t il = 0; il < vm.layers.size(); ++il) {
        if (vm.layers[il].stats.managed) {
            print_row(std::to_string(il), std::to_string(vm.layers[il].stats.n_slots), vm.layers[il].stats);
        }
    }
    llama_vis_moe_stats t;
    vis_moe_total_stats(vm, t);
    print_row("total", "", t);
    for (const auto & f : vm.features) {
        f->stats_print(vm);  // each feature's own section
    }
    if (vm.ttft_us >= 0) {
        std::fprintf(stderr, "vis-moe: time to first token: %.1f ms (the last prompt: %" PRId64 " ubatch%s computed)\n",
                     vm.ttft_us / 1e3, vm.n_prompt_ubatches, vm.n_prompt_ubatches == 1 ? "" : "es");
    }
    const llama_vis_moe_overlap_stats ov = overlap_stats(vm, -1);
    if (ov.n_ubatches > 0) {
        std::fprintf(stderr, "vis-moe: overlap: %" PRId64 " misses read while their layer computed, in %" PRId64
                             " ubatch-layers (up to %d miss passes each); %.2f ms of reads hidden behind compute, "
                             "%.2f ms waited by the miss passes; %" PRId64 " issued late\n",
                     ov.n_reads, ov.n_ubatches, ov.max_passes, ov.hidden_us / 1e3, ov.wait_us / 1e3, ov.n_late);
    }
    const llama_vis_moe_io_stats io = io_stats(vm);
    if (io.file_reads == 0 && io.host_hits == 0 && !vm.io) {
        return;
    }
    const double secs = io.read_us / 1e6;
    char copied[80] = "";
    if (io.direct_io) {
        std::snprintf(copied, sizeof(copied), " | %.2f MiB of the reads copied out of bounce buffers",
                      io.bytes_copied / 1048576.0);
    }
    std::fprintf(stderr, "vis-moe: tiers: slab hits %" PRId64 " | host-cache hits %" PRId64 " | file reads %" PRId64
                         " (%.2f MiB payload, %.2f MiB from storage%s, %.2f s waiting, %.0f MiB/s) | model copies %" PRId64
                         "%s\n",
                 io.slab_hits, io.host_hits, io.file_reads, io.bytes_read / 1048576.0, io.bytes_storage / 1048576.0,
                 io.direct_io ? " with O_DIRECT" : " buffered", secs, secs > 0 ? io.bytes_read / 1048576.0 / secs : 0.0,
                 io.model_copies, copied);
    if (io.streamed > 0) {
        std::fprintf(stderr, "vis-moe: prefill streaming: %" PRId64 " experts (%.2f MiB) streamed by ubatches needing "
                             "more than %d passes (staged below, else through the mapping: pages dropped after each "
                             "layer); %" PRId64
                             " layers (%.2f MiB) read ahead while the layer before them computed\n",
                     io.streamed, io.bytes_streamed / 1048576.0, vm.stream_passes, vm.n_stream_ahead,
                     vm.bytes_stream_ahead / 1048576.0);
        if (vm.n_stream_routed + vm.n_stream_seq > 0) {
            std::fprintf(stderr, "vis-moe: streamed through the mapping: %" PRId64 " layers read just their routed "
                                 "experts (they fit the page cache's room), %" PRId64 " by sequential read-ahead "
                                 "(they did not)\n", vm.n_stream_routed, vm.n_stream_seq);
        }
    }
    std::fprintf(stderr, "vis-moe: memory: slabs %.2f MiB, host cache %.2f/%.2f MiB (%" PRId64 " evictions), %s, "
                         "peak RSS %.2f MiB, major faults %" PRId64 "\n",
                 io.slab_bytes / 1048576.0, io.host_used / 1048576.0, io.host_bytes / 1048576.0, io.host_evictions,
                 io.locked ? "locked" : "not locked", io.rss_peak / 1048576.0, io.major_faults);
    for (const auto & up : vm.uploads) {  // discrete GPU only (vis-moe-upload.h)
        const auto c = up->get_counters();
        std::fprintf(stderr, "vis-moe: uploads to %s: %s, %" PRId64 " copies (%.2f MiB) in %" PRId64 " batches, %.2f ms "
                             "waited for them; pinned %.2f MiB (cap %.0f MiB: tier 2 %.2f, staging %.2f), staging in "
                             "ordinary memory %.2f MiB\n", ggml_backend_dev_name(up->device()),
                     up->async() ? "asynchronous (upload stream, events)" : "synchronous", c.n_copies,
                     c.bytes / 1048576.0, c.n_issued, c.wait_us / 1000.0, vm.pin.used / 1048576.0, vm.pin.cap / 1048576.0,
                     vm.host ? vm.host->pinned_bytes() / 1048576.0 : 0.0, vm.staging->pinned_bytes() / 1048576.0,
                     vm.staging->plain_bytes() / 1048576.0);
    }
    if (vm.plan_budget > 0) {
        std::fprintf(stderr, "vis-moe: memory plan: budget %.0f MiB (%s)", vm.plan_budget / 1048576.0, vm.plan_source.c_str());
        if (vm.plan_encoder > 0) {
            std::fprintf(stderr, "; vision encoder %.0f MiB of it", vm.plan_encoder / 1048576.0);  // --mmproj (issue #24)
        }
        std::fprintf(stderr, "\n");
    }
    vis_moe_print_notes(vm);
}

void vis_moe_print_notes(const vis_moe_context & vm) {
    for (const auto & n : vm.notes) {
        std::fprintf(stderr, "vis-moe: %s\n", n.c_str());
    }
}

// ---- C API ---------------------------------------------------------------------
int32_t llama_vis_moe_get_stats(const llama_context * ctx, int32_t il, llama_vis_moe_stats * out) {
    vis_clear_last_error();
    const vis_moe_context * vm = vis_moe_of(ctx);
    if (!vm || !out) {
        vis_set_last_error(!out ? "llama_vis_moe_get_stats: NULL output" : "llama_vis_moe_get_stats: the context has no expert cache");
        return -1;
    }
    if (il >= 0 || il < -1) {
        if (il >= (int32_t) vm->layers.size() || il < -1) {
            vis_set_last_error("llama_vis_moe_get_stats: layer " + std::to_string(il) + " out of range -1.." +
                               std::to_string(vm->layers.size() - 1));
            return -1;
        }
        *out = vm->layers[il].stats;
        return 0;
    }
    vis_moe_total_stats(*vm, *out);
    return 0;
}

// the per-layer stats getters of the C API: layer il's (layer(vm, il)) or the totals (total(vm, out)) with il = -1
template <typename S, typename Layer, typename Total>
static int32_t get_layer_stats(const char * fn, const llama_context * ctx, int32_t il, S * out, Layer layer, Total total) {
    vis_clear_last_error();
    const vis_moe_context * vm = vis_moe_of(ctx);
    if (!vm || !out) {
        vis_set_last_error(std::string(fn) + (!out ? ": NULL output" : ": the context has no expert cache"));
        return -1;
    }
    if (il >= (int32_t) vm->layers.size() || il < -1) {
        vis_set_last_error(std::string(fn) + ": layer " + std::to_string(il) + " out of range -1.." +
                           std::to_string(vm->layers.size() - 1));
        return -1;
    }
    if (il >= 0) {
        *out = layer(*vm, il);
    } else {
        total(*vm, *out);
    }
    return 0;
}

int32_t llama_vis_moe_get_sub_stats(const llama_context * ctx, int32_t il, llama_vis_moe_sub_stats * out) {
    const int32_t r = get_layer_stats("llama_vis_moe_get_sub_stats", ctx, il, out,
        [](const vis_moe_context & vm, int l) { return vm.sub ? vm.sub->stats(l) : llama_vis_moe_sub_stats{}; }, vis_moe_total_sub_stats);
    if (r == 0) {
        out->stall_saved_us = vis_moe_stall_saved_us(*vis_moe_of(ctx), out->bytes_saved);
    }
    return r;
}

int32_t llama_vis_moe_get_prec_stats(const llama_context * ctx, int32_t il, llama_vis_moe_prec_stats * out) {
    return get_layer_stats("llama_vis_moe_get_prec_stats", ctx, il, out,
        [](const vis_moe_context & vm, int l) {
            return vm.precision ? vm.precision->stats(l) : llama_vis_moe_prec_stats{};
        }, vis_moe_total_prec_stats);
}

int32_t llama_vis_moe_get_cap_stats(const llama_context * ctx, int32_t il, llama_vis_moe_cap_stats * out) {
    return get_layer_stats("llama_vis_moe_get_cap_stats", ctx, il, out,
        [](const vis_moe_context & vm, int l) {
            return vm.capacity ? vm.capacity->stats(l) : llama_vis_moe_cap_stats{};
        }, vis_moe_total_cap_stats);
}

int32_t llama_vis_moe_get_prefetch_stats(const llama_context * ctx, int32_t il, llama_vis_moe_prefetch_stats * out) {
    const int32_t r = get_layer_stats("llama_vis_moe_get_prefetch_stats", ctx, il, out,
        [](const vis_moe_context & vm, int l) {
            return vm.prefetch ? vm.prefetch->stats(l) : llama_vis_moe_prefetch_stats{};
        }, vis_moe_total_prefetch_stats);
    if (r == 0) {
        const vis_moe_context & vm = *vis_moe_of(ctx);
        out->saved_us = vm.prefetch ? vis_moe_prefetch_saved_us(vm, *out) : 0;
    }
    return r;
}

int32_t llama_vis_moe_get_io_stats(const llama_context * ctx, llama_vis_moe_io_stats * out) {
    vis_clear_last_error();
    const vis_moe_context * vm = vis_moe_of(ctx);
    if (!vm || !out) {
        vis_set_last_error(!out ? "llama_vis_moe_get_io_stats: NULL output" : "llama_vis_moe_get_io_stats: the context has no expert cache");
        return -1;
    }
    *out = io_stats(*vm);
    return 0;
}

int32_t llama_vis_moe_get_overlap_stats(const llama_context * ctx, int32_t il, llama_vis_moe_overlap_stats * out) {
    vis_clear_last_error();
    const vis_moe_context * vm = vis_moe_of(ctx);
    if (!vm || !out || il < -1 || il >= (int32_t) vm->layers.size()) {
        vis_set_last_error(!out ? "llama_vis_moe_get_overlap_stats: NULL output"
                           : !vm ? "llama_vis_moe_get_overlap_stats: the context has no expert cache"
                                 : "llama_vis_moe_get_overlap_stats: layer " + std::to_string(il) + " is out of range");
        return -1;
    }
    *out = overlap_stats(*vm, il);
    return 0;
}

void llama_vis_moe_reset_stats(llama_context * ctx) {
    vis_moe_context * vm = vis_moe_of(ctx);
    if (!vm) {
        return;
    }
    vm->n_host_hits = vm->n_file_reads = vm->n_model_copies = 0;
    vm->n_streamed = vm->bytes_streamed = 0;
    vm->n_stream_ahead = vm->bytes_stream_ahead = 0;
    vm->n_stream_routed = vm->n_stream_seq = 0;
    vm->ttft_us = -1;
    vm->n_prompt_ubatches = 0;
    vm->in_prompt = false;
    for (auto & f : vm->features) {
        f->stats_reset();
    }
    for (auto & L : vm->layers) {
        L.overlap.stats = {};
    }
    if (vm->io) {
        vm->io->reset_counters();
    }
    if (vm->host) {
        vm->host->n_evictions = 0;
    }
    for (auto & up : vm->uploads) {
        up->reset_counters();
    }
    for (auto & L : vm->layers) {
        const int32_t n_slots = L.stats.n_slots, managed = L.stats.managed;
        L.stats = {};
        L.stats.n_slots = n_slots;
        L.stats.managed = managed;
    }
}

int32_t llama_vis_moe_n_managed(const llama_context * ctx) {
    const vis_moe_context * vm = vis_moe_of(ctx);
    return vm ? vm->n_managed : 0;
}

void llama_vis_moe_print_stats(const llama_context * ctx) {
    if (const vis_moe_context * vm = vis_moe_of(ctx)) {
        vis_moe_print_stats(*vm);
    }
}

int64_t llama_vis_moe_context_reserve(const llama_context * ctx) {
    const vis_moe_context * vm = vis_moe_of(ctx);
    return vm ? vm->plan_reserve : -1;
}

int64_t llama_vis_moe_n_failures(const llama_context * ctx) {
    const vis_moe_context * vm = vis_moe_of(ctx);
    return vm ? vm->n_failures : 0;
}

const char * llama_vis_moe_last_failure(const llama_context * ctx) {
    const vis_moe_context * vm = vis_moe_of(ctx);
    return vm ? vm->last_failure.c_str() : "";
}
