// vis-moe-topk.h - fewer experts per token (--moe-topk N, lossy, off by default): each token runs its N
// highest-weighted experts instead of the model's k, its gate weights renormalised over those N exactly as the model
// renormalises over k.  The graph is upstream's with N in place of k (patch 0002 asks vis_moe_n_expert_used in
// build_moe_ffn), so the result is bit for bit upstream's with `--override-kv <arch>.expert_used_count=int:N`, in
// every layer, managed or not, with or without the expert cache (docs/topk.md).
#pragma once

#include <cstdint>

struct llama_model;
struct vis_moe_context;
struct vis_moe_settings;

// at attach: the experts each token runs in this context (the model's k when --moe-topk is off); throws
// std::invalid_argument naming the flag when N is above the model's k
int vis_moe_topk_attach(const vis_moe_settings & s, const llama_model & model);
// the line that says a context runs fewer experts (lossy): logged now, repeated in the --moe-stats footer
void vis_moe_topk_note(vis_moe_context & vm, int k);
