// vis-moe-context.cpp - lifetime of a context's expert cache: ownership by
// llama_context (vis-owner.h), per-ubatch bookkeeping, failures.
#include "vis-moe.h"
#include "vis-moe-context.h"
#include "vis-moe-fetch.h"
#include "vis-moe-lend.h"
#include "vis-moe-passes.h"
#include "vis-moe-stage.h"
#include "vis-moe-prefetch.h"
#include "vis-moe-precision.h"
#include "vis-moe-replay.h"
#include "vis-moe-modality.h"
#include "vis-moe-shadow.h"
#include "vis-moe-substitute.h"
#include "vis-moe-telemetry.h"
#include "vis-error.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cinttypes>
#include <set>

#include <fcntl.h>
#include <sys/resource.h>

void vis_deleter::operator()(vis_moe_context * p) const {
    delete p;
}

vis_moe_context::~vis_moe_context() {
    fetch.reset();    // first: background reads in flight write into the slabs and staging blocks freed below
    uploads.clear();  // then their copies on the upload streams (discrete GPU): each waits for its stream
    for (auto * b : bufs) {
        ggml_backend_buffer_free(b);
    }
    for (auto * c : ctxs) {
        ggml_free(c);
    }
}

vis_moe_op_ud * vis_moe_context::ud(int il, int pass, vis_op_kind kind) {
    auto & p = uds[{ il, pass, (int) kind }];
    if (!p) {
        p.reset(new vis_moe_op_ud{ this, il, pass, kind });
    }
    return p.get();
}

void vis_moe_context::note(const std::string & msg) {
    notes.push_back(msg);
    LLAMA_LOG_WARN("vis-moe: %s\n", msg.c_str());
}

void vis_moe_context::fail(const std::string & msg) {
    std::lock_guard<std::mutex> lock(err_mutex);
    if (!failed) {
        failed  = true;
        failure = msg;
    }
}

vis_moe_context * vis_moe_of(const llama_context * lctx) {
    return lctx ? lctx->vis_moe.get() : nullptr;
}

void vis_moe_context_detach(vis_owned<vis_moe_context> & vm) {
    if (vm && vm->telemetry) {
        vm->telemetry->clear_status();  // the live line goes before the exit summary
    }
    if (vm && vm->params.print_stats && vm->n_managed > 0) {
        llama_vis_moe_stats tot;
        vis_moe_total_stats(*vm, tot);
        // not for contexts that never ran (e.g. --fit probes); one whose every ubatch streamed did run
        if (tot.n_calls > 0 || vm->n_streamed > 0) {
            vis_moe_print_stats(*vm);
        }
    } else if (vm && vm->params.print_stats) {
        vis_moe_print_notes(*vm);
    }
    vm.reset();
}

bool vis_moe_context::streams(const vis_moe_layer & L, int64_t n_pairs, bool image) const {
    if (stream_passes <= 0 || !L.can_stream() || (image && vis_moe_capacity_passes(*this, L) > 0)) {
        return false;
    }
    // an image ubatch whose layers would stage their shadows (--moe-precision) streams as soon as it needs a
    // second pass: staged shadows, read in the background, beat passes whose shadow reads the compute waits for
    // (docs/precision-speed.md)
    const int limit = image && stages_shadows(L, image) ? 1 : stream_passes;
    return vis_moe_max_passes(L.n_expert, n_pairs, L.n_slots) > limit;
}

bool vis_moe_context::stages_shadows(const vis_moe_layer & L, bool image) const {
    return stage && stage->has_shadow((int) (&L - layers.data())) && vis_moe_precision_stages_shadows(*this, image);
}

int vis_moe_context::full_passes(const vis_moe_layer & L, int64_t n_pairs, bool image) const {
    const int n = vis_moe_max_passes(L.n_expert, n_pairs, L.n_slots);
    const int cap = image ? vis_moe_capacity_passes(*this, L) : 0;
    return cap > 0 ? std::min(n, cap) : n;
}

int vis_moe_context::shadow_passes(const vis_moe_layer & L, int64_t n_pairs, bool image) const {
    if (!precision || !L.shadow.on()) {
        return 0;
    }
    const int n = vis_shadow_max_passes(L, n_pairs);
    if (image && vis_moe_capacity_passes(*this, L) > 0) {
        // the capacity bounds the experts loaded to what the full passes hold: the shadows served are among them
        const int64_t most = (int64_t) full_passes(L, n_pairs, image) * L.n_slots;
        return std::min<int>(n, (int) ((most + L.shadow.n_slots - 1) / L.shadow.n_slots));
    }
    return n;
}

// the model files the layers' experts are read from
static std::set<const vis_gguf_file *> model_files(const vis_moe_context & vm) {
    std::set<const vis_gguf_file *> files;
    for (const auto & L : vm.layers) {
        for (const auto * f : L.file) {
            if (f) {
                files.insert(f->file.get());
            }
        }
    }
    return files;
}

void vis_moe_begin_ubatch(vis_moe_context * vm, const llama_ubatch & ub) {
    if (!vm) {
        return;
    }
    // a model file changed since the last ubatch (truncated, rewritten): this ubatch fails with the reason, and a
    // truncated file's mappings past its end are zero pages before the graph touches a resident tensor there
    // (vis_gguf_file::check_unchanged; one fstat per file)
    for (const vis_gguf_file * f : model_files(*vm)) {
        try {
            f->check_unchanged();
        } catch (const std::exception & e) {
            vm->fail(e.what());
        }
    }
    vm->ub_decode = ub.n_tokens <= ub.n_seqs_unq;  // one token per sequence
    if (!vm->ub_decode && !vm->in_prompt) {  // a new prompt: its time to first token starts
        vm->ttft_us = 0;
        vm->n_prompt_ubatches = 0;
    }
    vm->in_prompt = !vm->ub_decode;
    vm->ub_t0_us  = ggml_time_us();
    for (auto & L : vm->layers) {
        if (L.managed) {
            L.slots.policy().begin_step();  // the step clock of a policy that decays (lfu)
        }
    }
    if (vm->prefetch) {
        vm->prefetch->begin_ubatch(vm->ub_decode);
    }
    if (vm->trace) {
        vm->trace->begin_ubatch(ub);
    }
    if (vm->replay) {
        vm->replay->begin_ubatch(ub);
    }
    if (vm->modality) {
        vm->modality->begin_ubatch(ub, (int64_t) vm->model->hparams.n_embd_inp());
    }
    if (vm->precision) {
        vm->precision->begin_ubatch();
    }
    if (vm->telemetry) {
        vm->telemetry->begin_ubatch(vis_moe_counters_now(*vm), ub.n_tokens, vm->ub_decode);
    }
}

// after a ubatch that streamed a layer: streaming faults its experts in on purpose (not a sign of paging), and the
// read-ahead also spills past the streamed ranges: drop every unmapped page of the model files, so the page cache
// does not sit on the budget during the next steps (mapped, locked resident weights stay)
static void drop_streamed_pages(vis_moe_context & vm) {
    for (const vis_gguf_file * f : model_files(vm)) {
        posix_fadvise(f->fd, 0, 0, POSIX_FADV_DONTNEED);
    }
}

bool vis_moe_end_ubatch(vis_moe_context * vm) {
    if (!vm) {
        return true;
    }
    if (vm->trace) {
        const std::string err = vm->trace->end_ubatch();
        if (!err.empty()) {
            vm->fail(err);
        }
    }
    if (vm->prefetch) {
        vm->prefetch->end_ubatch();
        for (auto & L : vm->layers) {
            if (L.managed) {
                L.slots.policy().end_step();  // speculative horizons count down; unused reads ahead go first
            }
        }
    }
    if (vm->stage) {
        vm->stage->end_ubatch(*vm);  // a staged read still in flight: waited for, the buffers forgotten
    }
    if (vm->precision) {
        vm->precision->end_ubatch(*vm, ggml_time_us() - vm->ub_t0_us);  // the controller sees the ubatch's stalls
    }
    if (!vm->ub_decode) {
        vm->n_prompt_ubatches++;
        vm->ttft_us += ggml_time_us() - vm->ub_t0_us;
    }
    if (vm->n_managed > 0) {
        // the kernel paging our working set in and out means the budget is too large for the machine
        rusage ru = {};
        getrusage(RUSAGE_SELF, &ru);
        const int64_t d = ru.ru_majflt - vm->majflt_last;
        vm->majflt_last = ru.ru_majflt;
        if (vm->ub_streamed) {
            vm->ub_streamed = false;
            drop_streamed_pages(*vm);
            vis_moe_return_slabs(*vm);
        } else if (d >= 256 && !vm->warned_faults) {
            vm->warned_faults = true;
            LLAMA_LOG_WARN("vis-moe: %" PRId64 " major page faults in one ubatch: the system is paging our working set "
                           "(swap or evicted mmap pages); lower --moe-mem / --moe-slots / --moe-host-mib or use --moe-mem auto\n", d);
        }
    }
    if (vm->telemetry) {
        const std::string err = vm->telemetry->end_ubatch(vis_moe_counters_now(*vm));  // last: the whole ubatch
        if (!err.empty()) {
            vm->fail(err);
        }
    }
    std::lock_guard<std::mutex> lock(vm->err_mutex);
    if (vm->failed) {
        vis_set_last_error(vm->failure);
        LLAMA_LOG_ERROR("%s\n", vm->failure.c_str());
        vm->failed = false;
        vm->n_failures++;
        vm->last_failure = vm->failure;
        return false;
    }
    vm->last_failure.clear();
    return true;
}
