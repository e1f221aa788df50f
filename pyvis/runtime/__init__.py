"""The fork's runtime from Python: native bindings, loading with the expert cache, memory plan,
routing traces and cache simulation.

    capi       1:1 ctypes mirror of src/llama-vis.h
    native     friendly layer over it: dataclasses, VisError, wrappers
    settings   the --moe-* settings: typed, range-checked, applied per call and thread
    moe        pyvis.moe.load(...): a llama_cpp.Llama with the expert cache, its stats
    plan       `pyvis plan`: how a model splits over slabs, host cache and file
    trace      the routing trace (--moe-trace files, .npz), one model for every tool
    cachesim   offline LRU / Belady simulation of the expert cache on a trace
    devices    Jetson Orin SKUs: the budget and systemd unit of each (pyvis plan --device, jetson/install.sh)
"""
