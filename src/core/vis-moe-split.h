// vis-moe-split.h - per-layer slot counts from one expert budget (docs/planning.md#per-layer-slot-counts).
//
// The rule (llama_vis_moe_split_slots, llama-vis.h) turns per-layer miss curves into slot counts with the same
// total as the even split; pyvis.runtime.cachesim_split.split_slots is the same rule in Python (tested equal).
// The curves come from a split file (VIS_MOE_SLOT_SPLIT=FILE, written by `pyvis plan --profile TRACE
// --write-split FILE`): one line per MoE layer of the model the trace was recorded on, the misses per decode token
// with 0..n_expert slots.  The attach applies the rule to the slot count its plan gives every managed layer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

struct vis_moe_split_file {
    std::string path;
    int n_expert = 0;
    int top_k    = 0;                    // the profile's top-k: the rule's floor
    std::vector<int>    layers;          // the recorded layer ids, in order (one per MoE layer)
    std::vector<double> curves;          // [layers][n_expert + 1]
    const double * curve(size_t i) const { return curves.data() + i * (size_t) (n_expert + 1); }
};

// read and check FILE against a model's MoE layers and experts: anything else (unreadable, not a split file, a
// trace named instead of a split file, another model's layer or expert count) throws naming the file, the
// mismatch and the command that makes one
vis_moe_split_file vis_moe_split_file_load(const std::string & path, int n_moe_layers, int n_expert);

// the file's curves of the managed layers (`managed_pos`: their positions among the model's MoE layers), as
// llama_vis_moe_split_slots and llama_vis_moe_extra_slots read them: [managed layers][n_expert + 1]
std::vector<double> vis_moe_split_curves(const vis_moe_split_file & f, const std::vector<int> & managed_pos);

// the per-layer slot counts of the managed layers (`managed_pos`: their positions among the model's MoE layers)
// for `slots` each on average, bytes of one slot of each in `row_bytes`: the rule on the file's curves
std::vector<int> vis_moe_split_apply(const vis_moe_split_file & f, const std::vector<int> & managed_pos, int slots,
                                     const std::vector<int64_t> & row_bytes);
