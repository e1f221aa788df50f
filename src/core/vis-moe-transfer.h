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

// fill slot s with expert e for each (e, s) of `misses`: tier 2 first, then the file (or the model's copy)
void vis_moe_fill_slots(vis_moe_context & vm, vis_moe_layer & L, int il, const std::vector<std::pair<int, int>> & misses);

// copy slot s of the layer's slabs into a packed expert buffer (expert_bytes)
void vis_moe_slab_read(const vis_moe_layer & L, int s, uint8_t * packed);

// a background read of expert e into slot s (vis-moe-fetch.h); nullptr when it was served on the spot (the host
// cache or the model's copy hold it)
std::unique_ptr<vis_fetch_job> vis_moe_fetch_job(vis_moe_context & vm, vis_moe_layer & L, int il, int e, int s);
// a finished background read: the slot gets the staged bytes (or, when the worker uploaded them asynchronously,
// the compute thread waits for that copy's event); compute thread
void vis_moe_fetch_finish(vis_moe_layer & L, vis_fetch_job & job);
