// vis-moe-deferred.h - deferred expert tensors (docs/paging.md, tier 3): at model load (patch 0004) the
// routed-expert tensors of managed layers are mapped like upstream's lazy tensors but never read; this registry
// records, per tensor, the opened GGUF file and where its experts' bytes live, for the reads of vis-moe-io-pool.h.
#pragma once

#include "ggml.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

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
    uint64_t dev       = 0;
    uint64_t nlink     = 0;    // link count at open: a ctime moved by a rename over the path or an rm is no rewrite
    ~vis_gguf_file();
    // throws vis_io_error if the open file's size, mtime, ctime or inode changed since it was opened (a truncation,
    // an append, an in-place rewrite even with the mtime restored).  The open descriptor is checked, never the
    // path: renaming a new file over the path or removing it leaves the loaded model's bytes in place, and its
    // ctime moves with the link count, which is not reported.  A file found shorter than at load also has every
    // mapping of it past the new end replaced by zero pages first (vis_unmap_past_end): the ubatch fails with this
    // error instead of the process dying of SIGBUS on a resident tensor past the cut.
    void check_unchanged() const;
    mutable std::atomic<uint64_t> unmapped_from{UINT64_MAX};  // the size past which the mappings were replaced
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
    std::vector<uint64_t> sums;  // vis_bytes_sum of each expert's slice, checked at each read; empty: not checked
                                 // (the model's own tensors; shadow sidecars store them, docs/shadow.md)
};

// the checksum of n bytes: n + sum_i (w_i + 1) * (2 i + 1) mod 2^64 over their little-endian u32 words w_i
// (zero-padded); a change of any one word changes it.  The router hash's per-tensor term (vis-moe-profile.h) and
// each shadow expert's stored checksum (pyvis.runtime.profile.bytes_sum in Python)
uint64_t vis_bytes_sum(const void * data, size_t n);

// record of a deferred tensor, or nullptr
const vis_deferred_tensor * vis_moe_deferred(const ggml_tensor * t);
