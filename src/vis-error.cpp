// vis-error.cpp - llama_vis_last_error(): one thread-local message (vis-error.h).
#include "vis-error.h"
#include "llama-vis.h"

static thread_local std::string g_last_error;

void vis_set_last_error(const std::string & msg) {
    g_last_error = msg;
}

void vis_clear_last_error() {
    g_last_error.clear();
}

const char * llama_vis_last_error(void) {
    return g_last_error.c_str();
}
