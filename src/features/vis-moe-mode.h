// vis-moe-mode.h - --moe-mode exact|fast (docs/mode.md): one switch for a fixed, measured set of lossy mechanisms.
//
// exact (the default) changes nothing.  fast turns on, in the settings a context is created with, each lossy
// mechanism of its set that the user did not choose explicitly (a flag or variable given wins):
//   --moe-topk ceil(2k/3)   each token runs its ceil(2k/3) highest-weighted of the model's k experts
// and logs one line saying that the run is lossy and what it turned on.  The set and its fraction were chosen by
// measurement (docs/mode.md#why-this-combination): the fastest at < 1 % perplexity on the trained testbed.
#pragma once

#include "vis-moe-settings.h"

#include <string>

// the experts per token fast runs on a model of k: ceil(2k/3)
int vis_moe_mode_fast_topk(int k);

// the settings of fast applied to s (nothing for exact); returns the line to log ("" for exact).  k: the model's
// experts per token.
std::string vis_moe_mode_resolve(vis_moe_settings & s, int k);
