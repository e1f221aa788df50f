// vis-moe-mode.cpp - --moe-mode exact|fast (vis-moe-mode.h, docs/mode.md).
#include "vis-moe-mode.h"

#include <cstdio>

std::string vis_moe_mode_resolve(vis_moe_settings & s, bool cache) {
    if (s.mode != VIS_MODE_FAST) {
        return "";
    }
    auto & u = s.sub;
    if (!cache) {
        return "vis-moe: --moe-mode fast: nothing turned on: the expert cache is off (every expert is in memory, "
               "nothing misses), so the output is exact";
    }
    if (u.mode_given) {
        return std::string("vis-moe: --moe-mode fast: nothing turned on: --moe-substitute was given and replaces its "
                           "drop (the output is ") + (u.on() ? "lossy" : "exact") + ")";
    }
    u.mode = VIS_SUB_DROP;
    char line[400];
    std::snprintf(line, sizeof(line), "vis-moe: --moe-mode fast (LOSSY: outputs differ from the model's): turned on "
                  "--moe-substitute drop (a decode token skips a missing expert whose gate-weight share is < %g x 1/k, "
                  "renorm %s%s; the expert is %s)", u.drop_share, u.renorm ? "on" : "off",
                  u.prefill ? ", prefill too" : ", decode only",
                  u.drop_read ? "read in the background" : "not read: its bytes are saved");
    return line;
}
