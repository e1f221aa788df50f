// vis-moe-cost-cache.cpp - the cost model's cache files (vis-moe-cost-cache.h).
#include "vis-moe-cost-cache.h"

#include <chrono>
#include <cstdlib>
#include <fstream>

#include <sys/stat.h>

std::string vis_moe_cost_cache_file(const std::string & name) {
    const char * xdg  = std::getenv("XDG_CACHE_HOME");
    const char * home = std::getenv("HOME");
    const std::string dir = xdg && *xdg ? xdg : std::string(home && *home ? home : "/tmp") + "/.cache";
    return dir + "/vis-moe/" + name;
}

void vis_moe_cost_cache_append(const std::string & name, const std::string & line) {
    const std::string path = vis_moe_cost_cache_file(name);
    const std::string dir = path.substr(0, path.rfind('/'));
    ::mkdir(dir.substr(0, dir.rfind('/')).c_str(), 0755);
    ::mkdir(dir.c_str(), 0755);
    std::ofstream f(path, std::ios::app);
    if (f) {
        f << line << "\n";
    }
}

double vis_moe_cost_now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
