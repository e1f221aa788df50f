// vis-error.h - the one error setter of the fork: llama_vis_last_error() (llama-vis.h), and the one way a line
// reaches the user whatever the llama log shows (vis_tell_user).
//
// A thread-local message.  Every public llama_vis_* function that can fail calls
// vis_clear_last_error() on entry (VIS_API_ENTRY), so a message always belongs to
// the call that failed, never to an earlier one.
#pragma once

#include <string>

void vis_set_last_error(const std::string & msg);
void vis_clear_last_error();

// "vis-moe: <msg>" straight to stderr, once per distinct message in the process: an error or an option that cannot
// take effect must be seen where the llama log is silenced (llama-bench) or shows warnings only with -v (llama-cli)
void vis_tell_user(const std::string & msg);
