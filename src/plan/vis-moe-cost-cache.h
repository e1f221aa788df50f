// vis-moe-cost-cache.h - where the cost model's probes keep what they measured (docs/planning.md#cost-model): one
// text file per probe under $XDG_CACHE_HOME/vis-moe/ (default ~/.cache), a line per key, appended.
#pragma once

#include <string>

// $XDG_CACHE_HOME/vis-moe/NAME (HOME/.cache without XDG_CACHE_HOME; /tmp/.cache without either)
std::string vis_moe_cost_cache_file(const std::string & name);
// append one line (no newline in it) to that file, making its folders; a cache that cannot be written is skipped
void vis_moe_cost_cache_append(const std::string & name, const std::string & line);
// seconds on a monotonic clock (the probes' timer)
double vis_moe_cost_now_s();
