// vis-moe-csv.h - the --moe-csv writer (docs/telemetry.md#the-csv): one row per ubatch of a context, a
// generated token being one decode ubatch; columns in VIS_MOE_CSV_HEADER.
#pragma once

#include "vis-moe-telemetry-types.h"
#include "vis-output-file.h"

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

// the header line, without its newline: the first line of every file we write, and what an existing file must
// start with to be overwritten
extern const char * const VIS_MOE_CSV_HEADER;

class vis_moe_csv {
public:
    // throws std::runtime_error naming the flag, the file and the fix when vis_output_refusal refuses it (one of
    // `inputs`, a model, a directory, a file that is not an earlier --moe-csv) or it cannot be opened; writes the header
    vis_moe_csv(const std::string & path, const std::vector<vis_input_file> & inputs);
    ~vis_moe_csv();
    vis_moe_csv(const vis_moe_csv &) = delete;
    vis_moe_csv & operator=(const vis_moe_csv &) = delete;

    // one row, flushed to the file at once (a crash keeps every row written before it); "" or the message of the
    // first write error
    std::string write(const vis_moe_step & st, const std::string & mode);

    const std::string & path() const { return file_path; }

private:
    std::string file_path;
    FILE *      f = nullptr;
    std::string error;
    std::pair<uint64_t, uint64_t> open_key;  // its (device, inode) in the set of files this process writes
    bool        registered = false;
};
