// vis-pages.cpp - giving pages of host memory back to the kernel (vis-pages.h).
#include "vis-pages.h"

#include <cstdio>
#include <cstring>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

int64_t vis_release_pages(void * p, size_t n, bool unlock, bool zero_edges) {
    if (!p || n == 0) {
        return 0;
    }
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t b0   = (uintptr_t) p, b1 = b0 + n;
    const uintptr_t a0   = (b0 + page - 1) & ~(page - 1);
    const uintptr_t a1   = b1 & ~(page - 1);
    if (a1 <= a0) {
        if (zero_edges) {
            std::memset(p, 0, n);
        }
        return 0;
    }
    if (zero_edges) {
        std::memset(p, 0, a0 - b0);
        std::memset((void *) a1, 0, b1 - a1);
    }
    if (unlock) {
        munlock((void *) a0, a1 - a0);
    }
    return madvise((void *) a0, a1 - a0, MADV_DONTNEED) == 0 ? (int64_t) (a1 - a0) : 0;
}

void vis_buffer_clear_lazy(ggml_backend_buffer_t buf) {
    if (!buf || ggml_backend_buffer_get_size(buf) == 0 || !ggml_backend_buffer_is_host(buf) ||
        !ggml_backend_buffer_get_base(buf)) {
        if (buf) {
            ggml_backend_buffer_clear(buf, 0);
        }
        return;
    }
    const size_t n = ggml_backend_buffer_get_size(buf);
    if (vis_release_pages(ggml_backend_buffer_get_base(buf), n, false, true) == 0) {
        ggml_backend_buffer_clear(buf, 0);  // madvise refused (or no whole page): the upstream clear
    }
}

int64_t vis_resident_bytes(const void * p, size_t n) {
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t a0   = ((uintptr_t) p + page - 1) & ~(page - 1);
    const uintptr_t a1   = ((uintptr_t) p + n) & ~(page - 1);
    if (!p || a1 <= a0) {
        return 0;
    }
    std::vector<unsigned char> v((a1 - a0) / page);
    if (mincore((void *) a0, a1 - a0, v.data()) != 0) {
        return -1;
    }
    int64_t r = 0;
    for (unsigned char c : v) {
        r += c & 1;
    }
    return r * (int64_t) page;
}

int64_t vis_process_rss() {
    FILE * f = std::fopen("/proc/self/statm", "r");
    if (!f) {
        return -1;
    }
    long long size = 0, resident = -1;
    const int got = std::fscanf(f, "%lld %lld", &size, &resident);
    std::fclose(f);
    return got == 2 && resident >= 0 ? (int64_t) resident * (int64_t) sysconf(_SC_PAGESIZE) : -1;
}
