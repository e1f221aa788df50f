// vis-moe-encoder.h - the vision encoder's bytes in the --moe-mem plan (vis-moe-encoder.cpp; C API in llama-vis.h)
#pragma once

#include "llama-vis.h"

#include <cstdint>
#include <string>

// bytes of the projector handed over by llama_vis_moe_plan_encoder (0: none): every plan request counts them
int64_t vis_moe_encoder_bytes();

// " + vision encoder N" for the plan's log line (MiB), "" without an encoder
std::string vis_moe_encoder_line(int64_t encoder_bytes);
