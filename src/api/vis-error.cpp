// vis-error.cpp - llama_vis_last_error(): one thread-local message (vis-error.h).
#include "vis-error.h"
#include "llama-vis.h"

#include <cstdio>
#include <mutex>
#include <set>

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

void vis_tell_user(const std::string & msg) {
    static std::mutex m;
    static std::set<std::string> said;
    std::lock_guard<std::mutex> lock(m);
    if (said.insert(msg).second) {
        std::fprintf(stderr, "vis-moe: %s\n", msg.c_str());
        std::fflush(stderr);
    }
}
