// vis-moe-route-csv.cpp - the shared CSV routing-trace reader (vis-moe-route-csv.h).
#include "vis-moe-route-csv.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <tuple>

namespace {

constexpr long long MAX_LAYERS = 1 << 12;
constexpr long long MAX_EXPERTS = 1 << 16;
constexpr long long MAX_POS = 1 << 22;
const char * const HEADER = "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes";

struct reader {
    const std::string & path;
    int line = 0;

    [[noreturn]] void fail(const std::string & why) const {
        throw std::runtime_error("VIS_MOE_REPLAY: " + path + (line > 0 ? ":" + std::to_string(line) : "") + ": " + why);
    }

    long long integer(const std::string & v, const char * what, long long lo, long long hi) const {
        bool ok = !v.empty();
        for (size_t i = (ok && v[0] == '-') ? 1 : 0; ok && i < v.size(); ++i) {
            ok = std::isdigit((unsigned char) v[i]) != 0;
        }
        errno = 0;
        const long long r = ok && v != "-" ? std::strtoll(v.c_str(), nullptr, 10) : 0;
        if (!ok || v == "-" || errno == ERANGE || r < lo || r > hi) {
            fail(std::string(what) + " must be an integer in " + std::to_string(lo) + ".." + std::to_string(hi) +
                 ", got '" + v + "'");
        }
        return r;
    }

    float real(const std::string & v, const char * what) const {
        char * end = nullptr;
        errno = 0;
        const double r = v.empty() || std::isspace((unsigned char) v[0]) ? NAN : std::strtod(v.c_str(), &end);
        if (v.empty() || !end || *end != '\0' || errno == ERANGE || !std::isfinite(r)) {
            fail(std::string(what) + " must be a finite number, got '" + v + "'");
        }
        return (float) r;
    }
};

// "key=value" words of a preamble line
std::map<std::string, std::string> words(const std::string & s) {
    std::map<std::string, std::string> out;
    std::istringstream in(s);
    std::string w;
    while (in >> w) {
        const size_t eq = w.find('=');
        if (eq != std::string::npos && eq > 0) {
            out[w.substr(0, eq)] = w.substr(eq + 1);
        }
    }
    return out;
}

} // namespace

vis_route_csv vis_route_csv_read(const std::string & path) {
    reader rd{ path };
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        rd.fail(std::string("cannot open the routing trace: ") + std::strerror(errno) +
                " (give the path of a CSV routing trace, format in docs/benchmarks.md#replaying-recorded-routing)");
    }
    vis_route_csv t;
    t.path = path;
    bool header = false;
    struct row { int pos, layer, slot, expert; float w; int phase; int line; };
    std::vector<row> rows;
    std::string s;
    while (std::getline(in, s)) {
        rd.line++;
        if (!s.empty() && s.back() == '\r') {
            s.pop_back();
        }
        if (s.empty()) {
            continue;
        }
        if (s[0] == '#') {
            if (header) {
                rd.fail("a '#' line after the column header");
            }
            const auto w = words(s.substr(1));
            if (w.count("n_layer") || w.count("n_expert") || w.count("n_expert_used")) {
                if (t.n_layer) {
                    rd.fail("a second model line (n_layer=, n_expert=, n_expert_used=)");
                }
                for (const char * key : { "n_layer", "n_expert", "n_expert_used" }) {
                    if (!w.count(key)) {
                        rd.fail(std::string("the model line lacks ") + key + "=");
                    }
                }
                t.n_layer  = (int) rd.integer(w.at("n_layer"), "n_layer", 1, MAX_LAYERS);
                t.n_expert = (int) rd.integer(w.at("n_expert"), "n_expert", 1, MAX_EXPERTS);
                t.k        = (int) rd.integer(w.at("n_expert_used"), "n_expert_used", 1, t.n_expert);
            }
            continue;
        }
        if (!header) {
            if (s != HEADER) {
                rd.fail("expected the column header '" + std::string(HEADER) + "', got '" + s + "'");
            }
            if (!t.n_layer) {
                rd.fail("no model line ('# ... n_layer=L n_expert=E n_expert_used=K') before the column header");
            }
            header = true;
            continue;
        }
        std::vector<std::string> f;
        size_t a = 0;
        for (size_t b; (b = s.find(',', a)) != std::string::npos; a = b + 1) {
            f.push_back(s.substr(a, b - a));
        }
        f.push_back(s.substr(a));
        if (f.size() != 9) {
            rd.fail("expected 9 comma-separated fields (" + std::string(HEADER) + "), got " + std::to_string(f.size()));
        }
        row r;
        rd.integer(f[0], "turn", 0, MAX_POS);
        r.phase  = (int) rd.integer(f[1], "phase", 0, 1);
        r.pos    = (int) rd.integer(f[2], "step", 0, MAX_POS - 1);
        r.layer  = (int) rd.integer(f[3], "layer", 0, t.n_layer - 1);
        r.slot   = (int) rd.integer(f[4], "slot", 0, t.k - 1);
        r.expert = (int) rd.integer(f[5], "expert", 0, t.n_expert - 1);
        r.w      = rd.real(f[6], "weight");
        rd.integer(f[7], "residency", 0, 1);
        rd.integer(f[8], "expert_bytes", 0, 1ll << 40);
        r.line   = rd.line;
        rows.push_back(r);
    }
    if (!header) {
        rd.line = 0;
        rd.fail(t.n_layer ? "no column header and no rows" : "not a routing trace (no '# ... n_layer= n_expert= "
                "n_expert_used=' model line and no column header)");
    }
    if (rows.empty()) {
        rd.line = 0;
        rd.fail("no routing rows after the column header");
    }
    for (const row & r : rows) {
        t.n_pos = std::max(t.n_pos, r.pos + 1);
    }
    t.ids.assign((size_t) t.n_pos * t.n_layer * t.k, -1);
    t.weights.assign(t.ids.size(), 0.0f);
    std::vector<int8_t> phase(t.n_pos, -1);
    for (const row & r : rows) {
        rd.line = r.line;
        const size_t at = ((size_t) r.pos * t.n_layer + r.layer) * t.k + r.slot;
        if (t.ids[at] >= 0) {
            rd.fail("step " + std::to_string(r.pos) + ", layer " + std::to_string(r.layer) + ", slot " +
                    std::to_string(r.slot) + " appears twice");
        }
        if (phase[r.pos] >= 0 && phase[r.pos] != r.phase) {
            rd.fail("step " + std::to_string(r.pos) + " has rows of both phases");
        }
        phase[r.pos] = (int8_t) r.phase;
        t.ids[at]     = r.expert;
        t.weights[at] = r.w;
    }
    rd.line = 0;
    for (int p = 0; p < t.n_pos; ++p) {
        if (phase[p] < 0) {
            rd.fail("step " + std::to_string(p) + " has no rows (steps must run 0.." + std::to_string(t.n_pos - 1) +
                    " without a gap)");
        }
        if (phase[p] == 0 && p > 0 && phase[p - 1] == 1) {
            rd.fail("prompt step " + std::to_string(p) + " comes after a generated step");
        }
        t.n_prompt += phase[p] == 0 ? 1 : 0;
    }
    for (int p = 0; p < t.n_pos; ++p) {
        for (int l = 0; l < t.n_layer; ++l) {
            const int32_t * e = t.ids_at(p, l);
            const int n = (int) std::count_if(e, e + t.k, [](int32_t x) { return x >= 0; });
            if (n == 0 && p >= t.n_prompt - 1) {
                rd.fail("step " + std::to_string(p) + " has no rows for layer " + std::to_string(l) + ": only prompt "
                        "steps before the last may lack layers (a recording computes the last layer for the output "
                        "rows only); every generated step and the last prompt step need all " +
                        std::to_string(t.n_layer));
            }
            if (n != 0 && n != t.k) {
                rd.fail("step " + std::to_string(p) + ", layer " + std::to_string(l) + " has " + std::to_string(n) +
                        " of its " + std::to_string(t.k) + " slots");
            }
            std::vector<int32_t> sorted(e, e + t.k);
            std::sort(sorted.begin(), sorted.end());
            if (n == t.k && std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
                rd.fail("step " + std::to_string(p) + ", layer " + std::to_string(l) + " selects the same expert twice");
            }
        }
    }
    return t;
}
