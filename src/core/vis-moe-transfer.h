// vis-moe-transfer.h - moving expert bytes into and out of slabs (src/core/vis-moe-transfer.cpp):
// from tier 2 (host cache), tier 3 (the GGUF file, in parallel) or llama.cpp's own copy.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

struct vis_moe_context;
struct vis_moe_layer;
struct vis_fetch_job;
struct vis_read_req;
struct vis_upload_copy;

// fill slot s with expert e for each (e, s) of `misses`: tier 2 first, then the file (or the model's copy)
void vis_moe_fill_slots(vis_moe_context & vm, vis_moe_layer & L, int il, const std::vector<std::pair<int, int>> & misses);

// expert e into slot s from memory, if it is there: tier 2 (written now, or its copies appended to `copies` on a
// discrete GPU with an upload stream) or the model's copy (--moe-store model); false when it must be read from the file
bool vis_moe_serve_from_memory(vis_moe_context & vm, vis_moe_layer & L, int il, int e, int s,
                               std::vector<vis_upload_copy> * copies);
// the file reads of expert e straight into slot s of CPU-writable slabs (L.direct_write), appended to reqs
void vis_moe_slot_reqs(const vis_moe_layer & L, int il, int e, int s, std::vector<vis_read_req> & reqs);

// copy slot s of the layer's slabs into a packed expert buffer (expert_bytes)
void vis_moe_slab_read(const vis_moe_layer & L, int s, uint8_t * packed);

// a background read of expert e into slot s (vis-moe-fetch.h); nullptr when it was served on the spot (the host
// cache or the model's copy hold it)
std::unique_ptr<vis_fetch_job> vis_moe_fetch_job(vis_moe_context & vm, vis_moe_layer & L, int il, int e, int s);
// a finished background read: the slot gets the staged bytes (or, when the worker uploaded them asynchronously,
// the compute thread waits for that copy's event); compute thread
void vis_moe_fetch_finish(vis_moe_layer & L, vis_fetch_job & job);
