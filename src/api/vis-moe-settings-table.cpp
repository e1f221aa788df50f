// vis-moe-settings-table.cpp - the table of every --moe-* flag: name, variable, value hint, help and a
// strict parser per row, the built-in defaults and the range check of a whole settings value
// (vis-moe-settings.h).  Where values live (environment, process, thread): vis-moe-settings.cpp.
#include "vis-moe-settings.h"
#include "vis-moe-policy.h"

#include <cctype>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace {

constexpr long long MAX_SLOTS  = 1 << 16;   // far above any model's expert count (LLAMA_MAX_EXPERTS)
constexpr long long MAX_LAYERS = 1 << 16;
constexpr long long MAX_MIB    = 1ll << 30; // 1 PiB
constexpr long long MAX_IO     = 64;
constexpr long long MAX_STREAM = 1 << 16;
constexpr long long MAX_OVERLAP = 64;      // miss passes of an overlapped decode step: at most the top-k
constexpr long long MAX_SUB_BUDGET = 64;    // substitutions per token per layer: at most the top-k
constexpr long long MAX_PREFETCH   = 1 << 16;  // experts prefetched per layer per step: at most the expert count

using vis_error = std::invalid_argument;

// [+-]digits and nothing else, within [lo, hi]
long long parse_int(const std::string & what, const std::string & v, long long lo, long long hi, const char * note = "") {
    size_t i = (!v.empty() && (v[0] == '-' || v[0] == '+')) ? 1 : 0;
    bool ok = i < v.size();
    for (size_t j = i; ok && j < v.size(); ++j) {
        ok = std::isdigit((unsigned char) v[j]) != 0;
    }
    errno = 0;
    const long long r = ok ? std::strtoll(v.c_str(), nullptr, 10) : 0;
    if (!ok || errno == ERANGE || r < lo || r > hi) {
        throw vis_error(what + ": expected an integer in " + std::to_string(lo) + ".." + std::to_string(hi) + note +
                        ", got '" + v + "'");
    }
    return r;
}

// auto (-1, if allowed) | on (1) | off (0); 1/0 and true/false are accepted as on/off
int32_t parse_switch(const std::string & what, const std::string & v, bool allow_auto) {
    if (allow_auto && v == "auto") return -1;
    if (v == "on"  || v == "1" || v == "true")  return 1;
    if (v == "off" || v == "0" || v == "false") return 0;
    throw vis_error(what + ": expected " + (allow_auto ? "auto, on or off" : "on or off") + ", got '" + v + "'");
}

// a finite decimal number and nothing else, within [lo, hi]
// a file path: any string but the empty one
std::string parse_path(const std::string & what, const std::string & v) {
    if (v.empty()) {
        throw vis_error(what + ": expected a file path, got ''");
    }
    return v;
}

double parse_real(const std::string & what, const std::string & v, double lo, double hi, const char * note = "") {
    char * end = nullptr;
    errno = 0;
    const double r = v.empty() || std::isspace((unsigned char) v[0]) ? NAN : std::strtod(v.c_str(), &end);
    if (v.empty() || !end || *end != '\0' || errno == ERANGE || !std::isfinite(r) || r < lo || r > hi) {
        char buf[96];
        std::snprintf(buf, sizeof(buf), "a number in %g..%g", lo, hi);
        throw vis_error(what + ": expected " + buf + note + ", got '" + v + "'");
    }
    return r;
}

using apply_fn = void (*)(vis_moe_settings & s, const std::string & what, const std::string & value);

// ---- a value spelled as its flag takes it (llama_vis_moe_get_value): applying it gives the same setting ----
std::string show_int(long long v) {
    return std::to_string(v);
}

// the shortest decimal that reads back as v
std::string show_real(double v) {
    char buf[40];
    for (int digits = 6; digits <= 17; ++digits) {
        std::snprintf(buf, sizeof(buf), "%.*g", digits, v);
        if (std::strtod(buf, nullptr) == v) {
            break;
        }
    }
    return buf;
}

std::string show_switch(int32_t v) {
    return v ? "on" : "off";
}

// -1 | 1 | 0 -> auto | on | off
std::string show_auto(int32_t v) {
    return v < 0 ? "auto" : show_switch(v);
}

// -1 | 0 | MIB -> auto | off | MIB
std::string show_mib(int64_t v) {
    return v < 0 ? "auto" : v == 0 ? "off" : show_int(v);
}

// the word of an enum value (words in the enum's order)
template <size_t N> std::string show_word(const char * const (&words)[N], int32_t v) {
    return v >= 0 && (size_t) v < N ? words[v] : show_int(v);
}

// the words of an enum, in its order
const char * const POLICY_WORDS[]  = { "lru", "lfu", "lfu-adapt" };                                // vis_policy_kind
const char * const SUB_WORDS[]     = { "off", "router", "buddy", "auto", "drop" };                   // vis_sub_mode
const char * const PREDICT_WORDS[] = { "off", "next-router", "coact", "freq", "random", "auto", "mlp" };
const char * const PREC_WORDS[]    = { "off", "vision", "gate", "all", "auto" };                     // vis_prec_mode
const char * const MODE_WORDS[]    = { "exact", "fast" };                                            // vis_run_mode

std::string show_tae(const vis_moe_sub_settings & u) {
    if (u.tae_kind == VIS_TAE_OFF) {
        return "off";
    }
    return (u.tae_kind == VIS_TAE_PERCENTILE ? "p" : "") + show_real(u.tae);
}

#define SHOW(expr)   [](const vis_moe_settings & s) -> std::string { return expr; }
#define CLEAR(stmts) [](vis_moe_settings & s) { stmts; }

// who decides a row (llama_vis_moe_scope) and what its value is (llama_vis_moe_value_type)
constexpr int32_t USER = LLAMA_VIS_MOE_SCOPE_USER, VISION = LLAMA_VIS_MOE_SCOPE_VISION, KNOB = LLAMA_VIS_MOE_SCOPE_KNOB;
constexpr int32_t V_SWITCH = LLAMA_VIS_MOE_VALUE_SWITCH, V_INT = LLAMA_VIS_MOE_VALUE_INT,
                  V_REAL = LLAMA_VIS_MOE_VALUE_REAL, V_WORD = LLAMA_VIS_MOE_VALUE_WORD,
                  V_INT_OR_WORD = LLAMA_VIS_MOE_VALUE_INT_OR_WORD, V_REAL_OR_WORD = LLAMA_VIS_MOE_VALUE_REAL_OR_WORD,
                  V_TEXT = LLAMA_VIS_MOE_VALUE_TEXT, V_FILE = LLAMA_VIS_MOE_VALUE_FILE;

using flag_row = vis_moe_flag_row;

const flag_row ROWS[] = {
    { "--moe-slots", "VIS_MOE_SLOTS", "N",
      "vis-moe: expert slots per managed MoE layer; routed experts are loaded into them on demand\n"
      "(fewer than the model's top-k run exactly, in passes; >= its expert count = everything resident; default: 0 = off)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.params.n_slots = (int32_t) parse_int(w, v, 0, MAX_SLOTS, " (0 = off)"); },
      USER, V_INT, SHOW(show_int(s.params.n_slots)) },
    { "--moe-policy", "VIS_MOE_POLICY", "lru|lfu|lfu-adapt",
      "vis-moe: eviction policy of the expert slots: lru = least recently used; lfu = least frequently used with\n"
      "decay 0.95 per step, history kept for evicted experts; lfu-adapt = decay 0.5 or 0.95, whichever a ghost\n"
      "cache of each missed less lately (docs/policies.md) (default: lfu-adapt)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          if      (v == "lru") s.policy = VIS_POLICY_LRU;
          else if (v == "lfu") s.policy = VIS_POLICY_LFU;
          else if (v == "lfu-adapt") s.policy = VIS_POLICY_LFU_ADAPT;
          else throw vis_error(w + ": expected lru, lfu or lfu-adapt, got '" + v + "'"); },
      KNOB, V_WORD, SHOW(show_word(POLICY_WORDS, s.policy)) },
    { "--moe-cache-mib", "VIS_MOE_CACHE_MIB", "M",
      "vis-moe: derive --moe-slots from a total slab budget of M MiB over the managed layers (default: 0 = off)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.params.cache_mib = parse_int(w, v, 0, MAX_MIB, " (0 = off)"); },
      KNOB, V_INT, SHOW(show_int(s.params.cache_mib)) },
    { "--moe-pinned-layers", "VIS_MOE_PINNED", "L",
      "vis-moe: keep the first L MoE layers fully resident (-1 = all; default: 0)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.params.n_pinned = (int32_t) parse_int(w, v, -1, MAX_LAYERS, " (-1 = all)"); },
      USER, V_INT, SHOW(show_int(s.params.n_pinned)) },
    { "--moe-stats", "VIS_MOE_STATS", nullptr,
      "vis-moe: print per-layer expert cache stats (hits, misses, bytes loaded, stall) to stderr at exit",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.params.print_stats = v.empty() ? 1 : parse_switch(w, v, false); },
      USER, V_SWITCH, SHOW(show_switch(s.params.print_stats)) },
    { "--moe-trace", "VIS_MOE_TRACE", "FILE",
      "vis-moe: record every routing decision to FILE (binary; read with pyvis.runtime.trace). An existing GGUF or\n"
      "model file is never overwritten",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          if (v.empty()) {
              throw vis_error(w + ": expected a file path, got ''");
          }
          s.trace_path = v; },
      USER, V_FILE, SHOW(s.trace_path), CLEAR(s.trace_path.clear()) },
    { "--moe-csv", "VIS_MOE_CSV", "FILE",
      "vis-moe: write one CSV row per ubatch (a generated token is one decode ubatch): time, compute and read-wait\n"
      "ms, hits, misses by tier, bytes read, reads ahead, lossy events (docs/telemetry.md; pyvis report FILE).\n"
      "Never overwrites a model, an input or any file but an earlier --moe-csv",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.csv_path = parse_path(w, v); },
      USER, V_FILE, SHOW(s.csv_path), CLEAR(s.csv_path.clear()) },
    { "--moe-store", "VIS_MOE_STORE", "file|model",
      "vis-moe: where missed experts come from: file = read each expert from the GGUF on demand; managed\n"
      "experts are not loaded at start (tier 3); model = llama.cpp loads them and the cache copies (default: file)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          if (v != "file" && v != "model") {
              throw vis_error(w + ": expected file or model, got '" + v + "'");
          }
          s.tier.store = v == "model" ? 1 : 0; },
      KNOB, V_WORD, SHOW(std::string(s.tier.store ? "model" : "file")) },
    { "--moe-host-mib", "VIS_MOE_HOST_MIB", "auto|N",
      "vis-moe: host-RAM expert cache (tier 2) between the slabs and the file, in MiB; auto = planned by\n"
      "--moe-mem, else 0 (default: auto)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.tier.host_mib = v == "auto" ? -1 : parse_int(w, v, 0, MAX_MIB, " (or auto)"); },
      KNOB, V_INT_OR_WORD, SHOW(s.tier.host_mib < 0 ? "auto" : show_int(s.tier.host_mib)) },
    { "--moe-mem", "VIS_MOE_MEM", "auto|off|MIB",
      "vis-moe: memory budget of the whole process; slots and host cache are sized to fit it next to the\n"
      "resident weights, KV cache and compute buffers. auto = the real limit (cgroup v1/v2, MemAvailable)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.tier.mem_mib = v == "auto" ? -1 : v == "off" ? 0 : parse_int(w, v, 1, MAX_MIB, " MiB (or auto, off)"); },
      USER, V_INT_OR_WORD, SHOW(show_mib(s.tier.mem_mib)) },
    { "--moe-io-threads", "VIS_MOE_IO_THREADS", "N",
      "vis-moe: parallel expert reads from the file (default: 4)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.tier.io_threads = (int32_t) parse_int(w, v, 1, MAX_IO); },
      KNOB, V_INT, SHOW(show_int(s.tier.io_threads)) },
    { "--moe-direct-io", "VIS_MOE_DIRECT_IO", "auto|on|off",
      "vis-moe: read experts with O_DIRECT (no page-cache copy); off = buffered reads whose pages are\n"
      "dropped after (default: auto)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.tier.direct_io = parse_switch(w, v, true); },
      KNOB, V_WORD, SHOW(show_auto(s.tier.direct_io)) },
    { "--moe-unified", "VIS_MOE_UNIFIED", "auto|on|off",
      "vis-moe: unified memory (CPU; Jetson with GGML_CUDA_ENABLE_UNIFIED_MEMORY=1): read experts straight\n"
      "into the slabs, and keep nothing in the host cache that a slab holds (default: auto)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.tier.unified = parse_switch(w, v, true); },
      KNOB, V_WORD, SHOW(show_auto(s.tier.unified)) },
    { "--moe-mlock", "VIS_MOE_MLOCK", "on|off",
      "vis-moe: lock the slabs and the host cache in memory so they are never swapped (default: on)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.tier.mlock = parse_switch(w, v, false); },
      KNOB, V_SWITCH, SHOW(show_switch(s.tier.mlock)) },
    { "--moe-pin-mib", "VIS_MOE_PIN_MIB", "auto|off|MIB",
      "vis-moe: discrete GPU: most pinned (page-locked) host memory for the host cache and the staging buffers,\n"
      "in MiB; the rest is ordinary memory. auto = 25 % of MemTotal, off = never pin (default: auto)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.pin_mib = v == "auto" ? -1 : v == "off" ? 0 : parse_int(w, v, 1, MAX_MIB, " MiB (or auto, off)"); },
      KNOB, V_INT_OR_WORD, SHOW(show_mib(s.pin_mib)) },
    { "--moe-stream-passes", "VIS_MOE_STREAM_PASSES", "N",
      "vis-moe: a ubatch that would need more than N passes in a managed layer reads that layer's experts\n"
      "through the mapping instead (prefill streaming; 0 = never; default: 8)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.stream_passes = (int32_t) parse_int(w, v, 0, MAX_STREAM, " (0 = never)"); },
      KNOB, V_INT, SHOW(show_int(s.stream_passes)) },
    { "--moe-stream-ahead", "VIS_MOE_STREAM_AHEAD", "on|off",
      "vis-moe: while a streamed layer computes, have the kernel read the next managed layer's experts into the\n"
      "page cache from a background thread (prefill read-ahead; default: off, measured slower: docs/knobs.md)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.stream_ahead = parse_switch(w, v, false); },
      KNOB, V_SWITCH, SHOW(show_switch(s.stream_ahead)) },
    { "--moe-overlap", "VIS_MOE_OVERLAP", "on|off|N",
      "vis-moe: decode reads a layer's misses in the background while its resident experts compute, each miss\n"
      "computed in a pass of its own as soon as its read lands (exact). on = up to k such passes (one miss each),\n"
      "N = at most N, off = the misses are read before the layer computes (default: on)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.overlap = v == "on" ? -1 : v == "off" ? 0 : (int32_t) parse_int(w, v, 1, MAX_OVERLAP, " (or on, off)"); },
      KNOB, V_INT_OR_WORD, SHOW(s.overlap < 0 ? "on" : s.overlap == 0 ? "off" : show_int(s.overlap)) },
    { "--moe-stream-lend", "VIS_MOE_STREAM_LEND", "auto|on|off",
      "vis-moe: a ubatch that streams a layer first gives the slabs' memory to the page cache (their slots are\n"
      "emptied and refill on demand). auto = when the --moe-mem plan leaves the page cache less than the\n"
      "streamed layers need (default: auto)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.stream_lend = parse_switch(w, v, true); },
      KNOB, V_WORD, SHOW(show_auto(s.stream_lend)) },
    { "--moe-stream-stage", "VIS_MOE_STREAM_STAGE", "on|off",
      "vis-moe: a ubatch that streams every managed layer reads each layer's experts with our own reads into\n"
      "staging buffers in the slabs (the next layer in the background while one computes), when the slabs\n"
      "hold a layer's experts; off = through the mapping and the page cache (default: on)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.stream_stage = parse_switch(w, v, false); },
      KNOB, V_SWITCH, SHOW(show_switch(s.stream_stage)) },
    { "--moe-substitute", "VIS_MOE_SUBSTITUTE", "off|router|buddy|drop|auto",
      "vis-moe (lossy): a token whose expert is not resident may run a resident stand-in with the missing\n"
      "expert's gate weight, while the expert is read in the background. router = the resident expert the\n"
      "token's router ranks highest; buddy = the first resident buddy of VIS_MOE_SUB_PROFILE; drop = skip the\n"
      "missing expert when its share of the token's gate weight is below --moe-sub-drop-share of an even split\n"
      "(CPU layers); auto = the measured default, exact for now: no setting was faster at < 1 % perplexity on the\n"
      "real-weights testbed (docs/substitution.md). Decode only unless --moe-sub-prefill (default: off)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          if      (v == "off")    s.sub.mode = VIS_SUB_OFF;
          else if (v == "router") s.sub.mode = VIS_SUB_ROUTER;
          else if (v == "buddy")  s.sub.mode = VIS_SUB_BUDDY;
          else if (v == "drop")   s.sub.mode = VIS_SUB_DROP;
          else if (v == "auto")   s.sub.mode = VIS_SUB_AUTO;
          else throw vis_error(w + ": expected off, router, buddy, drop or auto, got '" + v + "'");
          s.sub.mode_given = true; },
      USER, V_WORD, SHOW(s.sub.mode_given ? show_word(SUB_WORDS, s.sub.mode) : std::string()),
      CLEAR(s.sub.mode = VIS_SUB_OFF; s.sub.mode_given = false) },
    { "--moe-sub-profile", "VIS_MOE_SUB_PROFILE", "FILE",
      "vis-moe: buddy lists and routing-entropy percentiles of this model, from\n"
      "pyvis calibrate buddies -m MODEL --out FILE (needed by --moe-substitute buddy and --moe-sub-tae pN)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.sub.profile = parse_path(w, v); },
      KNOB, V_FILE, SHOW(s.sub.profile), CLEAR(s.sub.profile.clear()) },
    { "--moe-sub-tae", "VIS_MOE_SUB_TAE", "off|TAU|pN",
      "vis-moe: never substitute for a token whose normalised top-k routing entropy is <= TAU (0..1), or <= the\n"
      "N-th percentile (0..100) of its layer in VIS_MOE_SUB_PROFILE with pN (default: off)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          if (v == "off") {
              s.sub.tae_kind = VIS_TAE_OFF;
          } else if (!v.empty() && v[0] == 'p') {
              s.sub.tae_kind = VIS_TAE_PERCENTILE;
              s.sub.tae = parse_real(w, v.substr(1), 0, 100, " after 'p' (a percentile; or off, or TAU in 0..1)");
          } else {
              s.sub.tae_kind = VIS_TAE_ABSOLUTE;
              s.sub.tae = parse_real(w, v, 0, 1, " (or off, or pN with N in 0..100)");
          } },
      KNOB, V_TEXT, SHOW(show_tae(s.sub)) },
    { "--moe-sub-margin", "VIS_MOE_SUB_MARGIN", "off|G",
      "vis-moe: never substitute for a token whose top-1 minus top-2 share of its gate weight is >= G (0..1)\n"
      "(default: off)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.sub.margin = v == "off" ? -1 : parse_real(w, v, 0, 1, " (or off)"); },
      KNOB, V_REAL_OR_WORD, SHOW(s.sub.margin < 0 ? "off" : show_real(s.sub.margin)) },
    { "--moe-sub-beta", "VIS_MOE_SUB_BETA", "B",
      "vis-moe: substitute nothing in a layer whose ubatch misses more than the share B (0..1) of the experts it\n"
      "routes (default: 1 = no limit)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.sub.beta = parse_real(w, v, 0, 1); },
      KNOB, V_REAL, SHOW(show_real(s.sub.beta)) },
    { "--moe-sub-budget", "VIS_MOE_SUB_BUDGET", "N",
      "vis-moe: substitutions per token per layer, lowest gate weight first (default: 1)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.sub.budget = (int32_t) parse_int(w, v, 1, MAX_SUB_BUDGET); },
      KNOB, V_INT, SHOW(show_int(s.sub.budget)) },
    { "--moe-sub-weight", "VIS_MOE_SUB_WEIGHT", "W",
      "vis-moe: substitute only experts whose share of the token's gate weight is below W (0..1; default: 1)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.sub.weight = parse_real(w, v, 0, 1); },
      KNOB, V_REAL, SHOW(show_real(s.sub.weight)) },
    { "--moe-sub-rank", "VIS_MOE_SUB_RANK", "N",
      "vis-moe: substitute only a token's N lowest-ranked experts (N = 1: only its k-th; 0 = any; default: 0)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.sub.rank = (int32_t) parse_int(w, v, 0, MAX_SUB_BUDGET, " (0 = any)"); },
      KNOB, V_INT, SHOW(show_int(s.sub.rank)) },
    { "--moe-sub-drop-share", "VIS_MOE_SUB_DROP_SHARE", "F",
      "vis-moe: --moe-substitute drop: drop only a missing expert whose share of the token's gate weight is\n"
      "below F x 1/k, a fraction F (0..1) of an even split (default: 0.5)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.sub.drop_share = parse_real(w, v, 0, 1); },
      KNOB, V_REAL, SHOW(show_real(s.sub.drop_share)) },
    { "--moe-sub-renorm", "VIS_MOE_SUB_RENORM", "on|off",
      "vis-moe: --moe-substitute drop: scale a token's remaining gate weights up to the sum they had before\n"
      "the drop (default: off)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.sub.renorm = parse_switch(w, v, false); },
      KNOB, V_SWITCH, SHOW(show_switch(s.sub.renorm)) },
    { "--moe-sub-drop-read", "VIS_MOE_SUB_DROP_READ", "on|off",
      "vis-moe: --moe-substitute drop: read a dropped expert in the background so that later tokens may hit it;\n"
      "off = the drop saves its bytes (default: on)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.sub.drop_read = parse_switch(w, v, false); },
      KNOB, V_SWITCH, SHOW(show_switch(s.sub.drop_read)) },
    { "--moe-sub-prefill", "VIS_MOE_SUB_PREFILL", "on|off",
      "vis-moe: substitute in prefill ubatches too; changes the KV cache of every prompt token (default: off)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.sub.prefill = parse_switch(w, v, false) == 1; },
      KNOB, V_SWITCH, SHOW(show_switch(s.sub.prefill)) },
    { "--moe-predict", "VIS_MOE_PREDICT", "off|next-router|coact|freq|mlp|auto",
      "vis-moe: predict the experts of the next layers and read them in the background while this layer\n"
      "computes (exact: only when bytes arrive changes). next-router = the next layers' routers applied to this\n"
      "layer's input; coact = co-activation counts learned online; freq = the most used experts; mlp = the\n"
      "VisMMOE lookahead MLP of --moe-predict-profile; auto = the measured default (docs/prediction.md).\n"
      "Decode steps, file store (default: off; test-only values: docs/knobs.md)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          if      (v == "off")         s.predict.mode = VIS_PRED_OFF;
          else if (v == "next-router") s.predict.mode = VIS_PRED_NEXT_ROUTER;
          else if (v == "coact")       s.predict.mode = VIS_PRED_COACT;
          else if (v == "freq")        s.predict.mode = VIS_PRED_FREQ;
          else if (v == "mlp")         s.predict.mode = VIS_PRED_MLP;
          else if (v == "random")      s.predict.mode = VIS_PRED_RANDOM;
          else if (v == "auto")        s.predict.mode = VIS_PRED_AUTO;
          else throw vis_error(w + ": expected off, next-router, coact, freq, mlp, random or auto, got '" + v + "'"); },
      USER, V_WORD, SHOW(show_word(PREDICT_WORDS, s.predict.mode)) },
    { "--moe-predict-profile", "VIS_MOE_PREDICT_PROFILE", "FILE",
      "vis-moe: start --moe-predict coact / freq from this model's calibrated co-activation tables and expert\n"
      "frequencies, from pyvis calibrate predictor -m MODEL --out FILE (learning goes on online); --moe-predict\n"
      "mlp needs one fitted with --mlp (default: none)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.predict.profile = parse_path(w, v); },
      USER, V_FILE, SHOW(s.predict.profile), CLEAR(s.predict.profile.clear()) },
    { "--moe-shadow", "VIS_MOE_SHADOW", "FILE",
      "vis-moe: shadow experts: a low-bit copy of the routed experts from pyvis shadow MODEL --type T --out FILE\n"
      "(docs/precision.md); --moe-precision says when a miss may run from it (default: none)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.prec.shadow = parse_path(w, v); },
      USER, V_FILE, SHOW(s.prec.shadow), CLEAR(s.prec.shadow.clear()) },
    { "--moe-precision", "VIS_MOE_PRECISION", "off|vision|gate|auto",
      "vis-moe: serve a miss from its --moe-shadow copy (lossy) while the full expert is read in the background.\n"
      "vision = experts only image tokens route, in a ubatch whose image share is >= --moe-prec-vision;\n"
      "gate = decode misses whose share of the token's gate weight is < --moe-prec-gate; auto = vision and gate\n"
      "under a stall-share controller (--moe-prec-target) (default: off; test-only values: docs/knobs.md)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          if      (v == "off")    s.prec.mode = VIS_PREC_OFF;
          else if (v == "vision") s.prec.mode = VIS_PREC_VISION;
          else if (v == "gate")   s.prec.mode = VIS_PREC_GATE;
          else if (v == "all")    s.prec.mode = VIS_PREC_ALL;
          else if (v == "auto")   s.prec.mode = VIS_PREC_AUTO;
          else throw vis_error(w + ": expected off, vision, gate, all or auto, got '" + v + "'"); },
      USER, V_WORD, SHOW(show_word(PREC_WORDS, s.prec.mode)) },
    { "--moe-prec-vision", "VIS_MOE_PREC_VISION", "S",
      "vis-moe: --moe-precision vision: a ubatch whose share of image tokens is at least S (0..1) is\n"
      "vision-dominated (default: 0.5)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.prec.vision = parse_real(w, v, 0, 1); },
      KNOB, V_REAL, SHOW(show_real(s.prec.vision)) },
    { "--moe-prec-gate", "VIS_MOE_PREC_GATE", "W",
      "vis-moe: --moe-precision gate: a missing expert runs from its shadow when its share of the token's gate\n"
      "weight is below W (0..1) for every token of the decode step (default: 0.1)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.prec.gate = parse_real(w, v, 0, 1); },
      KNOB, V_REAL, SHOW(show_real(s.prec.gate)) },
    { "--moe-prec-target", "VIS_MOE_PREC_TARGET", "S",
      "vis-moe: --moe-precision auto: the share of a ubatch's time spent waiting for expert reads that the\n"
      "controller aims below (0..1): above it more eligible misses run from shadows, below it fewer (default: 0.25)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.prec.target = parse_real(w, v, 0, 1); },
      KNOB, V_REAL, SHOW(show_real(s.prec.target)) },
    { "--moe-prec-refetch", "VIS_MOE_PREC_REFETCH", "on|off",
      "vis-moe: read the full-precision expert of a miss served from its shadow in the background, so later\n"
      "tokens hit it (default: on)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.prec.refetch = parse_switch(w, v, false); },
      KNOB, V_SWITCH, SHOW(show_switch(s.prec.refetch)) },
    { "--moe-shadow-slots", "VIS_MOE_SHADOW_SLOTS", "auto|N",
      "vis-moe: slots for shadow experts per managed layer (auto = as many as the layer's full slots; under\n"
      "--moe-mem / --moe-cache-mib they share the budget) (default: auto)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.prec.shadow_slots = v == "auto" ? -1 : (int32_t) parse_int(w, v, 1, MAX_SLOTS, " (or auto)"); },
      KNOB, V_INT_OR_WORD, SHOW(s.prec.shadow_slots < 0 ? "auto" : show_int(s.prec.shadow_slots)) },
    { "--moe-capacity", "VIS_MOE_CAPACITY", "off|auto|N",
      "vis-moe: entropy-weighted capacity (lossy, MACS): in a ubatch with image tokens, a managed layer loads at\n"
      "most N*(1+rho*(R_v-0.5)) missing experts that only image tokens route (R_v: the image tokens' share of the\n"
      "entropy weights); the other image pairs run the best-scored expert in memory instead. Text tokens are never\n"
      "rerouted. auto = N is the layer's slot count (default: off)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.cap.capacity = v == "off" ? -1 : v == "auto" ? 0 : (int32_t) parse_int(w, v, 1, MAX_SLOTS, " (or off, auto)"); },
      VISION, V_INT_OR_WORD,
      SHOW(s.cap.capacity < 0 ? "off" : s.cap.capacity == 0 ? "auto" : show_int(s.cap.capacity)) },
    { "--moe-cap-rho", "VIS_MOE_CAP_RHO", "R",
      "vis-moe: --moe-capacity: how strongly the effective visual ratio and the experts' modality bias scale it\n"
      "(0..4; default: 1)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.cap.rho = parse_real(w, v, 0, 4); },
      KNOB, V_REAL, SHOW(show_real(s.cap.rho)) },
    { "--moe-cap-delta", "VIS_MOE_CAP_DELTA", "D",
      "vis-moe: --moe-capacity: entropy sensitivity of an image token's weight sigmoid(-D*z) (0..16; default: 1)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.cap.delta = parse_real(w, v, 0, 16); },
      KNOB, V_REAL, SHOW(show_real(s.cap.delta)) },
    { "--moe-cap-drop", "VIS_MOE_CAP_DROP", "on|off",
      "vis-moe: --moe-capacity: drop an image pair that no expert in memory can take (CPU; off: load its expert)\n"
      "(default: on)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.cap.drop = parse_switch(w, v, false); },
      KNOB, V_SWITCH, SHOW(show_switch(s.cap.drop)) },
    { "--moe-cap-profile", "VIS_MOE_CAP_PROFILE", "FILE",
      "vis-moe: --moe-capacity: experts' modality bias (visual/text/shared) from pyvis calibrate modality\n"
      "(default: none, every expert shared)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.cap.profile = parse_path(w, v); },
      KNOB, V_FILE, SHOW(s.cap.profile), CLEAR(s.cap.profile.clear()) },
    { "--moe-topk", "VIS_MOE_TOPK", "N",
      "vis-moe: lossy: each token runs its N highest-weighted experts instead of the model's k, weights\n"
      "renormalised as the model does (= upstream with expert_used_count N; 0 = off; default: 0)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.topk = (int32_t) parse_int(w, v, 0, MAX_SUB_BUDGET, " (0 = off)"); },
      USER, V_INT, SHOW(show_int(s.topk)) },
    { "--moe-mode", "VIS_MOE_MODE", "exact|fast",
      "vis-moe: exact = the model's output (default); fast = lossy: each token runs its ceil(2k/3)\n"
      "highest-weighted of the model's k experts (--moe-topk), the set measured in docs/mode.md; a --moe-topk\n"
      "given with it wins. The run logs one line with what fast turned on",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          if      (v == "exact") s.mode = VIS_MODE_EXACT;
          else if (v == "fast")  s.mode = VIS_MODE_FAST;
          else throw vis_error(w + ": expected exact or fast, got '" + v + "'"); },
      USER, V_WORD, SHOW(show_word(MODE_WORDS, s.mode)) },
    { "--moe-lookahead", "VIS_MOE_LOOKAHEAD", "W",
      "vis-moe: layers ahead that --moe-predict prefetches for, l+1 .. l+W (default: 1)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.predict.lookahead = (int32_t) parse_int(w, v, 1, VIS_MAX_LOOKAHEAD); },
      KNOB, V_INT, SHOW(show_int(s.predict.lookahead)) },
    { "--moe-prefetch-budget", "VIS_MOE_PREFETCH_BUDGET", "auto|B",
      "vis-moe: experts --moe-predict may read ahead per layer and step, most likely first (auto = the model's\n"
      "top-k; default: auto)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.predict.budget = v == "auto" ? -1 : (int32_t) parse_int(w, v, 1, MAX_PREFETCH, " (or auto)"); },
      KNOB, V_INT_OR_WORD, SHOW(s.predict.budget < 0 ? "auto" : show_int(s.predict.budget)) },
    { "--moe-prefetch-tune", "VIS_MOE_PREFETCH_TUNE", "on|off",
      "vis-moe: switch a layer's prefetch off for a while when its reads are wasted more often than used\n"
      "(default: on)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.predict.tune = parse_switch(w, v, false); },
      KNOB, V_SWITCH, SHOW(show_switch(s.predict.tune)) },
};
#undef SHOW
#undef CLEAR
constexpr int N_ROWS = (int) (sizeof(ROWS) / sizeof(ROWS[0]));

const vis_moe_env_row ENV_ROWS[] = {
    { "VIS_MOE_CONFIGURE", "auto|on|off",
      "vis-moe: under --moe-mem, the configurator lowers the ubatch (-ub) where its smaller compute buffer buys\n"
      "expert slots that save more time than the smaller batches cost (docs/planning.md). auto: only on models\n"
      "whose outputs are bit-identical at any ubatch (all-F32 weights), else it says what it would do; on: always\n"
      "(outputs equal upstream's at the chosen -ub); off = the asked -ub (default: auto)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.plan.configure = parse_switch(w, v, true); } },
    { "VIS_MOE_READ_MBPS", "MIB/S",
      "vis-moe: the configurator's expert read bandwidth in MiB/s (default: 0 = probed once per device and cached\n"
      "in ~/.cache/vis-moe/bandwidth)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.plan.read_mbps = parse_real(w, v, 0, 1e7); } },
    { "VIS_MOE_MEM_MBPS", "MIB/S",
      "vis-moe: the configurator's weight bandwidth of a matmul at one token (decode), MiB/s (default: 0 = probed\n"
      "once per weight type, shape and thread count and cached in ~/.cache/vis-moe/compute: docs/planning.md)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.plan.mem_mbps = parse_real(w, v, 0, 1e9); } },
    { "VIS_MOE_TOKEN_NS_PER_MIB", "NS",
      "vis-moe: the configurator's prefill compute, nanoseconds per prompt token per MiB of weights at a large\n"
      "batch (default: probed and cached as VIS_MOE_MEM_MBPS)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.plan.token_ns_per_mib = parse_real(w, v, 0, 1e12); } },
    { "VIS_MOE_PASS_US", "US",
      "vis-moe: the configurator's cost of one extra pass of one layer, microseconds (default: probed and cached\n"
      "as VIS_MOE_MEM_MBPS)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.plan.pass_us = parse_real(w, v, 0, 1e7); } },
    { "VIS_MOE_PASS_TOKEN_US", "US",
      "vis-moe: ... plus this per token of the pass's ubatch, microseconds (default: probed and cached)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.plan.pass_token_us = parse_real(w, v, 0, 1e7); } },
    { "VIS_MOE_PROBE_CACHE", "auto|on|off",
      "vis-moe: cache the configurator's compute probe in ~/.cache/vis-moe/compute. auto: not when the load\n"
      "average exceeds the CPUs (the timings would measure the other processes); on: always; off: never, probe at\n"
      "every start (default: auto)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.plan.probe_cache = parse_switch(w, v, true); } },
    { "VIS_MOE_PLAN_PROMPT", "N",
      "vis-moe: the configurator prices a request of this many prompt tokens (default: 512)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.plan.prompt = (int32_t) parse_int(w, v, 0, 1 << 24); } },
    { "VIS_MOE_PLAN_GEN", "N",
      "vis-moe: ... and this many generated tokens (default: 128)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.plan.gen = (int32_t) parse_int(w, v, 0, 1 << 24); } },
    { "VIS_MOE_SLOT_SPLIT", "FILE",
      "vis-moe: per-layer slot counts: the slots the plan gives every managed layer (--moe-mem, --moe-slots,\n"
      "--moe-cache-mib) are split between the layers by the miss curves in FILE, a split file written by\n"
      "pyvis plan MODEL --profile TRACE --write-split FILE; the slab bytes never exceed the equal split's\n"
      "(docs/planning.md#per-layer-slot-counts; default: unset, equal slots)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.plan.slot_split = parse_path(w, v); } },
    { "VIS_MOE_ONLINE", "on|off",
      "vis-moe: the online controller (llama-server and llama-cli under --moe-mem, CPU): the KV cache's pages are\n"
      "resident only where its cells are used, and the expert slots shrink as the KV cache grows and grow back as\n"
      "it empties, with one log line per resize (docs/planning.md#online-controller; default: off)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.plan.online = parse_switch(w, v, false); } },
    { "VIS_MOE_BORROW", "auto|on|off",
      "vis-moe: under --moe-mem on the CPU, each ubatch runs more expert slots in the bytes the plan reserves for\n"
      "the compute buffer of the asked -ub and that ubatch leaves unused: decode steps the most, larger ubatches\n"
      "what upstream's real compute buffer leaves; outputs unchanged. auto: wherever it applies; on: the same, and\n"
      "the plan line says why where it does not (docs/planning.md#borrowed-slots; default: auto)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.plan.borrow = parse_switch(w, v, true); } },
    { "VIS_MOE_ENCODER_RELEASE", "on|off",
      "vis-moe: a single-turn llama-mtmd-cli run (-p with --image; pyvis chat, Session.release_encoder) under\n"
      "--moe-mem frees the vision encoder once its images are in the KV cache, and the expert slots grow by the\n"
      "encoder's planned bytes for the decode (CPU;\n"
      "docs/planning.md#freeing-the-encoder-after-the-image; default: off)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.plan.encoder_release = parse_switch(w, v, false); } },
    { "VIS_MOE_REPLAY", "TRACE",
      "vis-moe benchmark knob (environment only; llama-server refuses it): every MoE layer runs the experts and\n"
      "weights that the routing trace TRACE (CSV, docs/benchmarks.md#replaying-recorded-routing) recorded for each\n"
      "token position, not its router's; outputs are meaningless. The model must have the trace's MoE layers and\n"
      "experts and a top-k >= the trace's (default: unset)",
      [](vis_moe_settings & s, const std::string & w, const std::string & v) {
          s.replay_path = parse_path(w, v); } },
};
constexpr int N_ENV_ROWS = (int) (sizeof(ENV_ROWS) / sizeof(ENV_ROWS[0]));

} // namespace

const vis_moe_flag_row * vis_moe_flag_rows(int & n) {
    n = N_ROWS;
    return ROWS;
}

const vis_moe_env_row * vis_moe_env_rows(int & n) {
    n = N_ENV_ROWS;
    return ENV_ROWS;
}

vis_moe_settings vis_moe_settings_builtin() {
    vis_moe_settings s;
    s.tier.store      = 0;
    s.tier.host_mib   = -1;
    s.tier.mem_mib    = 0;
    s.tier.io_threads = 4;
    s.tier.direct_io  = -1;
    s.tier.unified    = -1;
    s.tier.mlock      = 1;
    return s;
}

// ranges of the struct fields: the same as the flags' (the C API takes structs, the CLI strings)
void vis_moe_settings_validate(const vis_moe_settings & s) {
    const auto & p = s.params;
    const auto & t = s.tier;
    auto range = [](const char * flag, long long v, long long lo, long long hi, const char * note) {
        if (v < lo || v > hi) {
            throw vis_error(std::string(flag) + " must be in " + std::to_string(lo) + ".." + std::to_string(hi) + note +
                            ", got " + std::to_string(v));
        }
    };
    range("--moe-slots",         p.n_slots,     0, MAX_SLOTS, " (0 = off)");
    range("--moe-cache-mib",     p.cache_mib,   0, MAX_MIB, " (0 = off)");
    range("--moe-pinned-layers", p.n_pinned,   -1, MAX_LAYERS, " (-1 = all)");
    range("--moe-stats",         p.print_stats, 0, 1, "");
    range("--moe-store",         t.store,       0, 1, " (0 = file, 1 = model)");
    range("--moe-host-mib",      t.host_mib,   -1, MAX_MIB, " (-1 = planned)");
    range("--moe-mem",           t.mem_mib,    -1, MAX_MIB, " (-1 = auto, 0 = off)");
    range("--moe-io-threads",    t.io_threads,  1, MAX_IO, "");
    range("--moe-direct-io",     t.direct_io,  -1, 1, " (-1 = auto, 0 = off, 1 = on)");
    range("--moe-unified",       t.unified,    -1, 1, " (-1 = auto, 0 = off, 1 = on)");
    range("--moe-mlock",         t.mlock,       0, 1, "");
    range("--moe-stream-ahead",  s.stream_ahead, 0, 1, "");
    range("--moe-stream-lend",   s.stream_lend, -1, 1, " (-1 = auto, 0 = off, 1 = on)");
    range("--moe-overlap",       s.overlap,    -1, MAX_OVERLAP, " (-1 = on, 0 = off)");
    range("--moe-stream-stage",  s.stream_stage, 0, 1, "");
    range("--moe-pin-mib",       s.pin_mib,    -1, MAX_MIB, " (-1 = auto, 0 = off)");
    range("--moe-policy",        s.policy,      VIS_POLICY_LRU, VIS_POLICY_LFU_ADAPT, " (0 = lru, 1 = lfu, 2 = lfu-adapt)");
    const auto & u = s.sub;
    range("--moe-substitute",    u.mode, VIS_SUB_OFF, VIS_SUB_DROP, " (0 = off, 1 = router, 2 = buddy, 3 = auto, 4 = drop)");
    range("--moe-sub-renorm",    u.renorm, 0, 1, "");
    range("--moe-sub-drop-read", u.drop_read, 0, 1, "");
    range("--moe-mode",          s.mode, VIS_MODE_EXACT, VIS_MODE_FAST, " (0 = exact, 1 = fast)");
    range("--moe-sub-budget",    u.budget, 1, MAX_SUB_BUDGET, "");
    range("--moe-sub-rank",      u.rank, 0, MAX_SUB_BUDGET, " (0 = any)");
    auto real = [](const char * flag, double v, double lo, double hi) {
        if (!(v >= lo && v <= hi)) {
            throw vis_error(std::string(flag) + " must be in " + std::to_string(lo) + ".." + std::to_string(hi) +
                            ", got " + std::to_string(v));
        }
    };
    const auto & q = s.predict;
    range("--moe-predict",       q.mode, VIS_PRED_OFF, VIS_PRED_MLP, " (0 = off .. 5 = auto, 6 = mlp)");
    range("--moe-lookahead",     q.lookahead, 1, VIS_MAX_LOOKAHEAD, "");
    range("--moe-prefetch-budget", q.budget, -1, MAX_PREFETCH, " (-1 = auto)");
    if (q.budget == 0) {
        throw vis_error("--moe-prefetch-budget must be >= 1 (or auto), got 0");
    }
    range("--moe-prefetch-tune", q.tune, 0, 1, "");
    real("--moe-sub-tae", u.tae, 0, u.tae_kind == VIS_TAE_PERCENTILE ? 100 : 1);
    real("--moe-sub-beta", u.beta, 0, 1);
    real("--moe-sub-weight", u.weight, 0, 1);
    real("--moe-sub-drop-share", u.drop_share, 0, 1);
    if (u.margin >= 0) {
        real("--moe-sub-margin", u.margin, 0, 1);
    }
    const auto & c = s.prec;
    range("--moe-precision",     c.mode, VIS_PREC_OFF, VIS_PREC_AUTO, " (0 = off, 1 = vision, 2 = gate, 3 = all, 4 = auto)");
    range("--moe-prec-refetch",  c.refetch, 0, 1, "");
    range("--moe-shadow-slots",  c.shadow_slots, -1, MAX_SLOTS, " (-1 = auto)");
    if (c.shadow_slots == 0) {
        throw vis_error("--moe-shadow-slots must be >= 1 (or auto), got 0");
    }
    real("--moe-prec-vision", c.vision, 0, 1);
    real("--moe-prec-gate", c.gate, 0, 1);
    real("--moe-prec-target", c.target, 0, 1);
    range("--moe-capacity",      s.cap.capacity, -1, MAX_SLOTS, " (-1 = off, 0 = auto)");
    range("--moe-cap-drop",      s.cap.drop, 0, 1, "");
    real("--moe-cap-rho", s.cap.rho, 0, 4);
    real("--moe-cap-delta", s.cap.delta, 0, 16);
    range("--moe-topk",          s.topk, 0, MAX_SUB_BUDGET, " (0 = off)");
    if (p.n_slots > 0 && p.cache_mib > 0) {
        throw vis_error("--moe-slots and --moe-cache-mib are alternatives: give one of them");
    }
}

int32_t llama_vis_moe_max_slots(void) {
    return (int32_t) MAX_SLOTS;
}

long long vis_parse_int(const std::string & what, const std::string & v, long long lo, long long hi, const char * note) {
    return parse_int(what, v, lo, hi, note);
}
