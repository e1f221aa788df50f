// vis-moe-attach-upload.h - context creation (vis-moe-attach.cpp): the upload streams, pinned budget and staging
// of the slabs' devices, and tier 2 (the stream and pools themselves: vis-moe-upload.h).
#pragma once

#include "vis-moe-upload.h"

#include <cstdint>
#include <memory>
#include <vector>

struct vis_moe_context;
struct llama_model;

// one line: the --moe-unified mode in force (asked: -1 auto, 0 off, 1 on) and why (jetson/README.md, Orin rules)
void vis_moe_log_unified(const llama_model & model, const std::vector<int> & managed, int32_t asked,
                         bool all_host_devices, const vis_moe_context & vm);

// After the slabs: dev_of[il] is the device of layer il's slabs when the CPU cannot write them (discrete GPU),
// else null.  Gives those layers the upload stream of their device (one uploader per device), sets the pinned
// budget from --moe-pin-mib (pin_mib) and creates vm.staging (blocks of block_bytes; pinned ahead for a decode
// step on a discrete GPU).  CPU and unified memory: no uploader, nothing pinned, staging made on demand.
void vis_moe_attach_uploads(vis_moe_context & vm, const std::vector<ggml_backend_dev_t> & dev_of, int64_t pin_mib,
                            size_t block_bytes, bool no_alloc);
// tier 2 of budget_bytes in blocks of block_bytes: pinned within vm.pin on a discrete GPU, with one log line
// saying how much was pinned, under which cap, and why not more; else today's anonymous arena
std::unique_ptr<vis_host_cache> vis_moe_make_host_cache(vis_moe_context & vm, size_t budget_bytes, size_t block_bytes,
                                                        bool lock);
