// vis-moe-context.cpp - lifetime of a context's expert cache: ownership by
// llama_context (vis-owner.h), per-ubatch bookkeeping, failures.
// The features (vis-moe-feature.h) are reached through their interface only: no feature header here.
#include "vis-moe.h"
#include "vis-moe-context.h"
#include "vis-moe-fetch.h"
#include "vis-error.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cinttypes>
#include <set>
#include <stdexcept>

#include <fcntl.h>
#include <sys/resource.h>

void vis_deleter::operator()(vis_moe_context * p) const {
    delete p;
}

vis_moe_context::~vis_moe_context() {
    fetch.reset();     // first: background reads in flight write into the slabs and staging blocks freed below
    features.clear();  // then the features (a staged read in flight writes into the slabs too)
    io.reset();        // then overlapped reads still under way (an aborted compute): they write into the slabs
    uploads.clear();   // then their copies on the upload streams (discrete GPU): each waits for its stream
    for (auto * b : bufs) {
        ggml_backend_buffer_free(b);
    }
    for (auto * c : ctxs) {
        ggml_free(c);
    }
}

vis_moe_op_ud * vis_moe_op_uds::get(int il, int pass, vis_op_kind kind) {
    auto & p = uds[{ il, pass, (int) kind }];
    if (!p) {
        p.reset(new vis_moe_op_ud{ vm, il, pass, kind });
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

int vis_moe_context::image_pass_bound(const vis_moe_layer & L) const {
    int bound = 0;
    for (const auto & f : features) {
        const int b = f->image_pass_bound(*this, L);
        bound = b > 0 && (bound == 0 || b < bound) ? b : bound;
    }
    return bound;
}

void vis_moe_context_detach(vis_owned<vis_moe_context> & vm) {
    if (vm) {
        for (auto & f : vm->features) {
            f->detach(*vm);  // telemetry: the live line goes before the exit summary
        }
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

void vis_moe_prepare_ubatch(vis_moe_context * vm, const llama_ubatch & ub) {
    if (!vm) {
        return;
    }
    for (auto & f : vm->features) {
        try {
            f->ubatch_prepare(*vm, ub);
        } catch (const std::exception & e) {
            vm->fail(e.what());  // a background read that failed while a limit collected it
        }
    }
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
    vm->ub_image  = false;
    vm->ub_t0_us  = ggml_time_us();
    for (auto & L : vm->layers) {
        if (L.managed) {
            L.slots.policy().begin_step();  // the step clock of a policy that decays (lfu)
        }
    }
    for (auto & f : vm->features) {
        f->ubatch_begin(*vm, ub);
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
            drop_streamed_pages(*vm);
        } else if (d >= 256 && !vm->warned_faults) {
            vm->warned_faults = true;
            LLAMA_LOG_WARN("vis-moe: %" PRId64 " major page faults in one ubatch: the system is paging our working set "
                           "(swap or evicted mmap pages); lower --moe-mem / --moe-slots / --moe-host-mib or use --moe-mem auto\n", d);
        }
    }
    for (auto & f : vm->features) {
        f->ubatch_end(*vm);  // slab lending returns the slabs here; telemetry (last) sees the whole ubatch
    }
    for (const auto & f : vm->features) {
        if (f->graphs_stale(*vm)) {
            vm->graph_epoch++;  // after every ubatch_end: what a feature decided at graph build no longer holds
            break;
        }
    }
    vm->ub_streamed = false;
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
