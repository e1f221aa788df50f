// vis-moe-named-files.cpp - the files options name, opened and checked where the option cannot take effect
// (vis-moe-named-files.h).
#include "vis-moe-named-files.h"
#include "vis-moe-context.h"
#include "vis-moe-capacity.h"
#include "vis-moe-io-pool.h"
#include "vis-moe-modality.h"
#include "vis-moe-profile.h"
#include "vis-moe-settings.h"
#include "vis-moe-shadow.h"
#include "vis-moe-split.h"
#include "vis-moe-attach-plan.h"
#include "vis-moe-substitute.h"

#include "vis-error.h"

#include "llama-model.h"

#include <stdexcept>
#include <string>

void vis_moe_check_named_files(const vis_moe_settings & s, const llama_model & model, const vis_moe_context * vm) {
    try {
        vis_fault_check_env();
    } catch (const std::exception & e) {
        throw std::runtime_error(std::string("vis-moe: invalid environment variable: ") + e.what());
    }
    const bool cache = vm && vm->n_managed > 0;
    const char * off = "the expert cache is off or manages no layer";
    if (!s.prec.shadow.empty() && !(vm && vm->shadow)) {
        // kind, version and fingerprint; throws naming the fix.  Why it is not used was said by the attach
        vis_moe_shadow_load(s.prec.shadow, model, {});
    }
    if (!s.sub.profile.empty() && !(vm && vm->sub)) {  // the substitution state loads a named profile
        vis_buddy_profile_load(s.sub.profile, model);
        vis_tell_user("VIS_MOE_SUB_PROFILE=" + s.sub.profile + ": validated, not used: " +
                      (!s.sub.on() ? "--moe-substitute is off" : off));
    }
    if (!s.predict.profile.empty() && !(vm && vm->prefetch)) {
        vis_predict_profile_load(s.predict.profile, model);
        vis_tell_user("--moe-predict-profile " + s.predict.profile + ": validated, not used: " +
                      (!s.predict.on() ? "--moe-predict is off" : cache ? "no prediction runs" : off));
    }
    if (!s.plan.slot_split.empty() && !cache && model.hparams.n_expert > 0) {
        vis_moe_attach_plan ap;
        vis_moe_find_moe_layers(model, ap);
        vis_moe_split_file_load(s.plan.slot_split, (int) ap.moe_layers.size(), (int) model.hparams.n_expert);
        vis_tell_user("VIS_MOE_SLOT_SPLIT " + s.plan.slot_split + ": validated, not used: " + off);
    }
    if (!s.cap.profile.empty() && !(vm && vm->capacity && vm->capacity->profile())) {
        vis_modality_profile_load(s.cap.profile, model);
        vis_tell_user("VIS_MOE_CAP_PROFILE=" + s.cap.profile + ": validated, not used: " +
                      (!s.cap.on() ? "--moe-capacity is off" : off));
    }
}
