// vis-moe-stage.h - staged prefill streaming: a ubatch that streams its managed layers reads each layer's experts
// with our own positioned reads (O_DIRECT where allowed, the I/O threads) into staging buffers carved out of the
// slabs, double-buffered: layer l+1 is read in the background while layer l computes (src/features/vis-moe-stage.cpp).
//
// Why.  Prefill streaming (docs/paging.md#prefill-streaming) reads a layer through the mapping and the page cache.
// Under a tight budget that cache is the memory the plan did not place: on the 48-layer Qwen3-30B-A3B-sized model
// at 12.5 % streaming thrashed, and with the slabs lent to the page cache (vis-moe-lend.h) it read each expert once
// but at half upstream's prefill speed (page faults, one layer at a time).  While a layer streams the slabs hold
// nothing it uses, and a prompt long enough to stream routes nearly every expert, so the slab memory is the
// natural staging area: no page cache, no second copy, no extra memory.
//
// How.  When the slabs hold at least one layer's expert tensors (two for double buffering; with --moe-precision the
// shadow slabs count too: each expert tensor of a staging buffer needs one contiguous block, placed first fit over
// the host slab buffers, so a budget split into slots and shadow slots still stages) and every managed layer
// of the ubatch streams (so no layer fills a slot meanwhile), the graph of a streamed layer runs upstream's
// mul_mat_id on staging tensors: the layer's expert tensors' shapes and types, their data in staging buffer
// k % n_buffers for the k-th streamable layer (a dense layer between two does not make them share one).  The
// layer's stream op (a) at the ubatch's first streamed layer empties every slot (the slab memory is about to be
// overwritten), (b) makes sure layer il is in its buffer: the background read issued by the
// layer before is waited for (a late read counts as stall), else the experts the ubatch routes are read now,
// (c) with two buffers, starts the background read of the next managed layer's experts (those it routed most in
// earlier staged ubatches first; the reads not started when its router has run are dropped) into the other
// buffer, whose previous layer has finished computing (graph order); never of the model's last layer, whose FFN
// may see only the output rows and then runs from the (emptied) slots, loading into the slab memory.  The end of the ubatch waits for a read
// still in flight and forgets the buffers: the next ubatch's decode steps refill the slots there.
//
// Exactness: a staged expert is the file's bytes, and mul_mat_id reads only the routed experts of its buffer,
// all of which were read for this layer; the result is upstream's, bit for bit.
#pragma once

#include "vis-moe-feature.h"
#include "vis-moe-io-pool.h"
#include "vis-moe-settings.h"

#include "ggml.h"

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

struct vis_moe_context;
struct vis_moe_layer;

class vis_moe_stager : public vis_moe_feature {
public:
    // n_buffers: 1 or 2; the staging tensors of every streamable layer live in ctx, their data in the slab buffers;
    // buf_of: per layer, the buffer its tensors use (-1: not staged)
    // shadow_tensors: per layer, the same blocks as the layer's shadow tensors (--moe-precision; empty arrays for a
    // layer without shadows)
    vis_moe_stager(int n_buffers, ggml_context * ctx, std::vector<std::array<ggml_tensor *, 4>> tensors,
                   std::vector<std::array<ggml_tensor *, 4>> shadow_tensors, std::vector<int> buf_of);
    ~vis_moe_stager();
    vis_moe_stager(const vis_moe_stager &) = delete;
    vis_moe_stager & operator=(const vis_moe_stager &) = delete;

    int n_buffers() const { return n_buf; }
    // the staging tensor standing in for expert tensor ti of layer il (null: not staged); shadow: the one of the
    // layer's shadow tensor (the shadow type), in the same block
    ggml_tensor * weight(int il, int ti, bool shadow = false) const {
        const auto & t = shadow ? shtens : tens;
        return il < (int) t.size() ? t[il][ti] : nullptr;
    }
    // can layer il stage its shadows (a streamed ubatch whose every routed expert runs from its shadow)
    bool has_shadow(int il) const;

    // the stream op of layer il (compute thread): slots emptied (first layer), layer il resident in its buffer,
    // the next layer's read started.  Throws vis_io_error on a failed read.
    // routed: the distinct experts the ubatch routes at il; shadow: the ubatch reads shadows where a layer has them
    // (vis_moe_precision_stages_shadows), the next layer's read ahead too
    void begin_layer(vis_moe_context & vm, int il, const std::vector<int> & routed, bool shadow = false);
    // the ubatch ended: wait for a read in flight, forget the buffers (their memory is the slots' again), and drop
    // the pages a staged ubatch wrote above the slot limits
    void end_ubatch(vis_moe_context & vm);

    // the bytes (whole pages) of the staging buffers that lie in slots above their layer's limit: what a staged
    // ubatch commits beyond the memory the slots hold
    int64_t bytes_over_limits(const vis_moe_context & vm) const;
    // may this ubatch stage (the features' staging_room holds bytes_over_limits)?  At graph build: counts a refusal
    // and remembers the answer
    bool room_to_stage(const vis_moe_context & vm) const;
    // would room_to_stage answer otherwise now (the KV cache grew under an unchanged limit)?  Then a graph built
    // before must not be reused (graphs_stale: vis_moe_end_ubatch bumps the graph epoch)
    bool room_changed(const vis_moe_context & vm) const;

    struct counters {
        int64_t layers = 0;        // layers computed from a staging buffer
        int64_t ahead  = 0;        // of them, read (in part) in the background while the layer before computed
        int64_t used   = 0;        // routed experts that were read ahead
        int64_t cancelled = 0;     // expert tensor reads ahead dropped before they started (the router had run)
        int64_t bytes  = 0;        // payload read into the buffers
        int64_t wait_us = 0;       // time the compute waited for reads (synchronous, or late background ones)
        int64_t no_room = 0;       // streamed layers built to read through the page cache: no room above the limits
        int64_t dropped = 0;       // bytes of pages above the slot limits dropped after staged ubatches
    };
    const counters & stats() const { return cnt; }
    void reset_stats() { cnt = {}; }

    // the feature (vis-moe-feature.h): the end of each ubatch, the staged-streaming line of --moe-stats, and an
    // image ubatch whose layers stage their shadows streams them as soon as it needs a second pass
    const char * feature_name() const override { return "staging"; }
    void ubatch_end(vis_moe_context & vm) override { end_ubatch(vm); }
    void stats_print(const vis_moe_context & vm) const override;
    void stats_reset() override { reset_stats(); }
    bool streams_early(const vis_moe_context & vm, const vis_moe_layer & L, bool image) const override;
    bool graphs_stale(const vis_moe_context & vm) const override { return room_changed(vm); }
    void stream_layer(vis_moe_context & vm, vis_moe_layer & L, int il, const std::vector<int> & routed, vis_stream_how how,
                      const ggml_tensor * ids, const ggml_tensor * weights) override;

private:
    void wait_ahead(vis_moe_context & vm, bool use);
    std::vector<vis_read_req> reqs(const vis_moe_layer & L, int il, const std::vector<int> & experts, bool shadow) const;

    int n_buf;
    ggml_context * ctx;
    std::vector<std::array<ggml_tensor *, 4>> tens;  // per layer (empty arrays for others)
    std::vector<std::array<ggml_tensor *, 4>> shtens;  // per layer: the shadow tensors' stand-ins, same blocks
    std::vector<int> buf_of;                          // per layer: its buffer, -1 if not staged
    std::vector<std::pair<uintptr_t, uintptr_t>> blocks;  // the staging blocks' page ranges [begin, end)
    std::vector<int> n_parts;                         // per layer: expert tensors staged (reads per expert)
    std::vector<std::vector<int64_t>> freq;           // per layer and expert: staged ubatches that routed it
    std::array<std::vector<bool>, 2> present;         // per buffer: experts of holds[b] read completely
    bool ubatch_started = false;   // the slots were emptied in this ubatch
    std::array<int, 2> holds   = { -1, -1 };   // the layer each buffer holds, 2 il + 1 for its shadows
    int  ahead_layer = -1;         // the layer being read in the background (into buf_of[ahead_layer])
    bool ahead_shadow = false;     // ... its shadows
    mutable counters cnt;  // no_room counts at graph build (const)
    mutable int built_room = -1;  // room_to_stage's last answer (1: stage, 0: not; -1: never asked)
};

// context creation (vis-moe-attach.cpp), after the slabs: the stager when the slabs can stage a layer (CPU-only
// run, host slab buffers, streaming on, --moe-stream-stage not off); logs what it chose
void vis_moe_stage_attach(vis_moe_context & vm, const vis_moe_settings & s);

// does the ubatch with n_pairs (token, expert) pairs per layer stream every managed layer from staging buffers?
// (every managed layer must stream: a layer served from the slabs would overwrite the staged experts)
bool vis_moe_stage_ubatch(const vis_moe_context & vm, int64_t n_pairs, bool image = false);

// when a ubatch streams layer L staged, does it read L's shadows: the stager holds L's shadow stand-ins and the
// precision policy serves every routed expert (vis_moe_precision_stages_shadows)?
bool vis_moe_stages_shadows(const vis_moe_context & vm, const vis_moe_layer & L, bool image);
