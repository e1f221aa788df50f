// vis-moe-attach-upload.cpp - context creation: how the slabs are written, upload streams, pinned memory, staging,
// tier 2 (vis-moe-attach-upload.h).
#include "vis-moe-attach-upload.h"
#include "vis-moe-context.h"

#include "llama-vis.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

void vis_moe_log_unified(const llama_model & model, const std::vector<int> & managed, int32_t asked,
                         bool all_host_devices, const vis_moe_context & vm) {
    ggml_backend_dev_t gpu = nullptr;  // the first managed layer's device that is not the CPU
    for (int il : managed) {
        ggml_backend_dev_t d = model.dev_layer(il);
        gpu = gpu ? gpu : (ggml_backend_dev_type(d) != GGML_BACKEND_DEVICE_TYPE_CPU ? d : nullptr);
    }
    const std::string name = gpu ? ggml_backend_dev_name(gpu) : "";
    std::string why;
    if (!vm.unified && all_host_devices) {
        why = "as asked, although the slabs are CPU-writable: experts go through staging blocks, and the host "
              "cache may hold what a slab holds";
    } else if (!gpu) {
        why = "the slabs are host memory (CPU backend): experts are read straight into them";
    } else if (vis_igpu_unified(gpu)) {
        why = name + " is an integrated GPU with GGML_CUDA_ENABLE_UNIFIED_MEMORY=1 (managed memory). ggml does not "
              "report concurrent managed access, so it is taken as absent, as on Orin: the pass op writes slabs only "
              "between kernels, background reads go through staging blocks";
    } else if (ggml_backend_dev_type(gpu) == GGML_BACKEND_DEVICE_TYPE_IGPU) {
        why = name + " is an integrated GPU without managed buffers (GGML_CUDA_ENABLE_UNIFIED_MEMORY=1 is not set): "
              "slabs are filled through staging blocks";
    } else {
        why = name + " is a discrete GPU: slabs in device memory, filled through staging blocks and the upload stream";
    }
    LLAMA_LOG_INFO("vis-moe: --moe-unified %s -> %s: %s\n", asked < 0 ? "auto" : asked ? "on" : "off",
                   vm.unified ? "on" : "off", why.c_str());
}

// ---- attach: upload streams, pinned memory, staging ---------------------------------------

void vis_moe_attach_uploads(vis_moe_context & vm, const std::vector<ggml_backend_dev_t> & dev_of, int64_t pin_mib,
                            size_t block_bytes, bool no_alloc) {
    ggml_backend_buffer_type_t host_buft = nullptr;
    bool discrete = false;
    for (size_t il = 0; il < dev_of.size() && il < vm.layers.size(); ++il) {
        ggml_backend_dev_t dev = dev_of[il];
        if (!dev || !vm.layers[il].managed) {
            continue;
        }
        discrete = true;
        host_buft = host_buft ? host_buft : ggml_backend_dev_host_buffer_type(dev);
        if (no_alloc) {
            continue;  // the --fit probe never computes: no stream
        }
        vis_moe_uploader * up = nullptr;
        for (auto & u : vm.uploads) {
            up = u->device() == dev ? u.get() : up;
        }
        if (!up) {
            vm.uploads.push_back(std::make_unique<vis_moe_uploader>(dev));
            up = vm.uploads.back().get();
        }
        vm.layers[il].upload = up;
    }
    if (discrete && host_buft) {
        vm.pin      = vis_pin_budget_from(pin_mib);
        vm.pin.buft = vm.pin.cap > 0 ? host_buft : nullptr;
    }
    vm.staging = std::make_unique<vis_staging_pool>(block_bytes, vm.pin.buft, &vm.pin);
    if (discrete && !no_alloc) {
        // a decode step's misses and as many background reads, pinned before tier 2 takes the rest of the cap
        vm.staging->reserve(2 * (size_t) std::max(1, vm.n_expert_used));
    }
}

std::unique_ptr<vis_host_cache> vis_moe_make_host_cache(vis_moe_context & vm, size_t budget_bytes, size_t block_bytes,
                                                        bool lock) {
    if (vm.uploads.empty()) {
        return std::make_unique<vis_host_cache>(budget_bytes, block_bytes, lock);  // CPU, unified memory: as before
    }
    vis_host_pinning pin;
    pin.buft = vm.pin.buft;
    pin.cap  = vm.pin.left();
    auto host = std::make_unique<vis_host_cache>(budget_bytes, block_bytes, lock, pin);
    vm.pin.used += host->pinned_bytes();
    const double total  = host->capacity_blocks() * host->block_bytes() / 1048576.0;
    const double pinned = host->pinned_bytes() / 1048576.0;
    const char * rest   = host->locked() ? "locked" : "not locked";
    const char * dev    = ggml_backend_dev_name(vm.uploads.front()->device());
    if (total <= 0) {
        return host;
    }
    if (!vm.pin.buft) {
        LLAMA_LOG_INFO("vis-moe: host cache: %.2f MiB of ordinary memory (%s), nothing pinned: %s; copies from it "
                       "to %s are staged by the driver at lower bandwidth\n", total, rest,
                       vm.pin.cap == 0 && !vm.pin.why.empty() ? vm.pin.why.c_str() : "the device offers no pinned host memory type",
                       dev);
    } else if (host->pin_refused()) {
        LLAMA_LOG_WARN("vis-moe: host cache: pinning %.2f MiB was refused by %s; tier 2 falls back to %.2f MiB of "
                       "ordinary memory (%s), 0 MiB pinned: copies from it to %s are staged by the driver at lower "
                       "bandwidth; lower --moe-pin-mib or free memory\n",
                       std::min<double>(total, (double) pin.cap / 1048576.0), ggml_backend_buft_name(pin.buft), total, rest, dev);
    } else if (pinned < total) {
        LLAMA_LOG_INFO("vis-moe: host cache: %.2f of %.2f MiB pinned (%s): the pinned-memory cap of %.0f MiB (%s; "
                       "%.0f MiB of it for staging) leaves %.2f MiB in ordinary memory (%s)\n", pinned, total,
                       ggml_backend_buft_name(pin.buft), vm.pin.cap / 1048576.0, vm.pin.why.c_str(),
                       (vm.pin.used - host->pinned_bytes()) / 1048576.0, total - pinned, rest);
    } else {
        LLAMA_LOG_INFO("vis-moe: host cache: %.2f MiB pinned (%s; cap %.0f MiB: %s)\n", pinned,
                       ggml_backend_buft_name(pin.buft), vm.pin.cap / 1048576.0, vm.pin.why.c_str());
    }
    return host;
}
