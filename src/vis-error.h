// vis-error.h - the one error setter of the fork: llama_vis_last_error() (llama-vis.h).
//
// A thread-local message.  Every public llama_vis_* function that can fail calls
// vis_clear_last_error() on entry (VIS_API_ENTRY), so a message always belongs to
// the call that failed, never to an earlier one.
#pragma once

#include <string>

void vis_set_last_error(const std::string & msg);
void vis_clear_last_error();
