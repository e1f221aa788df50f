// vis-check.h - the check macro and exit status of the C++ tests (test-vis-*.cpp).
#pragma once

#include <cstdio>

static int g_failures = 0;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            std::fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);     \
            g_failures++;                                                            \
        }                                                                            \
    } while (0)

// the exit status of a test's main(): 0 and "NAME: ok", or 1 with the count of failed checks
static inline int vis_check_done(const char * name) {
    if (g_failures) {
        std::fprintf(stderr, "%s: %d check(s) failed\n", name, g_failures);
        return 1;
    }
    std::printf("%s: ok\n", name);
    return 0;
}
