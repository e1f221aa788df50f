"""The fork's runtime from Python: native bindings, loading with the expert cache, memory plan,
routing traces and cache simulation.

    capi       1:1 ctypes mirror of src/api/llama-vis.h
    native     friendly layer over it: dataclasses, VisError, wrappers
    config     MoeConfig: every --moe-* setting as one typed object, applied per call and thread
    settings   the process-wide --moe-* settings (the C structs) and pyvis.vlm's sections of a MoeConfig
    plan       `pyvis plan`: how a model splits over slabs, host cache and file
    trace      the routing trace (--moe-trace files, .npz), one model for every tool
    cachesim   offline LRU / Belady simulation of the expert cache on a trace
    devices    Jetson Orin SKUs: the budget and systemd unit of each (pyvis plan --device, jetson/install.sh)
"""
