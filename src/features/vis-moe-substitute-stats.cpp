// vis-moe-substitute-stats.cpp - substitution's stats: its section of --moe-stats, the totals of
// llama_vis_moe_get_sub_stats, back to zero (vis-moe-substitute.h).
#include "vis-moe-substitute.h"
#include "vis-moe-context.h"

#include <cinttypes>
#include <cstdio>
#include <string>

void vis_moe_substitute::stats_reset() {
    for (auto & st : layer_stats) {
        st = {};
    }
}

void vis_moe_total_sub_stats(const vis_moe_context & vm, llama_vis_moe_sub_stats & tot) {
    tot = {};
    if (!vm.sub) {
        return;
    }
    for (size_t il = 0; il < vm.layers.size(); ++il) {
        const auto & s = vm.sub->stats((int) il);
        tot.n_tokens += s.n_tokens;
        tot.n_tokens_substituted += s.n_tokens_substituted;
        tot.n_missing += s.n_missing;
        for (int i = 0; i < LLAMA_VIS_SUB_N_OUTCOMES; ++i) {
            tot.outcomes[i] += s.outcomes[i];
        }
        tot.bytes_saved += s.bytes_saved;
        tot.bg_fetches += s.bg_fetches;
        tot.bg_wait_us += s.bg_wait_us;
    }
}

static void print_sub_row(const std::string & label, const llama_vis_moe_sub_stats & s) {
    const int64_t * o = s.outcomes;
    std::fprintf(stderr, "vis-moe: %5s %9" PRId64 " %8" PRId64 " %8" PRId64 " %8" PRId64 " %6" PRId64 " %6" PRId64 " %6" PRId64
                         " %6" PRId64 " %6" PRId64 " %6" PRId64 " %6" PRId64 " %6" PRId64 " %6" PRId64 " %10.2f %7" PRId64 " %8.2f\n",
                 label.c_str(), s.n_tokens, s.n_missing, o[LLAMA_VIS_SUB_SUBSTITUTED], o[LLAMA_VIS_SUB_DROPPED], o[LLAMA_VIS_SUB_BLOCKED_TAE],
                 o[LLAMA_VIS_SUB_BLOCKED_MARGIN], o[LLAMA_VIS_SUB_BLOCKED_BETA], o[LLAMA_VIS_SUB_BLOCKED_BUDGET],
                 o[LLAMA_VIS_SUB_BLOCKED_WEIGHT], o[LLAMA_VIS_SUB_BLOCKED_RANK], o[LLAMA_VIS_SUB_NO_CANDIDATE], o[LLAMA_VIS_SUB_NEEDED_ANYWAY],
                 o[LLAMA_VIS_SUB_NOT_ELIGIBLE], s.bytes_saved / 1048576.0, s.bg_fetches, s.bg_wait_us / 1000.0);
}

void vis_moe_substitute::stats_print(const vis_moe_context & vm) const {
    std::fprintf(stderr, "vis-moe: substitution (--moe-substitute %s): missing (token, expert) pairs by outcome\n",
                 mode_name());
    std::fprintf(stderr, "vis-moe: %5s %9s %8s %8s %8s %6s %6s %6s %6s %6s %6s %6s %6s %6s %10s %7s %8s\n", "layer",
                 "tokens", "missing", "subst", "dropped", "tae", "margin", "beta", "budget", "weight", "rank", "nocand", "anyway", "prefil",
                 "MiB saved", "bg read", "bg wait");
    for (size_t il = 0; il < vm.layers.size(); ++il) {
        if (vm.layers[il].stats.managed) {
            print_sub_row(std::to_string(il), layer_stats[il]);
        }
    }
    llama_vis_moe_sub_stats t;
    vis_moe_total_sub_stats(vm, t);
    print_sub_row("total", t);
    const bool drop = rule_mode() == VIS_SUB_DROP;
    std::fprintf(stderr, "vis-moe: %s: %" PRId64 " of %" PRId64 " token-layers %s (%.2f per token "
                         "and layer); %.2f MiB not read before their layer, ~%.1f ms of reads at this run's rate\n",
                 drop ? "drop" : "substitution", t.n_tokens_substituted, t.n_tokens,
                 drop ? "dropped an expert" : "ran a stand-in",
                 t.n_tokens ? (double) t.outcomes[drop ? LLAMA_VIS_SUB_DROPPED : LLAMA_VIS_SUB_SUBSTITUTED] / t.n_tokens : 0.0,
                 t.bytes_saved / 1048576.0, vis_moe_stall_saved_us(vm, t.bytes_saved) / 1000.0);
}
