// vis-moe-attach-slabs.h - steps 4 and 5 of the attach (vis-moe-attach.cpp): the slabs and the locked resident weights
#pragma once

#include "vis-moe-attach-plan.h"

struct llama_model;
struct vis_moe_context;

// step 4: slot tables and slabs of every managed layer that does not fit, allocated per buffer type (in upstream's
// --fit probe, no_alloc, a dummy buffer: nothing allocated or touched).  Returns whether every slab buffer is locked.
bool vis_moe_create_slabs(const llama_model & model, const vis_moe_settings & s, const vis_moe_attach_plan & ap,
                          vis_moe_context & vm);

// step 5: lock the resident weights the plan has room for (its `pageable` bytes stay unlocked)
void vis_moe_lock_resident_weights(const llama_model & model, const vis_moe_attach_plan & ap, vis_moe_context & vm);
