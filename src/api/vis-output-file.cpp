// vis-output-file.cpp - the one check before an output file is written (vis-output-file.h).
#include "vis-output-file.h"

#include <cstdio>
#include <cstring>

#include <sys/stat.h>

std::string vis_output_refusal(const std::string & path, const std::string & ours, const std::string & not_ours,
                               const std::vector<vis_input_file> & inputs) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
        return "";  // nothing there yet
    }
    if (S_ISDIR(st.st_mode)) {
        return "it is a directory";
    }
    if (!S_ISREG(st.st_mode)) {
        return "";  // a device or a pipe (/dev/null): nothing to lose
    }
    for (const auto & in : inputs) {
        struct stat si;
        if (!in.path.empty() && stat(in.path.c_str(), &si) == 0 && si.st_dev == st.st_dev && si.st_ino == st.st_ino) {
            return "it is " + in.what + " of this run (" + in.path + ")";
        }
    }
    FILE * f = std::fopen(path.c_str(), "rb");
    if (!f) {
        return "";  // not readable: opening it for writing says why
    }
    std::string head(ours.size(), '\0');
    const size_t n = std::fread(&head[0], 1, head.size(), f);
    std::fclose(f);
    head.resize(n);
    if (n == 0 || head == ours) {
        return "";
    }
    if (n >= 4 && head.compare(0, 4, "GGUF") == 0) {
        return "it is a GGUF model file";
    }
    return "it exists and is not " + not_ours;
}
