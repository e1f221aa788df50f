// vis-moe-store.h - the backing tiers of the expert cache (docs/paging.md), one header for all of them:
//
//   tier 1  device slabs              src/core/vis-moe-attach.cpp (slabs), src/core/vis-moe-passes.cpp (slot table)
//   tier 2  host-RAM expert cache     vis_host_cache       vis-moe-host-cache.{h,cpp} (its own byte budget and LRU)
//   tier 3  the GGUF file on NVMe     vis_io_pool          vis-moe-io-pool.{h,cpp} (one positioned read per expert slice)
//           deferred expert tensors   vis_moe_deferred     vis-moe-deferred.{h,cpp} (where their bytes live)
//
// Routed-expert tensors of managed layers are "deferred" at model load (patch
// 0004): they get a mapped address like upstream's lazy tensors but are never
// read by the loader.  The cache reads single experts from the file on demand.
#pragma once

#include "vis-moe-deferred.h"
#include "vis-moe-host-cache.h"
#include "vis-moe-io-pool.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>
