// vis-output-file.h - whether an output file of ours (--moe-trace, --moe-csv) may be written at a path: never over
// an input of the run, a model or any file we did not write.
#pragma once

#include <string>
#include <vector>

// a file the run reads, and what it is ("the model file", "the --moe-shadow file")
struct vis_input_file {
    std::string path, what;
};

// "" when `path` may be written: nothing there, an empty file, a device or a pipe (/dev/null), or a file that starts
// with `ours` (what we write first: a magic, a header line); else why not: a directory, one of `inputs` (the same
// file, by device and inode), a GGUF model, or "it exists and is not " + `not_ours`
std::string vis_output_refusal(const std::string & path, const std::string & ours, const std::string & not_ours,
                               const std::vector<vis_input_file> & inputs = {});
