// vis-moe-prefetch.h - lookahead prefetch: layer l predicts the experts of layers l+1 .. l+W (vis-moe-predict.h)
// and reads the best ones in the background while it computes (src/features/vis-moe-prefetch.cpp; docs/prediction.md).
//
// Where it runs.  Each MoE layer l of the graph gets one "predict" op (vis-moe-graph.cpp) once layer l has routed and,
// when l is managed, loaded what its own ubatch needs: demand reads come first.  For each later managed layer T = l+d it
// takes the predictor's top-B experts (--moe-prefetch-budget) and has the context start background reads (apply_reads,
// vis-moe-apply.cpp; the reader: vis-moe-fetch.h) of those not resident into victim slots of T that are Empty or
// Expired: a read ahead never evicts a slot the running step uses (Required), a protected Speculative one, or an expert
// it predicted itself.  Layer T's pass 0 collects them before it plans: reads not started yet are dropped (the layer's
// own demand reads are faster), the others are waited for (a late read is a partial stall, not a miss), and the arrived
// experts are Speculative for the step; one the step does not use goes first (vis-moe-policy.h). Demand reads pre-empt
// reads ahead: the background worker starts none while a pass reads.
//
// Exactness: a read ahead writes only a held slot no id points at; it changes which experts are resident and
// when, never what is computed.
//
// Self-tuning (--moe-prefetch-tune): per layer, over windows of 16 reads ahead, when more were wasted than used,
// the layer's prefetch is off for the next 32 steps, then tried again; the stats say how long it was off.  And
// globally, measured: decode steps alternate between reads ahead on and off, and the faster setting runs
// (vis-moe-prefetch-ab.h).
// Decode steps only (every sequence of the ubatch has one token): a prefill ubatch routes nearly every expert.
#pragma once

#include "llama-vis.h"
#include "vis-moe-predict.h"
#include "vis-moe-prefetch-ab.h"
#include "vis-moe-settings.h"
#include "vis-moe-ubatch-plan.h"

#include <cstdint>
#include "vis-moe-feature.h"

#include <memory>
#include <vector>

struct llama_model;
struct ggml_tensor;
struct vis_moe_context;
struct vis_moe_layer;
struct vis_fetch_done;

class vis_moe_prefetcher : public vis_moe_feature {
public:
    vis_moe_prefetcher(const vis_moe_predict_settings & s, std::unique_ptr<vis_moe_predictor> pred, int n_layer,
                       int budget);

    const char * name() const { return pred->name(); }
    int  lookahead() const { return W; }
    int  budget() const { return B; }
    bool wants_logits() const { return pred->wants_logits(); }
    bool wants_hidden() const { return pred->wants_hidden(); }

    // a ubatch starts (decode: every sequence has one token) / ended (the measured on/off choice times it)
    void begin_ubatch(bool decode);
    void end_ubatch();
    const vis_prefetch_ab::result & ab_result() const { return ab.last(); }
    // the predict op of layer in.il: learn from its routing, then (decode) read ahead for il+1 .. il+W
    void step(vis_moe_context & vm, vis_predict_input & in);
    // pass 0 of layer il, after vis_moe_fetch_collect: score the step's prediction and reads ahead against the
    // routed ids [n_pairs]
    void collected(const vis_moe_layer & L, int il, const std::vector<vis_fetch_done> & done,
                   int64_t waited_us, const int32_t * ids, int64_t n_pairs);

    // counters of layer il (saved_us is left to the stats code, which knows the read rate)
    const llama_vis_moe_prefetch_stats & stats(int il) const { return layers[il].st; }
    void reset_stats();

    // the feature (vis-moe-feature.h): the measured on/off choice times each ubatch; after it, the policies'
    // speculative horizons count down; the prefetch table of --moe-stats
    const char * feature_name() const override { return "prefetch"; }
    void ubatch_begin(vis_moe_context & vm, const llama_ubatch &) override;
    void ubatch_end(vis_moe_context & vm) override;
    void stats_print(const vis_moe_context & vm) const override;
    void stats_reset() override { reset_stats(); }
    void plan_collected(const vis_moe_context & vm, const vis_moe_layer & L, int il,
                        const std::vector<vis_fetch_done> & done, int64_t waited_us, const int32_t * ids,
                        int64_t n_pairs) override;

private:
    struct ahead_read {
        int32_t expert;
        bool    queued;  // a background read (else served on the spot from the host cache)
    };
    struct layer_state {
        llama_vis_moe_prefetch_stats st = {};
        std::vector<int32_t>    pred;           // the d = 1 prediction for this step
        uint64_t                pred_step = 0;
        std::vector<ahead_read> ahead;          // made resident (or in flight) ahead of this step
        int win_used = 0, win_wasted = 0;       // self-tuning window
        int off_left = 0;                       // steps the layer's prefetch stays off
    };

    std::unique_ptr<vis_moe_predictor> pred;
    int  W;
    int  B;
    bool tune;
    bool decode = false;
    bool issuing = true;       // reads ahead in this step (the measured choice, vis-moe-prefetch-ab.h)
    uint64_t cur_step = 0;
    int64_t  t_begin_us = 0;
    vis_prefetch_ab ab;
    std::vector<layer_state> layers;
    std::vector<float> score;  // scratch
    std::vector<vis_plan_read> reads;  // scratch: the reads ahead of one layer (vis-moe-ubatch-plan.h)
};

// the predict op (a graph node after layer il's routing): learn from the layer's routing, read the layers ahead's
// experts.  src[0] = ids, src[1] = ordering dependency, src[1 + d] = router logits of layer il + d or the ids again
void vis_moe_predict_op(ggml_tensor * dst, int ith, int nth, void * ud);

// the totals of every layer (zeros without prefetch), with the measured choice's state
void vis_moe_total_prefetch_stats(const vis_moe_context & vm, llama_vis_moe_prefetch_stats & out);
// estimate: the bytes of used reads ahead at this context's demand read rate, less the time waited for them
int64_t vis_moe_prefetch_saved_us(const vis_moe_context & vm, const llama_vis_moe_prefetch_stats & s);

// context creation (vis-moe-attach.cpp): the prefetcher of --moe-predict, and the background reader it needs.
// Logs what it chose; nothing when prediction is off or the experts are not read from the file.
void vis_moe_prefetch_attach(vis_moe_context & vm, const llama_model & model, const vis_moe_settings & s, bool file_store);
