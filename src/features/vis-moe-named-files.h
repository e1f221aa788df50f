// vis-moe-named-files.h - every file an option names is opened and checked, even where the option cannot take
// effect (issue #25): --moe-shadow, --moe-sub-profile, --moe-predict-profile and --moe-cap-profile (or their
// VIS_MOE_* variables) naming a missing file or another model's profile are an error, never skipped in silence;
// a valid file that is not used gets a line saying why.  Also the test hook VIS_MOE_FAULT_READ, parsed strictly.
#pragma once

struct llama_model;
struct vis_moe_context;
struct vis_moe_settings;

// after a context's expert cache was attached (vm: nullptr when there is none): load and check each named file the
// attach did not load, and say why it is not used.  Throws std::runtime_error naming the flag, the file and the fix.
void vis_moe_check_named_files(const vis_moe_settings & s, const llama_model & model, const vis_moe_context * vm);
