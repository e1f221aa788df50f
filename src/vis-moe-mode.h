// vis-moe-mode.h - --moe-mode exact|fast (docs/mode.md): one switch for a fixed, measured set of lossy mechanisms.
//
// exact (the default) changes nothing.  fast turns on, in the settings a context is created with, each lossy
// mechanism of its set that the user did not choose explicitly (a flag or variable given wins):
//   --moe-substitute drop   cache-aware dropping, at its --moe-sub-drop-share / --moe-sub-renorm settings
// and logs one line saying that the run is lossy and what it turned on.
#pragma once

#include "vis-moe-settings.h"

#include <string>

// the settings of fast applied to s (nothing for exact); returns the line to log ("" for exact).  cache: whether
// the expert cache serves this context (without it every expert is resident and nothing is dropped).
std::string vis_moe_mode_resolve(vis_moe_settings & s, bool cache);
