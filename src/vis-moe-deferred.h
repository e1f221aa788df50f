// vis-moe-deferred.h - deferred expert tensors (docs/paging.md, tier 3): at model load (patch 0004) the
// routed-expert tensors of managed layers are mapped like upstream's lazy tensors but never read; this registry
// records, per tensor, the opened GGUF file and where its experts' bytes live, for the reads of vis-moe-io-pool.h.
#pragma once

#include "ggml.h"

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

// ---- model load (patch 0004, llama_model_loader::create_tensor) -------------

// Should tensor `name` of layer `bid` be deferred (not loaded; read per expert on demand)?
// Decided from the process-wide vis-moe parameters at load time.
bool vis_moe_defer_tensor(const void * loader, const char * name, int bid, int64_t n_expert);
// Every tensor created by the loader passes here: a deferred one records where its
// bytes live in the file (fd of the loader's file, data offset); any other clears a
// stale record for the same pointer.
void vis_moe_tensor_created(const ggml_tensor * t, bool deferred, int fd, uint64_t offs);

// ---- the file and the registry ------------------------------------------------

struct vis_io_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// one opened GGUF file
struct vis_gguf_file {
    std::string path;
    int      fd        = -1;   // buffered reads
    int      fd_direct = -1;   // O_DIRECT, -1 where the filesystem refuses it
    uint64_t size      = 0;
    int64_t  mtime_ns  = 0;
    int64_t  ctime_ns  = 0;
    uint64_t ino       = 0;
    ~vis_gguf_file();
    // throws vis_io_error if the file's size, mtime, ctime or inode changed since it was opened (a truncation,
    // an append, an in-place rewrite even with the mtime restored)
    void check_unchanged() const;
};

// open `path` for expert reads: a buffered descriptor (POSIX_FADV_RANDOM), an O_DIRECT one where the filesystem
// allows it, and the size, times and inode check_unchanged compares with.  nullptr and the system's reason in
// `err` when it cannot be opened.  The model's own files (vis_moe_tensor_created) and shadow sidecars open this way.
std::shared_ptr<vis_gguf_file> vis_gguf_file_open(const std::string & path, std::string & err);

// where the bytes of one deferred expert tensor live
struct vis_deferred_tensor {
    std::shared_ptr<vis_gguf_file> file;
    std::string name;
    uint64_t    offs     = 0;  // file offset of expert 0
    size_t      nb2      = 0;  // bytes per expert
    int64_t     n_expert = 0;
};

// record of a deferred tensor, or nullptr
const vis_deferred_tensor * vis_moe_deferred(const ggml_tensor * t);
