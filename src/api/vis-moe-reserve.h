// vis-moe-reserve.h - the fixed part of the runtime reserve (llama_vis_moe_estimate_reserve, vis-moe-plan.cpp), in
// two named halves because two readers need one of them: the configurator's cost model (vis-moe-configure.cpp: the
// headroom left to the kernel is where a plan's pageable resident weights stay in the page cache) and borrowed slots
// (vis-moe-borrow.cpp: what the process may hold resident, measured).  In src/api so that both layers may read it.
#pragma once

#include <cstdint>

// the binary, libraries and heap: llama-cli's VmRSS less every planned part measured 60 MiB on the testbed and 68 on
// the 48-layer model (docs/paging.md#budgets)
constexpr int64_t VIS_MOE_RESERVE_RUNTIME = 68ll << 20;
// left to the kernel inside a memory cgroup: planned to the last MiB, the 48-layer model at -ub 64 in a 4 GiB cgroup
// faulted file pages back in for minutes (266k-340k major faults); planned 36 MiB short of the limit it ran in 30 s
// (8 faults).  These are the pages a plan's pageable resident weights live in (docs/planning.md#cost-model)
constexpr int64_t VIS_MOE_RESERVE_KERNEL = 28ll << 20;
