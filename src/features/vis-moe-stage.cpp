// vis-moe-stage.cpp - staged prefill streaming (vis-moe-stage.h).
#include "vis-moe-stage.h"
#include "vis-moe-encoder-release.h"
#include "vis-moe-context.h"
#include "vis-moe-fetch.h"
#include "vis-moe-fetch-slots.h"
#include "vis-moe-lend.h"
#include "vis-moe-passes.h"
#include "vis-moe-precision.h"
#include "vis-moe-shadow.h"
#include "vis-moe-shadow-slots.h"

#include "llama-impl.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <chrono>
#include <map>
#include <string>

static constexpr uintptr_t PAGE = VIS_DIO_ALIGN;  // the slabs' and staging blocks' page grain

static int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}

vis_moe_stager::vis_moe_stager(int n_buffers, ggml_context * ctx_, std::vector<std::array<ggml_tensor *, 4>> t,
                               std::vector<std::array<ggml_tensor *, 4>> sh, std::vector<int> b)
    : n_buf(n_buffers), ctx(ctx_), tens(std::move(t)), shtens(std::move(sh)), buf_of(std::move(b)),
      n_parts(tens.size(), 0), freq(tens.size()) {
    std::map<uintptr_t, uintptr_t> ext;  // block start -> end: a block's largest tensor (layers and shadows share it)
    for (size_t il = 0; il < tens.size(); ++il) {
        for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
            for (ggml_tensor * x : { tens[il][ti], shtens.empty() ? nullptr : shtens[il][ti] }) {
                if (!x) {
                    continue;
                }
                const uintptr_t b = (uintptr_t) x->data / PAGE * PAGE;
                const uintptr_t e = ((uintptr_t) x->data + ggml_nbytes(x) + PAGE - 1) / PAGE * PAGE;
                ext[b] = std::max(ext[b], e);
            }
            if (tens[il][ti]) {
                n_parts[il]++;
                freq[il].assign((size_t) tens[il][ti]->ne[2], 0);
            }
        }
    }
    blocks.assign(ext.begin(), ext.end());
}

// the part of [b, e) that lies in the staging blocks, in whole pages
static int64_t in_blocks(const std::vector<std::pair<uintptr_t, uintptr_t>> & blocks, uintptr_t b, uintptr_t e) {
    b = b / PAGE * PAGE;
    e = (e + PAGE - 1) / PAGE * PAGE;
    int64_t n = 0;
    for (const auto & [x, y] : blocks) {
        const uintptr_t lo = std::max(b, x), hi = std::min(e, y);
        n += hi > lo ? (int64_t) (hi - lo) : 0;
    }
    return n;
}

// slot range [from, to) of tensor t of a layer's slab
static std::pair<uintptr_t, uintptr_t> slot_range(const ggml_tensor * t, int from, int to) {
    return { (uintptr_t) t->data + (size_t) from * t->nb[2], (uintptr_t) t->data + (size_t) to * t->nb[2] };
}

int64_t vis_moe_stager::bytes_over_limits(const vis_moe_context & vm) const {
    int64_t n = 0;
    for (const auto & L : vm.layers) {
        if (!L.managed || L.slots.n_active() >= L.n_slots) {
            continue;
        }
        for (const ggml_tensor * t : L.slab) {
            if (t && t->data && ggml_backend_buffer_is_host(t->buffer)) {
                const auto [b, e] = slot_range(t, L.slots.n_active(), L.n_slots);
                n += in_blocks(blocks, b, e);
            }
        }
    }
    return n;
}

static bool has_room(const vis_moe_context & vm, int64_t over) {
    if (over == 0) {
        return true;
    }
    int64_t room = INT64_MAX;
    for (const auto & f : vm.features) {
        room = std::min(room, f->staging_room(vm));
    }
    return over <= room;
}

bool vis_moe_stager::room_to_stage(const vis_moe_context & vm) const {
    const bool ok = has_room(vm, bytes_over_limits(vm));
    built_room = ok ? 1 : 0;
    cnt.no_room += ok ? 0 : 1;
    return ok;
}

bool vis_moe_stager::room_changed(const vis_moe_context & vm) const {
    return built_room >= 0 && has_room(vm, bytes_over_limits(vm)) != (built_room == 1);
}

bool vis_moe_stager::has_shadow(int il) const {
    if (il >= (int) tens.size() || n_parts[il] == 0) {
        return false;
    }
    for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
        if (tens[il][ti] && !shtens[il][ti]) {
            return false;  // the sidecar lacks one of the layer's expert tensors
        }
    }
    return true;
}

vis_moe_stager::~vis_moe_stager() {
    ggml_free(ctx);
}

// the shadow tensor of expert tensor ti of layer L, where --moe-precision may serve the layer from shadows
static const vis_shadow_tensor * shadow_of(const vis_moe_context & vm, const vis_moe_layer & L, int ti) {
    return vm.precision && L.shadow.on() ? L.shadow.src[ti] : nullptr;
}

// where the staging tensors go: the host slab buffers (the slots' and, with --moe-precision, the shadow slots') are
// regions of whole pages; each (staging buffer, expert tensor kind) needs one contiguous block of the largest
// streamable layer's tensor of that kind.  First fit, largest blocks first; false when they do not all fit.
struct stage_block {
    ggml_backend_buffer_t buf = nullptr;
    char * addr = nullptr;
};
static bool place_blocks(const std::vector<ggml_backend_buffer_t> & bufs, int n_buf,
                         const std::array<int64_t, VIS_T_COUNT> & kind_bytes,
                         std::vector<std::array<stage_block, VIS_T_COUNT>> & out) {
    struct region { ggml_backend_buffer_t buf; char * p; char * end; };
    std::vector<region> regions;
    for (ggml_backend_buffer_t b : bufs) {
        char * base = (char *) ggml_backend_buffer_get_base(b);
        char * end  = base + ggml_backend_buffer_get_size(b);
        char * p    = (char *) GGML_PAD((uintptr_t) base, PAGE);
        if (p < end) {
            regions.push_back({ b, p, end });
        }
    }
    std::vector<std::pair<int, int>> items;  // (buffer, kind), largest first
    for (int b = 0; b < n_buf; ++b) {
        for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
            if (kind_bytes[ti] > 0) {
                items.emplace_back(b, ti);
            }
        }
    }
    std::stable_sort(items.begin(), items.end(), [&](const auto & x, const auto & y) {
        return kind_bytes[x.second] > kind_bytes[y.second];
    });
    out.assign(n_buf, std::array<stage_block, VIS_T_COUNT>{});
    for (const auto & [b, ti] : items) {
        auto r = std::find_if(regions.begin(), regions.end(),
                              [&](const region & g) { return g.end - g.p >= kind_bytes[ti]; });
        if (r == regions.end()) {
            return false;
        }
        out[b][ti] = { r->buf, r->p };
        r->p += kind_bytes[ti];
    }
    return true;
}

void vis_moe_stage_attach(vis_moe_context & vm, const vis_moe_settings & s) {
    if (!s.stream_stage || vm.stream_passes <= 0 || vm.n_managed == 0 || vm.bufs.empty()) {
        return;
    }
    for (ggml_backend_buffer_t b : vm.bufs) {
        if (!ggml_backend_buffer_is_host(b)) {
            return;
        }
    }
    static_assert(VIS_T_COUNT == 4, "staging tensors: one per expert tensor kind");
    std::array<int64_t, VIS_T_COUNT> kind_bytes = {};  // per kind: the largest streamable layer's tensor, whole pages
    int64_t stride = 0;                                // bytes of one staging buffer (the log)
    for (const auto & L : vm.layers) {
        if (!L.can_stream()) {
            continue;
        }
        for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
            if (L.file[ti] && L.orig[ti]) {
                // + one page: the tensor starts at its file tensor's offset within a page (reads land in place)
                kind_bytes[ti] = std::max(kind_bytes[ti], (int64_t) (GGML_PAD(ggml_nbytes(L.orig[ti]), PAGE) + PAGE));
                if (const vis_shadow_tensor * sh = shadow_of(vm, L, ti)) {
                    kind_bytes[ti] = std::max(kind_bytes[ti], (int64_t) GGML_PAD(sh->src.nb2 * sh->src.n_expert, PAGE));
                }
            }
        }
    }
    for (int64_t b : kind_bytes) {
        stride += b;
    }
    int64_t size = 0;
    for (ggml_backend_buffer_t b : vm.bufs) {
        size += (int64_t) ggml_backend_buffer_get_size(b);
    }
    std::vector<std::array<stage_block, VIS_T_COUNT>> blocks;
    int n_buf = 0;
    for (int n = 2; n >= 1 && stride > 0 && n_buf == 0; --n) {
        n_buf = place_blocks(vm.bufs, n, kind_bytes, blocks) ? n : 0;
    }
    if (n_buf > 0 && vm.encoder_release) {
        // the slabs are larger than the memory held until the vision encoder is freed: the buffers must fit that
        n_buf = vm.encoder_release->fit_staging(vm, n_buf, stride);
        if (n_buf == 0) {
            LLAMA_LOG_INFO("vis-moe: prefill streaming through the page cache: staging a layer's experts (%.0f MiB) in "
                           "the slabs does not fit next to the vision encoder (VIS_MOE_ENCODER_RELEASE)\n",
                           stride / 1048576.0);
            return;
        }
    }
    if (n_buf == 0) {
        if (stride > 0) {
            LLAMA_LOG_INFO("vis-moe: prefill streaming through the page cache: the slabs (%.0f MiB) cannot stage a "
                           "layer's experts (%.0f MiB)\n", size / 1048576.0, stride / 1048576.0);
        }
        return;
    }
    // the expert tensors of every layer and their shadows
    ggml_init_params ip = { ggml_tensor_overhead() * (size_t) (2 * VIS_T_COUNT * vm.layers.size() + 8), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    std::vector<std::array<ggml_tensor *, 4>> tens(vm.layers.size(), std::array<ggml_tensor *, 4>{});
    std::vector<std::array<ggml_tensor *, 4>> shtens(vm.layers.size(), std::array<ggml_tensor *, 4>{});
    std::vector<int> buf_of(vm.layers.size(), -1);
    int ordinal = 0;  // buffers alternate over the streamable layers, whatever lies between them
    for (int il = 0; il < (int) vm.layers.size(); ++il) {
        const vis_moe_layer & L = vm.layers[il];
        if (!L.can_stream()) {
            continue;
        }
        buf_of[il] = ordinal++ % n_buf;
        for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
            const ggml_tensor * o = L.orig[ti];
            if (!L.file[ti] || !o) {
                continue;
            }
            const stage_block & blk = blocks[buf_of[il]][ti];
            ggml_tensor * t = ggml_new_tensor(ctx, o->type, GGML_MAX_DIMS, o->ne);
            ggml_format_name(t, "vis_moe_stage-%d.%d", il, ti);
            GGML_ASSERT(ggml_nbytes(t) == ggml_nbytes(o) && t->nb[2] == L.file[ti]->nb2);
            // at the file tensor's offset within a page, as the slabs are placed: an expert's whole pages are then
            // read straight into the block (the block starts on a page), only the partial end pages bounce
            char * at = vis_dio_place(blk.addr, (int64_t) (L.file[ti]->offs % PAGE), ggml_backend_buffer_get_alignment(blk.buf));
            if (ggml_backend_tensor_alloc(blk.buf, t, at) != GGML_STATUS_SUCCESS) {
                ggml_free(ctx);
                return;
            }
            tens[il][ti] = t;
            if (const vis_shadow_tensor * sh = shadow_of(vm, L, ti)) {
                // the layer's shadow tensor in the same block: a streamed ubatch that runs every routed expert from
                // its shadow reads the shadow bytes (vis_moe_precision_stages_shadows)
                const int64_t ne[4] = { sh->ne0, sh->ne1, sh->src.n_expert, 1 };
                ggml_tensor * x = ggml_new_tensor(ctx, sh->type, GGML_MAX_DIMS, ne);
                ggml_format_name(x, "vis_moe_stage_shadow-%d.%d", il, ti);
                GGML_ASSERT(x->nb[2] == sh->src.nb2);
                if (ggml_backend_tensor_alloc(blk.buf, x, blk.addr) != GGML_STATUS_SUCCESS) {
                    ggml_free(ctx);
                    return;
                }
                shtens[il][ti] = x;
            }
        }
    }
    vm.stage = vm.add(std::make_unique<vis_moe_stager>(n_buf, ctx, std::move(tens), std::move(shtens), std::move(buf_of)));
    if (n_buf == 2 && !vm.fetch) {
        vm.fetch = std::make_unique<vis_moe_fetcher>(std::max(1, s.tier.io_threads), s.tier.direct_io);
    }
    LLAMA_LOG_INFO("vis-moe: prefill streaming staged in the %s: %d buffer%s of %.0f MiB (a layer's experts), read "
                   "with our own reads%s\n", vm.bufs.size() > 1 ? "slabs and the shadow slabs" : "slabs", n_buf,
                   n_buf == 2 ? "s" : "", stride / 1048576.0,
                   n_buf == 2 ? ", the next layer in the background while one computes" : " while the layer waits");
}

bool vis_moe_stage_ubatch(const vis_moe_context & vm, int64_t n_pairs, bool image) {
    if (!vm.stage || vm.stream_passes <= 0) {
        return false;
    }
    for (const auto & L : vm.layers) {
        if (!L.managed) {
            continue;
        }
        if (!vis_moe_streams(vm, L, n_pairs, image)) {
            return false;
        }
    }
    // last: it counts a refusal
    return vm.stage->room_to_stage(vm);
}

// the requests that read the given experts of layer il (or their shadows) into its staging buffer
std::vector<vis_read_req> vis_moe_stager::reqs(const vis_moe_layer & L, int il, const std::vector<int> & experts,
                                               bool shadow) const {
    std::vector<vis_read_req> out;
    for (int ti = 0; ti < VIS_T_COUNT; ++ti) {
        ggml_tensor * t = weight(il, ti, shadow);
        if (!t) {
            continue;
        }
        const vis_deferred_tensor * src = shadow ? &L.shadow.src[ti]->src : L.file[ti];
        for (int e : experts) {
            out.push_back({ src, il, e, (char *) t->data + (size_t) e * t->nb[2] });
        }
    }
    return out;
}

// bytes of one expert of layer L as staged
static int64_t staged_bytes(const vis_moe_layer & L, bool shadow) {
    return shadow ? L.shadow.expert_bytes : L.expert_bytes;
}

void vis_moe_stager::wait_ahead(vis_moe_context & vm, bool use) {
    if (ahead_layer < 0) {
        return;
    }
    const int  T  = ahead_layer;
    const bool sh = ahead_shadow;
    ahead_layer = -1;
    // reads not started yet are dropped: the layer's router has run, and what it needs is read below if missing
    for (const auto & j : vm.fetch->cancel_queued(T)) {
        cnt.cancelled += (int64_t) j->reqs.size();
    }
    int64_t waited = 0;
    auto jobs = vm.fetch->collect(T, waited);
    cnt.wait_us += use ? waited : 0;
    std::string error;
    std::vector<bool> & have = present[buf_of[T]];
    have.assign(vm.layers[T].n_expert, false);
    for (const auto & j : jobs) {
        error = error.empty() ? j->error : error;
        if (!j->error.empty()) {
            continue;
        }
        for (const auto & r : j->reqs) {
            have[r.expert] = true;  // every tensor of a job's experts is in the job
        }
        cnt.bytes += (int64_t) j->reqs.size() / n_parts[T] * staged_bytes(vm.layers[T], sh);
    }
    if (!error.empty()) {
        throw vis_io_error("staged expert read failed: " + error +
                           " (check the disk and the model file; re-download or regenerate a damaged GGUF)");
    }
    holds[buf_of[T]] = 2 * T + (sh ? 1 : 0);
}

void vis_moe_stager::begin_layer(vis_moe_context & vm, int il, const std::vector<int> & routed, bool ub_shadow) {
    vis_moe_layer & L = vm.layers[il];
    const bool shadow = ub_shadow && has_shadow(il);
    const int  key    = 2 * il + (shadow ? 1 : 0);
    if (!ubatch_started) {
        // the slab memory is about to hold staged experts: no slot may keep (or be given) an expert meanwhile
        ubatch_started = true;
        vis_moe_empty_slots(vm);
        holds = { -1, -1 };
    }
    if (ahead_layer == il) {
        wait_ahead(vm, true);
        cnt.ahead++;
    } else {
        wait_ahead(vm, false);  // a read for another layer (never expected): finish it before its buffer is reused
    }
    const int b = buf_of[il];
    if (holds[b] != key) {
        present[b].assign(L.n_expert, false);
        holds[b] = key;
    }
    // the routed experts not read ahead: now, in parallel (the I/O pool); and what this layer routed, for the order
    // of the next reads ahead of it
    std::vector<int> missing;
    for (int e : routed) {
        freq[il][e]++;
        if (!present[b][e]) {
            missing.push_back(e);
        } else {
            cnt.used++;
        }
    }
    if (!missing.empty()) {
        const int64_t t0 = now_us();
        vis_fetch_demand demand(vm.fetch.get());
        vm.io->read(reqs(L, il, missing, shadow));
        cnt.wait_us += now_us() - t0;
        cnt.bytes += (int64_t) missing.size() * staged_bytes(L, shadow);
        for (int e : missing) {
            present[b][e] = true;
        }
    }
    cnt.layers++;
    if (n_buf < 2 || !vm.fetch) {
        return;
    }
    int T = il + 1;  // the next layer that streams from the other buffer
    while (T < (int) vm.layers.size() && buf_of[T] < 0) {
        ++T;
    }
    if (T >= (int) vm.layers.size() - 1) {
        // none, or the model's last layer: its FFN may see only the output rows (one token in a prefill), then it
        // runs from the slots, and no background read may write the slab memory under its loads
        return;
    }
    holds[buf_of[T]] = -1;  // the other buffer: the streamed layer before il has computed (graph order)
    const vis_moe_layer & N = vm.layers[T];
    // every expert of T (its router has not run), the ones T routed most in earlier staged ubatches first, in jobs of
    // CHUNK experts with all their tensors: the fetch workers (--moe-io-threads) read them in parallel, and the jobs
    // not started when T's router has run are dropped (wait_ahead): a prompt that routes few experts reads few more
    std::vector<int> order(N.n_expert);
    for (int e = 0; e < N.n_expert; ++e) {
        order[e] = e;
    }
    std::stable_sort(order.begin(), order.end(), [&](int a, int c) { return freq[T][a] > freq[T][c]; });
    constexpr int CHUNK = 8;
    for (int k0 = 0; k0 < N.n_expert; k0 += CHUNK) {
        std::vector<int> chunk(order.begin() + k0, order.begin() + std::min(N.n_expert, k0 + CHUNK));
        std::sort(chunk.begin(), chunk.end());  // file order within a job
        auto job = std::make_unique<vis_fetch_job>();
        job->il          = T;
        job->speculative = true;  // cancel_queued may drop it
        job->reqs        = reqs(N, T, chunk, ub_shadow && has_shadow(T));
        vm.fetch->submit(std::move(job));
    }
    ahead_layer  = T;
    ahead_shadow = ub_shadow && has_shadow(T);
}

void vis_moe_stager::end_ubatch(vis_moe_context & vm) {
    try {
        wait_ahead(vm, false);
    } catch (const std::exception & e) {
        vm.fail(e.what());  // the ubatch did not use it; still report the disk
    }
    if (ubatch_started) {
        // the staged layers wrote over slots above the limits too: their memory is someone else's again
        for (int il = 0; il < (int) vm.layers.size(); ++il) {
            const vis_moe_layer & L = vm.layers[il];
            for (int sl = L.managed ? L.slots.n_active() : L.n_slots; sl < L.n_slots; ++sl) {
                bool staged_over = false;
                for (const ggml_tensor * t : L.slab) {
                    if (t && t->data) {
                        const auto [b, e] = slot_range(t, sl, sl + 1);
                        staged_over = staged_over || in_blocks(blocks, b, e) > 0;
                    }
                }
                if (staged_over) {
                    cnt.dropped += vm.drop_slot_pages(il, sl);
                }
            }
        }
    }
    holds = { -1, -1 };
    ubatch_started = false;
}

bool vis_moe_stages_shadows(const vis_moe_context & vm, const vis_moe_layer & L, bool image) {
    return vm.stage && vm.stage->has_shadow((int) (&L - vm.layers.data())) && vis_moe_precision_stages_shadows(vm, image);
}

bool vis_moe_stager::streams_early(const vis_moe_context & vm, const vis_moe_layer & L, bool image) const {
    // staged shadows, read in the background, beat passes whose shadow reads the compute waits for
    // (docs/precision-speed.md)
    return image && vis_moe_stages_shadows(vm, L, image);
}

void vis_moe_stager::stats_print(const vis_moe_context & vm) const {
    (void) vm;
    if (cnt.layers > 0) {
        std::fprintf(stderr, "vis-moe: staged streaming: %" PRId64 " layers from %d staging buffer%s in the slabs (%" PRId64
                             " read ahead while the layer before computed: %" PRId64 " routed experts found there, %"
                             PRId64 " expert tensor reads dropped unstarted), %.2f MiB read, %.2f s waited\n",
                     cnt.layers, n_buf, n_buf == 2 ? "s" : "", cnt.ahead, cnt.used, cnt.cancelled, cnt.bytes / 1048576.0,
                     cnt.wait_us / 1e6);
    }
    if (cnt.no_room > 0 || cnt.dropped > 0) {
        // a controller lowered the slot limits (VIS_MOE_ONLINE, VIS_MOE_ENCODER_RELEASE): the staging buffers also
        // span slots above them, whose memory it gave to something else
        std::fprintf(stderr, "vis-moe: staging above the slot limits: %" PRId64 " streamed layer%s built to read through the "
                             "page cache (staging would have committed more than the spare memory), %.2f MiB of pages "
                             "above the limits dropped after staged ubatches\n",
                     cnt.no_room, cnt.no_room == 1 ? "" : "s", cnt.dropped / 1048576.0);
    }
}

void vis_moe_stager::stream_layer(vis_moe_context & vm, vis_moe_layer & L, int il, const std::vector<int> & routed,
                                  vis_stream_how how, const ggml_tensor * ids, const ggml_tensor * weights) {
    if (how == VIS_STREAM_MAPPED) {
        return;
    }
    const bool shadow = how == VIS_STREAM_STAGED_SHADOW;
    begin_layer(vm, il, routed, shadow);  // our reads into a staging buffer in the slabs
    if (shadow) {  // of the layer's shadows (--moe-precision): the precision stats count them
        vis_moe_precision_staged(vm, L, ids, weights, (int64_t) routed.size());
    }
}
