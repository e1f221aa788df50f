// vis-moe-configure.h - the configurator applied to a context being created (vis-moe-configure-context.cpp): under
// --moe-mem, before upstream allocates the KV cache and reserves the compute buffers, a smaller ubatch is chosen
// where its compute buffer buys expert slots worth more (llama_vis_moe_configure, docs/planning.md).
#pragma once

#include "vis-moe-attach-plan.h"

#include <cstdint>

struct llama_cparams;

// Under --moe-mem with the configurator on (VIS_MOE_CONFIGURE) and a causal context: the ubatch with the lowest
// predicted latency for a KV cache of kv_bytes; cp.n_ubatch is lowered to it (one line to the user says what changed
// and why) and true is returned.  With VIS_MOE_CONFIGURE=auto (the default) only on a model whose weights are all
// F32, where outputs are bit-identical at any ubatch; elsewhere the line says what it would buy and -ub stays.  Nothing fits at any ubatch: cp.n_ubatch is lowered to the smallest candidate, so
// that the refusal that follows names the smallest budget that works, and false is returned.
bool vis_moe_configure_ubatch(const llama_model & model, const vis_moe_settings & s, const vis_moe_attach_plan & ap,
                              llama_cparams & cp, int64_t kv_bytes);
// A model loaded whole (vis_moe_runs_whole: it fits the budget alone) whose context does not fit at the asked ubatch
// but fits at fit_ub: with the configurator on (VIS_MOE_CONFIGURE=on, or auto on all-F32 weights, as above)
// cp.n_ubatch is lowered to fit_ub, one line says so, and true is returned; otherwise false (the refusal follows).
bool vis_moe_configure_resident_ubatch(const llama_model & model, const vis_moe_settings & s, llama_cparams & cp,
                                       uint32_t fit_ub);
